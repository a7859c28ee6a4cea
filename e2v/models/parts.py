"""What a model is made of (`Parts`), where its weights come from, and how its frozen encoders
are prepared: the contract between loading (e2v/models/load.py, e2v/models/tiny.py) and everything that
runs the parts (conditioning, the step, validation, the tools)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from e2v.config.bases import resolve_pretrained

if TYPE_CHECKING:  # annotations only: the CLIP processor's users need neither torch nor diffusers
    import torch
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

CLIP_VIT_H = (257, 1280)  # tokens per reference (16 x 16 patches + CLS at 224 px), width: Wan I2V's CLIP


@dataclass
class Parts:
    """Everything a step needs. Encoders are None when the cache replaces them or e2v_type skips them."""

    transformer: WanTransformer3DModel
    vae: AutoencoderKLWan | None = None
    text_encoder: Any = None
    tokenizer: Any = None
    image_encoder: Any = None
    image_processor: Any = None
    # ZeRO-3 load only (load_transformer_zero3): fp32 file values of the _keep_in_fp32_modules
    # parameters, for fp32_kept_params (their partitions hold a slice, in the training dtype).
    fp32_file_values: dict[str, torch.Tensor] | None = None


def clip_location(cfg) -> tuple[str, bool]:
    """Where the config's CLIP image encoder is: (model.image_encoder, else the resolved
    model.pretrained; whether it is a diffusers I2V pipeline, which keeps it in image_encoder/ and
    image_processor/: a local folder with image_encoder/, or a Wan *-Diffusers hub id). A plain
    CLIP folder has both at its top."""
    path = cfg.model.image_encoder or resolve_pretrained(cfg.model.pretrained)
    local = Path(path)
    return path, (local / "image_encoder").is_dir() or (not local.exists() and path.endswith("-Diffusers"))


def place_encoders(parts: Parts, device) -> Parts:
    """The frozen encoders (VAE, UMT5, CLIP) in eval mode, without gradients, on `device`: the one
    place they are prepared. They stay resident for the run (see e2v/train/memory.py's
    encoder term); the cache (cache.enabled) is how a run goes without them."""
    for m in (parts.vae, parts.text_encoder, parts.image_encoder):
        if m is not None:
            m.requires_grad_(False).eval().to(device)
    return parts


def clip_image_processor(path: str | None = None, subfolder: str | None = None, **kwargs):
    """The PIL CLIP image processor: from a folder (`path`), else built from `kwargs`.

    A2's CLIP pixels come from the PIL processor. transformers 5 made `CLIPImageProcessor` the
    torchvision-backed one whenever torchvision is importable, and its resize moves pixels by a
    few levels, so which one ran would depend on what else is installed. The PIL class is
    `CLIPImageProcessorPil` from transformers 5, `CLIPImageProcessor` itself before."""
    try:
        from transformers import CLIPImageProcessorPil as cls
    except ImportError:
        from transformers import CLIPImageProcessor as cls
    return cls.from_pretrained(path, subfolder=subfolder) if path is not None else cls(**kwargs)
