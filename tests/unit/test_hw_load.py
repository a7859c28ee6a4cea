"""Loading the frozen encoders of a pretrained folder (e2v/models/load.py): UMT5 and CLIP are read
straight onto the rank's device (transformers' `device_map`), with the same weights a plain load
gives."""

from __future__ import annotations

import torch
from helpers import save_t2v_and_clip_folders

from e2v.config.load import load_config


def test_encoders_are_read_straight_to_the_device(tmp_path, monkeypatch):
    """Every encoder load asks transformers for the rank's device (on this machine: the CPU; on a
    GPU, the load never makes a host copy), and the weights equal a plain from_pretrained's (the
    oracle: transformers' own default load)."""
    from transformers import CLIPVisionModel, UMT5EncoderModel

    from e2v.models.load import load_parts

    t2v, clip, _ = save_t2v_and_clip_folders(tmp_path)
    cfg = load_config("configs/e2v_tiny_lora.yaml", ["model.preset=null", f"model.pretrained={t2v}", "model.base=t2v",
                                                     f"model.image_encoder={clip}", "model.weight_dtype=fp32"],
                      check_paths=False)
    asked = {}
    for cls in (UMT5EncoderModel, CLIPVisionModel):
        real = cls.from_pretrained.__func__

        def recording(klass, *a, _real=real, **kw):
            asked[klass.__name__] = kw.get("device_map")
            return _real(klass, *a, **kw)

        monkeypatch.setattr(cls, "from_pretrained", classmethod(recording))
    parts = load_parts(cfg, device="cpu")
    assert asked == {"UMT5EncoderModel": {"": "cpu"}, "CLIPVisionModel": {"": "cpu"}}
    monkeypatch.undo()
    plain_text = UMT5EncoderModel.from_pretrained(str(t2v), subfolder="text_encoder", torch_dtype=torch.float32)
    plain_clip = CLIPVisionModel.from_pretrained(str(clip), subfolder="image_encoder", torch_dtype=torch.float32)
    for ours, plain in ((parts.text_encoder, plain_text), (parts.image_encoder, plain_clip)):
        want = plain.state_dict()
        got = ours.state_dict()
        assert want.keys() == got.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)
        assert not any(p.requires_grad for p in ours.parameters()) and not ours.training
