"""Random-weight diffusers folders with the real Wan2.1 shapes, built in seconds and nothing
downloaded: the T2V-1.3B transformer (KNOWN_WAN_CONFIGS) saved in safetensors shards with an
index, the Wan2.1 VAE (AutoencoderKLWan()), a UMT5 encoder of UMT5-XXL's width with ONE layer and
the tiny word-level vocabulary (e2v.models.tiny.build_tiny_tokenizer, saved so it loads offline), and CLIP
ViT-H/14's vision tower with Wan's image processor (224 px crop) in an I2V-style folder
(image_encoder/, image_processor/), as configs/e2v_t2v_1.3b.yaml's model.image_encoder expects.

Weights: every model is built without its init (diffusers' / transformers' no_init_weights: the
allocation is never touched) and filled with a seeded normal of std 0.02; norm scales are 1 and
norm shifts 0. Not zeros: a zero model would hide overflow and dead-gradient bugs; std 0.02 keeps
a random 30-layer model finite in bf16 (1 / sqrt(width) would too; 0.02 is the usual init scale).

`scale="small"` keeps every width and cuts the depths (transformer 2 layers, CLIP 2): the same
code paths in seconds, for developing the smoke run itself. `scale="wide"` is the main path's
transformer, Wan2.1-I2V-14B-480P (width 5120, 36 input channels, image attention), with 2 of its
40 layers (bench/gpu_check.py: the 14B path's code at its real widths). `build_tiny_folders`
saves the tiny preset as such folders, for running those tools' logic on a CPU."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
STD = 0.02
T2V_ID = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
I2V_ID = "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers"
MODEL_IDS = {"full": T2V_ID, "small": T2V_ID, "wide": I2V_ID}
FOLDER_NAMES = {"full": "Wan2.1-T2V-1.3B-full", "small": "Wan2.1-T2V-1.3B-small", "wide": "Wan2.1-I2V-14B-2layers"}
# 2.9 GB of bf16 transformer -> 3 shards + an index, like the published folders (small: 0.24 GB -> 3)
SHARD = {"full": "1GB", "small": "100MB", "wide": "1GB"}
DEPTHS = {"full": dict(transformer=30, clip=32), "small": dict(transformer=2, clip=2), "wide": dict(transformer=2, clip=2)}
BUILD_VERSION = 2  # bump when what is built changes: a folder built by another version is rebuilt


def fill_(model: torch.nn.Module, seed: int, dtype: torch.dtype) -> torch.nn.Module:
    """Every parameter filled in `dtype` from one seeded generator, in parameter order: normal(0,
    STD), except a norm module's scale (1) and shift (0). Each parameter is replaced by a fresh
    tensor, so the untouched allocation of the uninitialised build never becomes resident."""
    g = torch.Generator().manual_seed(seed)
    filled: dict[int, torch.nn.Parameter] = {}  # a tied parameter (UMT5's embedding) stays one tensor
    with torch.no_grad():
        for module in model.modules():
            is_norm = "norm" in type(module).__name__.lower()
            for name, p in module.named_parameters(recurse=False):
                if id(p) in filled:
                    setattr(module, name, filled[id(p)])
                    continue
                t = torch.empty(p.shape, dtype=dtype)
                if is_norm and name in ("weight", "gamma"):
                    t.fill_(1.0)
                elif is_norm and name in ("bias", "beta"):
                    t.zero_()
                else:
                    t.normal_(0.0, STD, generator=g)
                filled[id(p)] = torch.nn.Parameter(t, requires_grad=p.requires_grad)
                setattr(module, name, filled[id(p)])
    return model


def transformer_config(scale: str) -> dict:
    from e2v.models.plan import KNOWN_WAN_CONFIGS

    return {**KNOWN_WAN_CONFIGS[MODEL_IDS[scale]], "num_layers": DEPTHS[scale]["transformer"]}


def build_transformer(scale: str, seed: int):
    from diffusers import WanTransformer3DModel
    from diffusers.models.modeling_utils import no_init_weights

    with no_init_weights():
        model = WanTransformer3DModel(**transformer_config(scale))
    return fill_(model, seed, torch.bfloat16)


def build_vae(seed: int):
    from diffusers import AutoencoderKLWan
    from diffusers.models.modeling_utils import no_init_weights

    with no_init_weights():
        vae = AutoencoderKLWan()  # the default constructor is the Wan2.1 VAE
    return fill_(vae, seed, torch.float32)


def build_text_encoder(tokenizer, seed: int):
    """UMT5-XXL's encoder width (d_model 4096, 64 heads x 64, d_ff 10240) with ONE layer and the
    tiny tokenizer's vocabulary: the real per-token cost of a layer, 1/24 of the depth."""
    from transformers import UMT5Config, UMT5EncoderModel
    from transformers.initialization import no_init_weights

    from e2v.models.plan import UMT5_XXL

    config = UMT5Config(**{**UMT5_XXL, "num_layers": 1, "vocab_size": len(tokenizer)}, dropout_rate=0.0)
    with no_init_weights():
        model = UMT5EncoderModel(config)
    return fill_(model, seed, torch.bfloat16)


