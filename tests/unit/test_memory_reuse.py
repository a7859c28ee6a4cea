"""What validation and sampling reuse is read once and kept on the host (e2v/models/load.py): a
one-expert Wan2.2 run's other expert, a cached run's encoders; tools/sample.py's two experts take
turns on the device, swapped at the boundary; a full fine-tune's export is sampled in the base's
dtype, not fp32."""

from __future__ import annotations

import torch
from helpers import ROOT

from e2v.config.load import load_config


def tiny_cfg(*sets):
    return load_config(ROOT / "configs/e2v_tiny_lora.yaml", list(sets), check_paths=False)


def on_cpu(module) -> bool:
    return all(p.device.type == "cpu" for p in module.parameters())


def test_the_other_expert_is_read_once_and_kept_on_the_host(monkeypatch):
    import e2v.models.load as load
    from e2v.models.load import load_parts, with_all_experts

    cfg = tiny_cfg("model.preset=tiny_wan22_a14b", "model.expert=high_noise")
    parts = load_parts(cfg)
    reads = []
    real = load.load_base_experts
    monkeypatch.setattr(load, "load_base_experts", lambda *a, **kw: reads.append(a[1]) or real(*a, **kw))
    host = {}
    for _ in range(3):  # three validations
        with with_all_experts(parts.transformer, parts, cfg, "cpu", torch.float32, host) as full:
            assert callable(full) and full is not parts.transformer
    assert reads == [["low_noise"]] and set(host["experts"]) == {"low_noise"}
    assert all(v.device.type == "cpu" for v in host["experts"]["low_noise"].state.values())
    with with_all_experts(parts.transformer, parts, cfg, "cpu", torch.float32):  # no host: read each time
        pass
    assert len(reads) == 2


def test_a_cached_runs_encoders_are_read_once_for_every_validation(monkeypatch):
    import e2v.models.load as load
    from e2v.models.load import with_encoders
    from e2v.models.parts import Parts

    cfg = tiny_cfg("cache.enabled=true")
    run_parts = Parts(transformer=torch.nn.Linear(2, 2))  # a cached run: no encoders
    reads = []
    real = load.load_parts
    monkeypatch.setattr(load, "load_parts", lambda *a, **kw: reads.append(kw) or real(*a, **kw))
    vaes = []
    host = {}
    for _ in range(3):
        with with_encoders(run_parts, cfg, "cpu", host) as parts:
            assert parts.vae is not None and parts.transformer is run_parts.transformer
            vaes.append(parts.vae)
    assert len(reads) == 1 and reads[0]["device"] == "cpu"
    assert vaes[0] is vaes[1] is vaes[2] and on_cpu(host["encoders"].vae)


class Expert(torch.nn.Module):
    """Stands in for a 14B expert: records where it is moved, answers with its name."""

    def __init__(self, name: str, moves: list):
        super().__init__()
        self.name, self.moves, self.weight = name, moves, torch.nn.Parameter(torch.zeros(1))

    def to(self, device, *a, **kw):
        self.moves.append((self.name, str(device)))
        return self

    def forward(self, hidden_states, timestep, **kwargs):
        return self.name


def test_sampling_swaps_the_two_experts_at_the_boundary():
    """A denoising loop over the boundary (0.9: timesteps >= 900 are the high-noise expert's), two
    videos: one expert on the device at a time, each moved there when its timesteps come."""
    from e2v.models.load import swap_on_device

    moves = []
    call = swap_on_device({"high_noise": Expert("high_noise", moves), "low_noise": Expert("low_noise", moves)},
                          0.9, "cuda:0")
    ran = [call(None, torch.tensor([t])) for t in (999, 950, 900, 899, 500, 10) * 2]
    assert ran == ["high_noise"] * 3 + ["low_noise"] * 3 + ["high_noise"] * 3 + ["low_noise"] * 3
    assert moves == [("high_noise", "cuda:0"), ("high_noise", "cpu"), ("low_noise", "cuda:0"),
                     ("low_noise", "cpu"), ("high_noise", "cuda:0"), ("high_noise", "cpu"), ("low_noise", "cuda:0")]


def test_for_sampling_keeps_two_experts_on_the_host_in_the_sampling_dtype():
    from e2v.models.load import for_sampling, load_parts

    parts = load_parts(tiny_cfg("model.preset=tiny_wan22_a14b", "model.expert=both"))
    call = for_sampling(parts.transformer, "cpu", torch.bfloat16)
    assert call.on_device["name"] is None and set(call.experts) == {"high_noise", "low_noise"}
    assert {p.dtype for e in call.experts.values() for n, p in e.named_parameters() if "norm" not in n and
            "scale_shift" not in n and "time_embedder" not in n} == {torch.bfloat16}


def test_a_full_fine_tune_is_sampled_in_the_base_dtype(tiny_parts, tmp_path):
    import copy

    from e2v.eval.sampling import load_trained
    from e2v.models.precision import kept_in_fp32, model_dtype, to_inference_dtype
    from e2v.train.export import FULL_DIR

    base = to_inference_dtype(copy.deepcopy(tiny_parts.transformer), "cpu", torch.bfloat16)
    base.save_pretrained(tmp_path / FULL_DIR)  # the export's layout: bf16, fp32 where diffusers keeps fp32
    model = load_trained(base, tmp_path)
    assert model is not base and model_dtype(model) == torch.bfloat16
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert all(d == (torch.float32 if kept_in_fp32(n) else torch.bfloat16) for n, d in dtypes.items()), dtypes
