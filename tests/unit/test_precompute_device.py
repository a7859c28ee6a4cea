"""tools/precompute.py sets its rank's GPU as the current device (LOCAL_RANK), before it loads or
encodes anything: without it every rank's cuDNN handles and current-device tensors land on cuda:0."""

from __future__ import annotations

import pytest
import torch
from helpers import ROOT


class Stop(Exception):
    pass


def test_precompute_sets_its_ranks_device_first(demo_data, monkeypatch):
    import e2v.conditioning.cached  # noqa: F401  the stages precompute imports after its config check: here,
    import e2v.models.load  # noqa: F401  before CUDA is faked (peft's bitsandbytes probe would take it as real)
    import tools.precompute as precompute

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(torch.device(d)))
    import e2v.data.dataset

    monkeypatch.setattr(e2v.data.dataset, "index_samples", lambda *a, **kw: (_ for _ in ()).throw(Stop()))
    monkeypatch.setenv("LOCAL_RANK", "3")
    with pytest.raises(Stop):
        precompute.main(["--config", str(ROOT / "configs/e2v_tiny.yaml"), "--set",
                         f"data.datasets.0.data_root={demo_data}", "--local_rank", "3"])
    assert calls == [torch.device("cuda", 3)]