def build_clip(scale: str, seed: int):
    from transformers import CLIPVisionConfig, CLIPVisionModel
    from transformers.initialization import no_init_weights

    from e2v.models.plan import CLIP_VIT_H14

    config = CLIPVisionConfig(**{**CLIP_VIT_H14, "num_hidden_layers": DEPTHS[scale]["clip"]}, hidden_act="gelu",
                              layer_norm_eps=1e-5)
    with no_init_weights():
        model = CLIPVisionModel(config)
    return fill_(model, seed, torch.float32)


def wan_image_processor():
    """Wan I2V's CLIPImageProcessor settings: shortest edge 224, 224 x 224 centre crop, bicubic,
    OpenAI CLIP mean / std (the class defaults), through e2v.models.parts' PIL class."""
    from e2v.models.parts import clip_image_processor

    return clip_image_processor(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224},
                                do_center_crop=True, do_resize=True, resample=3)


def _done(folder: Path, what: dict) -> bool:
    marker = folder / ".smoke_complete"
    return marker.exists() and json.loads(marker.read_text()) == what


def build_folders(root: Path, scale: str = "full", seed: int = 0, log=print) -> dict[str, Path]:
    """root/Wan2.1-T2V-1.3B (WanPipeline: transformer in shards, vae, text_encoder, tokenizer,
    scheduler) and root/Wan2.1-CLIP-ViT-H14 (image_encoder/, image_processor/). Kept when built
    before with the same parameters (a `.smoke_complete` marker), else rebuilt."""
    from diffusers import UniPCMultistepScheduler, WanPipeline

    from e2v.models.tiny import build_tiny_tokenizer

    what = {"version": BUILD_VERSION, "scale": scale, "seed": seed, "std": STD}
    t2v, clip = root / FOLDER_NAMES[scale], root / f"Wan2.1-CLIP-ViT-H14-{scale}"
    if not _done(t2v, what):
        shutil.rmtree(t2v, ignore_errors=True)
        tokenizer = build_tiny_tokenizer()
        pipe = WanPipeline(tokenizer=tokenizer, text_encoder=build_text_encoder(tokenizer, seed + 1),
                           vae=build_vae(seed + 2), transformer=build_transformer(scale, seed),
                           scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                             flow_shift=5.0))
        pipe.save_pretrained(t2v, max_shard_size=SHARD[scale])
        del pipe
        (t2v / ".smoke_complete").write_text(json.dumps(what))
        log(f"[smoke] built {t2v}")
    if not _done(clip, what):
        shutil.rmtree(clip, ignore_errors=True)
        build_clip(scale, seed + 3).save_pretrained(clip / "image_encoder")
        wan_image_processor().save_pretrained(clip / "image_processor")
        (clip / ".smoke_complete").write_text(json.dumps(what))
        log(f"[smoke] built {clip}")
    return {"t2v": t2v, "clip": clip}


def build_tiny_folders(root: Path) -> dict[str, Path]:
    """The tiny preset (e2v.models.tiny) saved as a user's folders, in seconds: root/t2v (a
    WanPipeline of the 16-channel transformer), root/i2v (the same with the 36-channel I2V
    transformer) and root/clip (the tiny CLIP in an I2V pipeline's image_encoder/ and
    image_processor/). Rebuilt unless a marker says they are complete."""
    from diffusers import UniPCMultistepScheduler, WanPipeline

    from e2v.models.tiny import build_tiny_parts

    what = {"version": BUILD_VERSION, "scale": "tiny"}
    if _done(root, what):
        return {"t2v": root / "t2v", "i2v": root / "i2v", "clip": root / "clip"}
    shutil.rmtree(root, ignore_errors=True)
    for name, base in (("t2v", "t2v"), ("i2v", "i2v")):
        p = build_tiny_parts(seed=0, base=base)
        WanPipeline(tokenizer=p.tokenizer, text_encoder=p.text_encoder, vae=p.vae, transformer=p.transformer,
                    scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True),
                    ).save_pretrained(root / name)
    p.image_encoder.save_pretrained(root / "clip" / "image_encoder")
    p.image_processor.save_pretrained(root / "clip" / "image_processor")
    (root / ".smoke_complete").write_text(json.dumps(what))
    return {"t2v": root / "t2v", "i2v": root / "i2v", "clip": root / "clip"}


def build_data(root: Path, frames: int, size: int, samples: int = 4) -> dict[str, Path]:
    """The three layouts at frames x size x size: the E2V demo folder (tools/make_demo_dataset.py),
    an npz JSONL manifest (t2v_lora) and a CSV of mp4 clips (video_regression), both from
    tests/helpers_t2v.py."""
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers_t2v import make_csv_videos, make_npz_manifest

    from e2v.data.demo import main as make_demo

    e2v, t2v, reg = root / f"e2v_{frames}x{size}", root / f"t2v_{frames}x{size}", root / f"reg_{frames}x{size}"
    make_demo([str(e2v), "--num-samples", str(samples), "--size", str(size), "--frames", str(frames)])
    if not (t2v / "train.jsonl").exists():
        make_npz_manifest(t2v, num_clips=samples, num_frames=frames, height=size, width=size)
    if not (reg / "metadata.csv").exists():
        make_csv_videos(reg, num_clips=samples, num_frames=frames, height=size, width=size)
    return {"e2v": e2v, "t2v": t2v, "regression": reg}
