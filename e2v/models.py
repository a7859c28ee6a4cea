"""The Wan parts: load them (diffusers `from_pretrained`), or build the tiny random-weight preset in
code; expand a T2V transformer to take element conditions; attach LoRA and pick what trains.

The tiny preset is the real code path with small configs (docs/architecture.md, "Tensor contracts"),
so tests and the CPU demo exercise exactly what a 14B run does. Nothing here downloads anything
unless `model.pretrained` names a hub id.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKLWan, WanTransformer3DModel

from e2v.config import Config
from e2v.device import accelerator_device
from e2v.schema import check_plain_t2v_base

# LoRA targets that wrap exactly the attention and FFN layers of every Wan block (self- and
# cross-attention projections, the image K/V projections, both FFN linears).
ALL_LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_k_proj", "add_v_proj", "ffn.net.0.proj", "ffn.net.2"]

# Modules a T2V base gains when expanded for elements, per pathway; they start neutral and train
# in full. `vae` widens the patch embedding (condition channels), `clip` adds image cross-attention.
EXPANSION_MODULES = {
    "vae": [r"^patch_embedding\."],
    "clip": [r"\.add_k_proj\.", r"\.add_v_proj\.", r"\.norm_added_k\.", r"^condition_embedder\.image_embedder\."],
}

# Transformer configs of the released Wan2.1 checkpoints (diffusers' conversion script; their
# parameter counts, 1.42 B / 14.29 B / 16.40 B, are checked in tests/test_expand.py),
# so `--dry_run` builds a hub-id model on the meta device without downloading its config.
_WAN_COMMON = dict(patch_size=[1, 2, 2], attention_head_dim=128, out_channels=16, text_dim=4096, freq_dim=256,
                   cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
_WAN_14B = dict(num_attention_heads=40, num_layers=40, ffn_dim=13824)
_WAN_I2V = dict(in_channels=36, image_dim=1280, added_kv_proj_dim=5120)
KNOWN_WAN_CONFIGS = {
    "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": {**_WAN_COMMON, "num_attention_heads": 12, "num_layers": 30,
                                         "ffn_dim": 8960, "in_channels": 16},
    "Wan-AI/Wan2.1-T2V-14B-Diffusers": {**_WAN_COMMON, **_WAN_14B, "in_channels": 16},
    "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers": {**_WAN_COMMON, **_WAN_14B, **_WAN_I2V},
    "Wan-AI/Wan2.1-I2V-14B-720P-Diffusers": {**_WAN_COMMON, **_WAN_14B, **_WAN_I2V},
}
CLIP_VIT_H = (257, 1280)  # tokens per reference, width: the CLIP ViT-H/14 of Wan's I2V models

# Words the tiny tokenizer knows (demo prompts and test sentences); anything else is <unk>.
_TINY_VOCAB_TEXT = """
a an the shape object subject person dog toy moves glides drifts slides across over through along
around patterned textured striped plain background scene simple small large moving slowly quickly
clapping sitting walking hands their video shows in this of with and on to is are into near
""".split()


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


# --- tiny preset -------------------------------------------------------------------------------


def tiny_transformer_config(base: str = "i2v") -> dict:
    """2 heads x 12, 2 layers: ~30k parameters, 12 ms a step on a 2-core CPU (measured)."""
    cfg = dict(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16,
        text_dim=32, freq_dim=32, ffn_dim=32, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=32,
    )
    if base == "i2v":
        cfg.update(in_channels=36, image_dim=32, added_kv_proj_dim=24)
    return cfg


def _seeded(seed: int):
    """Build under a private RNG so building the tiny parts never moves the training RNG."""
    ctx = torch.random.fork_rng(devices=[])
    ctx.__enter__()
    torch.manual_seed(seed)
    return ctx


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


def build_tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    for w in _TINY_VOCAB_TEXT:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    # UMT5 appends </s>; an empty prompt is then the single token </s>, as with the real tokenizer.
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                                   unk_token="<unk>", model_max_length=512)


def load_tokenizer(cfg: Config, offline: bool = True):
    """The configured prompt tokenizer without its encoder (tools/check_dataset.py counts tokens
    with it): the tiny one, or model.pretrained's tokenizer/ folder; None when that cannot be
    loaded (offline: nothing is downloaded)."""
    if cfg.model.preset == "tiny":
        return build_tiny_tokenizer()
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(cfg.model.pretrained, subfolder="tokenizer", local_files_only=offline)
    except Exception:  # not downloaded, no tokenizer/ folder, a missing sentencepiece: the caller estimates
        return None


def build_tiny_parts(seed: int = 0, base: str = "i2v", informative_vae: bool = True,
                     with_encoders: bool = True) -> Parts:
    from transformers import CLIPVisionConfig, CLIPVisionModel, UMT5Config, UMT5EncoderModel

    from e2v.tiny_vae import build_tiny_vae

    ctx = _seeded(seed)
    try:
        transformer = WanTransformer3DModel(**tiny_transformer_config(base))
        if not with_encoders:
            return Parts(transformer)
        vae = build_tiny_vae(seed, informative=informative_vae)
        tokenizer = build_tiny_tokenizer()
        text_encoder = UMT5EncoderModel(UMT5Config(
            vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
            relative_attention_num_buckets=8, dropout_rate=0.0,
        ))
        image_encoder = CLIPVisionModel(CLIPVisionConfig(
            hidden_size=32, projection_dim=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64, image_size=32, patch_size=8,
        ))
        image_processor = clip_image_processor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    finally:
        ctx.__exit__(None, None, None)
    for m in (text_encoder, image_encoder, vae):
        m.eval()
    return Parts(transformer, vae, text_encoder, tokenizer, image_encoder, image_processor)


# --- real weights ------------------------------------------------------------------------------


def resolve_pretrained(name: str) -> str:
    """A hub id that is already in the local Hugging Face cache -> its snapshot folder, so every
    path that wants a local folder (the ZeRO-3 partitioned load, the dry run's config) takes it;
    anything else unchanged (from_pretrained then downloads, outside the tests)."""
    if Path(name).exists() or name.count("/") != 1:
        return name
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(name, local_files_only=True)
    except Exception:  # not cached (LocalEntryNotFoundError), or no huggingface_hub: keep the id
        return name


def load_pretrained_parts(cfg: Config, with_encoders: bool = True, with_transformer: bool = True,
                          ds_config: dict | None = None) -> Parts:
    """Wan2.1 diffusers folders: transformer/ vae/ text_encoder/ tokenizer/ (+ image_encoder/,
    image_processor/ for I2V). VAE and CLIP stay fp32 as in A2's inference; UMT5 in weight_dtype.
    Under a ZeRO-3 `ds_config` the transformer is partitioned at load (load_transformer_zero3).
    Without `with_transformer` it is built on the meta device from its config (tools that only
    read its shape, such as precompute)."""
    from transformers import AutoTokenizer, CLIPVisionModel, UMT5EncoderModel

    path = resolve_pretrained(cfg.model.pretrained)
    wdtype = torch.bfloat16 if cfg.model.weight_dtype == "bf16" else torch.float32
    # Under bf16 DeepSpeed casts the module to bf16 before it makes the fp32 master copies, so
    # loading in bf16 gives the same weights at half the CPU RAM per rank (31 GiB instead of 61 GiB
    # for I2V-14B); diffusers keeps the _keep_in_fp32_modules in fp32 either way.
    tdtype = torch.bfloat16 if cfg.train.mixed_precision == "bf16" else torch.float32
    blocker = zero3_load_blocker(cfg, ds_config)
    if not with_transformer:
        parts = Parts(transformer=None)  # load_parts puts the meta-device model here
    elif blocker is None:
        transformer, fp32_file_values = load_transformer_zero3(Path(path) / "transformer", ds_config, tdtype)
        parts = Parts(transformer, fp32_file_values=fp32_file_values)
    else:
        if blocker != "not ZeRO-3":
            _print0(f"[e2v] note: ZeRO-3, but every rank loads the whole transformer: {blocker}")
        parts = Parts(WanTransformer3DModel.from_pretrained(path, subfolder="transformer", torch_dtype=tdtype,
                                                            low_cpu_mem_usage=True))
    if not with_encoders:
        return parts
    # The target video always goes through the VAE, whatever e2v_type.
    parts.vae = AutoencoderKLWan.from_pretrained(path, subfolder="vae", torch_dtype=torch.float32)
    parts.tokenizer = AutoTokenizer.from_pretrained(path, subfolder="tokenizer")
    parts.text_encoder = UMT5EncoderModel.from_pretrained(path, subfolder="text_encoder", torch_dtype=wdtype)
    if cfg.uses_clip:
        clip_path = cfg.model.image_encoder or path
        # A diffusers I2V pipeline (a local folder with image_encoder/, or a Wan *-Diffusers hub id)
        # keeps CLIP in subfolders; a plain CLIP folder has it at the top.
        local = Path(clip_path)
        in_pipeline = (local / "image_encoder").is_dir() or (not local.exists() and clip_path.endswith("-Diffusers"))
        parts.image_encoder = CLIPVisionModel.from_pretrained(
            clip_path, subfolder="image_encoder" if in_pipeline else None, torch_dtype=torch.float32)
        parts.image_processor = clip_image_processor(clip_path, "image_processor" if in_pipeline else None)
    return parts


def place_encoders(parts: Parts, device) -> Parts:
    """The frozen encoders (VAE, UMT5, CLIP) in eval mode, without gradients, on `device`: the one
    place they are prepared. They stay resident for the run (see tools/estimate_memory.py's
    encoder term); the cache (cache.enabled) is how a run goes without them."""
    for m in (parts.vae, parts.text_encoder, parts.image_encoder):
        if m is not None:
            m.requires_grad_(False).eval().to(device)
    return parts


def load_parts(cfg: Config, with_encoders: bool = True, device="cpu", ds_config: dict | None = None,
               with_transformer: bool = True) -> Parts:
    """Every part of the config's model, encoders frozen on `device` (place_encoders).
    `ds_config`: the resolved DeepSpeed config; under ZeRO-3 a pretrained transformer is
    partitioned at load. Without it (tools, tests) every part loads whole. `with_transformer`
    False: the transformer is the meta-device model of the config (its shape, no weights)."""
    if cfg.model.preset == "tiny":
        base = "t2v" if cfg.model.base == "t2v" else "i2v"
        parts = build_tiny_parts(cfg.model.tiny_seed, base=base,
                                 informative_vae=cfg.model.tiny_vae == "informative", with_encoders=with_encoders)
    else:
        parts = load_pretrained_parts(cfg, with_encoders, with_transformer, ds_config)
    place_encoders(parts, device)
    if not with_transformer:
        return replace(parts, transformer=build_meta_transformer(cfg))
    if needs_expansion(parts.transformer, cfg):
        in_channels, image_dim = expansion_shape(cfg, clip_width(parts, cfg))
        parts.transformer = expand_for_elements(parts.transformer, in_channels=in_channels, image_dim=image_dim,
                                                seed=cfg.model.tiny_seed)
    return parts


# --- ZeRO-3: partitioned at load --------------------------------------------------------------


def _print0(msg: str) -> None:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, flush=True)


def kept_in_fp32(name: str) -> bool:
    """Whether diffusers keeps this Wan parameter or buffer in fp32 (`_keep_in_fp32_modules`: time
    embedder, modulation tables, norms, rope), matched as its loader does: a listed name equals
    one dotted component."""
    return any(k in name.split(".") for k in WanTransformer3DModel._keep_in_fp32_modules or [])


def zero3_load_blocker(cfg: Config, ds_config: dict | None) -> str | None:
    """Why the transformer cannot be partitioned at load (load_transformer_zero3), or None if it can."""
    if ds_config is None or ds_config.get("zero_optimization", {}).get("stage") != 3:
        return "not ZeRO-3"
    if not cfg.model.zero3_init:
        return "model.zero3_init is false"
    if is_expanded(cfg):
        return "a T2V base expanded for elements is rebuilt whole (expand_for_elements)"
    folder = Path(resolve_pretrained(cfg.model.pretrained)) / "transformer"
    if not folder.is_dir():
        return (f"{cfg.model.pretrained} is not a local folder; download it first "
                f"(huggingface-cli download {cfg.model.pretrained} --local-dir DIR) and set model.pretrained: DIR")
    if not _safetensors_files(folder):
        return f"no diffusion_pytorch_model*.safetensors in {folder}"
    return None


def _safetensors_files(folder: Path) -> list[Path]:
    """The weight files diffusers' from_pretrained reads (no variant): one file, or the shards its
    index names."""
    index = folder / "diffusion_pytorch_model.safetensors.index.json"
    if index.exists():
        return [folder / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    single = folder / "diffusion_pytorch_model.safetensors"
    return [single] if single.exists() else []


def load_transformer_zero3(folder: Path, ds_config: dict, dtype: torch.dtype
                           ) -> tuple[WanTransformer3DModel, dict[str, torch.Tensor]]:
    """Build the transformer inside deepspeed.zero.Init, so each rank holds only its partition of
    every parameter from the start, then stream the safetensors files into it one tensor at a time:
    each parameter is gathered, rank 0 copies the file value in, and ZeRO re-partitions it on exit
    (GatheredParameters with modifier_rank=0). Peak CPU RAM per rank: its partitions plus one
    gathered parameter, instead of the whole model (~31 GiB per rank for I2V-14B in bf16).
    diffusers' from_pretrained has no zero.Init path (transformers' has). The cast is
    from_pretrained's (file value -> dtype, round to nearest). Returns the fp32 file values of the
    _keep_in_fp32_modules parameters for fp32_kept_params; every rank reads those itself (~0.1 GiB
    for 14B). Costs one all-gather per parameter (~1,100 for 14B)."""
    import deepspeed
    import torch.distributed as dist
    from diffusers.models.modeling_utils import no_init_weights
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed
    from safetensors import safe_open

    rank = dist.get_rank()
    files = _safetensors_files(folder)
    config = WanTransformer3DModel.load_config(str(folder))
    # The weights come from the files: skip the random init (minutes for 14B), and leave the
    # training RNG where from_pretrained leaves it (it builds on the meta device, drawing nothing).
    with torch.random.fork_rng(devices=[]), no_init_weights(), \
            deepspeed.zero.Init(config_dict_or_path=ds_config, dtype=dtype):
        model = WanTransformer3DModel.from_config(config)
    # zero.Init's tensor-constructor override also reaches the rope tables computed in __init__
    # (they come out fp32 but not equal to a plain build): rebuild them outside it, on the device
    # the engine runs on: deepspeed.initialize does not move a module built under zero.Init, so a
    # CPU table would meet CUDA queries in the first forward. They are the model's only buffers;
    # anything else would need the same treatment.
    c = model.config
    model.rope = WanRotaryPosEmbed(c.attention_head_dim, c.patch_size, c.rope_max_seq_len).to(accelerator_device())
    others = [n for n, _ in model.named_buffers() if not n.startswith("rope.")]
    if others:
        raise RuntimeError(f"zero3 load: buffers built under zero.Init that are not rebuilt: {others[:5]}")

    params = dict(model.named_parameters())
    fp32_file_values, seen = {}, set()
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
            unknown = sorted(keys - set(params))
            if unknown:
                raise RuntimeError(f"{path}: tensors the model does not have: {unknown[:5]}")
            for name in [n for n in params if n in keys]:  # the model's order: the same on every rank
                p = params[name]
                with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                    if rank == 0:
                        value = f.get_tensor(name)
                        if tuple(value.shape) != tuple(p.shape):
                            raise RuntimeError(f"{path}: {name} has shape {tuple(value.shape)}, "
                                               f"the model {tuple(p.shape)}")
                        with torch.no_grad():
                            p.data.copy_(value)
                        del value
                if kept_in_fp32(name):  # a copy: the file's tensor holds its whole mmap resident
                    fp32_file_values[name] = f.get_tensor(name).to(torch.float32, copy=True)
                seen.add(name)
    missing = sorted(set(params) - seen)
    if missing:
        raise RuntimeError(f"{folder}: no file value for {len(missing)} parameters, e.g. {missing[:5]}")
    _print0(f"[e2v] transformer partitioned at load (zero.Init, {str(dtype).removeprefix('torch.')}), "
            f"streamed from {len(files)} shard file{'s' if len(files) != 1 else ''}")
    return model, fp32_file_values


def clip_width(parts: Parts, cfg: Config) -> int:
    if parts.image_encoder is not None:
        return parts.image_encoder.config.hidden_size
    return 32 if cfg.model.preset == "tiny" else CLIP_VIT_H[1]


def is_expanded(cfg: Config) -> bool:
    """A T2V base that load_parts widened for elements (its new modules train in full)."""
    return cfg.model.base == "t2v" and cfg.e2v_type != "none"


def needs_expansion(transformer: WanTransformer3DModel, cfg: Config) -> bool:
    """A 16-channel T2V transformer asked to take element conditions. The base is stated in the
    config (model.base), never guessed, so what trains in full is known before any weight loads."""
    t2v = transformer.config.in_channels == 16 and transformer.config.added_kv_proj_dim is None
    if t2v and cfg.e2v_type != "none" and cfg.model.base != "t2v":
        raise ValueError(f"model: {cfg.model.pretrained or cfg.model.preset} is a text-to-video transformer "
                         f"(16 input channels, no image attention): set model.base: t2v to expand it for "
                         f"e2v_type {cfg.e2v_type}, or e2v_type: none for plain text-to-video")
    if not t2v and cfg.model.base == "t2v":
        raise ValueError(f"model.base: t2v, but {cfg.model.pretrained or cfg.model.preset} already has "
                         f"{transformer.config.in_channels} input channels / image attention: set model.base: i2v")
    return t2v and cfg.e2v_type != "none"


def expansion_shape(cfg: Config, image_width: int) -> tuple[int, int | None]:
    """(input channels, image width or None) a T2V base is expanded to, per e2v_type: the VAE
    pathway adds 20 channels (16 without the mask), the CLIP pathway adds image cross-attention."""
    cond = (20 if cfg.processors.vae.concatenate_mask else 16) if cfg.uses_vae_condition else 0
    return 16 + cond, image_width if cfg.uses_clip else None


# --- T2V -> E2V expansion ----------------------------------------------------------------------


def expand_for_elements(t2v: WanTransformer3DModel, in_channels: int = 36, image_dim: int | None = 1280,
                        seed: int = 0) -> WanTransformer3DModel:
    """Widen the patch embedding from 16 to `in_channels` and (image_dim not None) add image
    cross-attention, such that the output is unchanged at step 0 (tests/test_expand.py): the new input
    channels are zero, `add_v_proj` is zero (weight and bias), so the image branch adds exactly 0;
    `add_k_proj`, `norm_added_k` and the image embedder start at their default init so gradients
    reach them from step 1. `to_out` stays as it is: the text path shares it.
    The model is rebuilt from its config (meta device, then weights assigned), so save_pretrained
    and from_pretrained see a consistent config. A meta-device input gives a meta-device model
    (the --dry_run plan)."""
    c = dict(t2v.config)
    inner = c["num_attention_heads"] * c["attention_head_dim"]
    new_cfg = {k: v for k, v in c.items() if not k.startswith("_")}
    new_cfg.update(in_channels=in_channels)
    if image_dim is not None:
        new_cfg.update(image_dim=image_dim, added_kv_proj_dim=inner)
    with torch.device("meta"):
        model = WanTransformer3DModel.from_config(new_cfg)
    old_sd = t2v.state_dict()
    patch_w = old_sd.pop("patch_embedding.weight")
    model.load_state_dict(old_sd, strict=False, assign=True)
    for name, buf in t2v.named_buffers():  # non-persistent buffers (the rope tables) are not in state_dict
        module, _, short = name.rpartition(".")
        if name not in old_sd and short in model.get_submodule(module)._buffers:
            model.get_submodule(module)._buffers[short] = buf

    ctx = _seeded(seed + 1)
    try:
        # Materialise every module that still has meta tensors, with its own default init.
        for module in model.modules():
            own = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
            if module is model.patch_embedding or patch_w.is_meta:
                continue  # its bias is loaded, its weight is built below
            if any(t.is_meta for t in own):
                module.to_empty(device=patch_w.device, recurse=False)
                if hasattr(module, "reset_parameters"):
                    module.reset_parameters()
                module.to(dtype=patch_w.dtype)  # the new modules take the base's dtype
        with torch.no_grad():
            w = torch.zeros(patch_w.shape[0], in_channels, *patch_w.shape[2:], dtype=patch_w.dtype,
                            device=patch_w.device)
            w[:, : patch_w.shape[1]] = patch_w
            model.patch_embedding.weight = torch.nn.Parameter(w)
            if image_dim is not None and not patch_w.is_meta:
                for block in model.blocks:
                    block.attn2.add_v_proj.weight.zero_()
                    block.attn2.add_v_proj.bias.zero_()
    finally:
        ctx.__exit__(None, None, None)
    bad = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if bad and not patch_w.is_meta:
        raise RuntimeError(f"expansion left uninitialised tensors: {bad[:5]}")
    return model


def expand_from_export(t2v: WanTransformer3DModel, lora_dir: str | Path) -> WanTransformer3DModel:
    """Inference side: rebuild the expanded shape recorded in `<lora_dir>/e2v_model.json` (written
    by checkpoint.export_lora) around a plain T2V transformer; then load the LoRA
    (`load_lora_weights`) and the fully-trained modules (`checkpoint.load_extra_modules`)."""
    shape = json.loads((Path(lora_dir) / "e2v_model.json").read_text())
    if shape["in_channels"] == t2v.config.in_channels and shape.get("added_kv_proj_dim") == t2v.config.added_kv_proj_dim:
        return t2v
    return expand_for_elements(t2v, in_channels=shape["in_channels"], image_dim=shape.get("image_dim")
                               if shape.get("added_kv_proj_dim") else None)


# --- the plan without weights (--dry_run) ------------------------------------------------------


def transformer_config(cfg: Config) -> dict:
    """The base transformer's config without reading weights: the tiny preset, a local diffusers
    folder's transformer/config.json, or a known Wan2.1 hub id (KNOWN_WAN_CONFIGS; no download)."""
    if cfg.model.preset == "tiny":
        return tiny_transformer_config("t2v" if cfg.model.base == "t2v" else "i2v")
    local = Path(resolve_pretrained(cfg.model.pretrained)) / "transformer" / "config.json"
    if local.exists():
        return dict(WanTransformer3DModel.load_config(str(local.parent)))
    if cfg.model.pretrained in KNOWN_WAN_CONFIGS:
        return dict(KNOWN_WAN_CONFIGS[cfg.model.pretrained])
    raise ValueError(f"model.pretrained: {cfg.model.pretrained} is neither a local diffusers folder (with "
                     f"transformer/config.json) nor one of {', '.join(KNOWN_WAN_CONFIGS)}")


def build_meta_transformer(cfg: Config) -> WanTransformer3DModel:
    """The transformer as training will see it (expanded if the base asks for it), on the meta
    device: every shape, no memory, nothing read or downloaded."""
    c = {k: v for k, v in transformer_config(cfg).items() if not k.startswith("_")}
    with torch.device("meta"):
        transformer = WanTransformer3DModel.from_config(c)
    if needs_expansion(transformer, cfg):
        in_channels, image_dim = expansion_shape(cfg, 32 if cfg.model.preset == "tiny" else CLIP_VIT_H[1])
        transformer = expand_for_elements(transformer, in_channels=in_channels, image_dim=image_dim)
    return transformer


def knows_shape_offline(cfg: Config) -> bool:
    """Whether transformer_config can tell the base's shape without reading weights or downloading."""
    return (cfg.model.preset == "tiny"
            or (Path(resolve_pretrained(cfg.model.pretrained)) / "transformer" / "config.json").exists()
            or cfg.model.pretrained in KNOWN_WAN_CONFIGS)


def preflight(cfg: Config) -> tuple[WanTransformer3DModel, list[str]]:
    """The model-dependent config checks (base vs model.base, e2v_type none on a 16-channel base,
    train.trainable patterns, LoRA targets) on the meta device, in seconds, before any weight
    loads: a 14B load takes minutes and ~31 GB per rank, too much to spend on a typo.
    Returns the meta transformer set up for training and the names trained in full."""
    transformer = build_meta_transformer(cfg)
    check_plain_t2v_base(cfg, transformer.config.in_channels)
    full_names = setup_training(transformer, cfg, expanded=is_expanded(cfg))
    return transformer, full_names


def memory_plan(transformer: torch.nn.Module, cfg: Config) -> dict:
    """Bytes of the training state summed over all GPUs, before ZeRO partitioning and offload:
    weights in the training precision, gradients of the trained parameters in that precision,
    and AdamW's fp32 master copy + two moments (12 bytes per trained parameter). Activations
    depend on resolution and checkpointing: tools/estimate_memory.py."""
    params = count_params(transformer)
    trainable = count_params(transformer, trainable_only=True)
    width = 2 if cfg.train.mixed_precision == "bf16" else 4
    return {"params": params, "trainable_params": trainable, "weights_bytes": width * params,
            "gradient_bytes": width * trainable, "optimizer_bytes": 12 * trainable}


def describe_plan(transformer: torch.nn.Module, cfg: Config, ds_config: dict, full_names: list[str]) -> str:
    """The --dry_run report: model shape, what trains, and the memory plan under the DeepSpeed config."""
    plan, gib = memory_plan(transformer, cfg), 1024 ** 3
    zero = ds_config.get("zero_optimization", {})
    offload = [k.removeprefix("offload_") for k in ("offload_optimizer", "offload_param")
               if zero.get(k, {}).get("device") == "cpu"]
    c = transformer.config
    return "\n".join([
        f"transformer: {c.num_layers} layers x {c.num_attention_heads} heads x {c.attention_head_dim}, "
        f"in_channels {c.in_channels}, image attention {'yes' if c.added_kv_proj_dim else 'no'}"
        f"{' (expanded from a T2V base)' if is_expanded(cfg) else ''}",
        f"params {plan['params'] / 1e9:.3f} B, trainable {plan['trainable_params'] / 1e6:.2f} M "
        f"({cfg.model.training_type}; {len(full_names)} tensors in full beside the LoRA)",
        f"weights   {plan['weights_bytes'] / gib:9.2f} GiB ({cfg.train.mixed_precision})",
        f"gradients {plan['gradient_bytes'] / gib:9.2f} GiB",
        f"optimizer {plan['optimizer_bytes'] / gib:9.2f} GiB (fp32 master + AdamW moments, 12 B per trained param)",
        f"totals over all GPUs, sharded by ZeRO-{zero.get('stage', 0)}"
        f"{', ' + ' and '.join(offload) + ' offloaded to CPU' if offload else ''}; "
        "activations not included (tools/estimate_memory.py)",
    ])


# --- what trains -------------------------------------------------------------------------------


def lora_target(patterns: list[str]) -> list[str] | str:
    """A list of module-name suffixes, or (seed style) one regex such as `blocks.*(to_q|to_k)`."""
    if len(patterns) == 1 and re.search(r"[*|()\[\]^$]", patterns[0]):
        return patterns[0]
    return list(patterns)


def expansion_modules(cfg: Config) -> list[str]:
    """Name patterns of the modules expansion added for this e2v_type (they train in full)."""
    return (EXPANSION_MODULES["vae"] if cfg.uses_vae_condition else []) + (EXPANSION_MODULES["clip"] if cfg.uses_clip else [])


def setup_training(transformer: WanTransformer3DModel, cfg: Config, expanded: bool) -> list[str]:
    """Freeze everything, then add LoRA (training_type lora) and unfreeze `train.trainable`
    (plus the expansion modules of an expanded T2V base). Returns the names of parameters trained
    in full beside the LoRA."""
    from peft import LoraConfig

    transformer.requires_grad_(False)
    full_patterns = list(cfg.train.trainable) + (expansion_modules(cfg) if expanded else [])
    if cfg.model.training_type == "full":
        transformer.requires_grad_(True)
        return [n for n, _ in transformer.named_parameters()]
    targets = lora_target(cfg.lora.target_modules)
    if expanded and isinstance(targets, list):
        # The new image projections train in full; a LoRA on top of them would be redundant.
        targets = [t for t in targets if t not in ("add_k_proj", "add_v_proj")]
    if not transformer.config.added_kv_proj_dim and isinstance(targets, list):
        targets = [t for t in targets if t not in ("add_k_proj", "add_v_proj")]
    transformer.add_adapter(LoraConfig(
        r=cfg.lora.rank, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
        target_modules=targets, init_lora_weights=True if cfg.lora.init_weights == "default" else "gaussian",
    ))
    full = []
    regexes = [re.compile(p) for p in full_patterns]
    for name, p in transformer.named_parameters():
        if "lora_" in name:
            p.requires_grad_(True)
        elif any(r.search(name) for r in regexes):
            p.requires_grad_(True)
            full.append(name)
    unmatched = [p for p in cfg.train.trainable if not any(re.search(p, n) for n in full)]
    if unmatched:
        raise ValueError(f"train.trainable: no parameter name matches {unmatched} (names look like "
                         f"'blocks.0.attn2.to_q.weight', 'patch_embedding.weight')")
    return full


def count_params(module: torch.nn.Module, trainable_only: bool = False) -> int:
    # A ZeRO-3 partitioned parameter has numel() 0; ds_numel is its full size.
    return sum(getattr(p, "ds_numel", None) or p.numel() for p in module.parameters()
               if p.requires_grad or not trainable_only)


# --- precision and activation memory under DeepSpeed (docs/architecture.md) -------------------


def fp32_kept_params(transformer: torch.nn.Module, file_values: dict[str, torch.Tensor] | None = None
                     ) -> dict[str, torch.Tensor]:
    """fp32 copies of the frozen parameters diffusers keeps in fp32 (`_keep_in_fp32_modules`; for
    Wan: rope, time_embedder, scale_shift_table, norm1/2/3), taken before deepspeed.initialize:
    DeepSpeed's bf16 mode casts every parameter (it keeps only buffers, such as the rope tables).
    Names match as in diffusers' loader: a listed name equals one dotted component. Trainable
    parameters are not listed: they live in the optimizer's bf16 buffers with fp32 master copies,
    so a TRAINED kept module (train.trainable: [scale_shift_table], a full fine-tune) computes in
    bf16 under DeepSpeed's bf16 mode; `trained_fp32_kept` names them for the start-up note.
    A parameter partitioned at load (ZeRO-3, load_transformer_zero3) takes its value from
    `file_values` (Parts.fp32_file_values): its partition is a slice in the training dtype."""
    kept = {}
    for name, p in transformer.named_parameters():
        if p.requires_grad or not kept_in_fp32(name):
            continue
        if hasattr(p, "ds_tensor"):
            if not file_values or name not in file_values:
                raise RuntimeError(f"fp32_kept_params: {name} is partitioned and has no fp32 file value")
            kept[name] = file_values[name]
        else:
            kept[name] = p.detach().float().clone()
    return kept


def trained_fp32_kept(transformer: torch.nn.Module) -> list[str]:
    """Trainable parameters of the modules diffusers keeps in fp32 (they run in bf16 under bf16)."""
    return [name for name, p in transformer.named_parameters()
            if p.requires_grad and kept_in_fp32(name)]


def restore_fp32_params(transformer: torch.nn.Module, saved: dict[str, torch.Tensor]) -> int:
    """Put the fp32 copies back after deepspeed.initialize (exact original values, not a re-cast
    of the bf16 ones). Under ZeRO-3 a parameter is a partition (`ds_tensor`) plus, when it is
    persistent (below stage3_param_persistence_threshold), a full copy; both become fp32, and
    ZeRO-3 gathers parameters grouped by dtype. Returns how many parameters were restored."""
    import torch.distributed as dist

    params = dict(transformer.named_parameters())
    with torch.no_grad():
        for name, value in saved.items():
            p = params[name]
            if not hasattr(p, "ds_tensor"):
                p.data = value.to(p.device)
                continue
            part = p.ds_tensor
            n = part.ds_numel
            start = dist.get_rank(group=p.ds_process_group) * n
            flat = value.flatten()[start:start + n]
            shard = torch.zeros(n, dtype=torch.float32, device=part.device)
            shard[: flat.numel()] = flat
            part.data = shard
            p.data = value.to(p.device) if p.data.numel() else torch.empty(0, dtype=torch.float32, device=p.device)
    return len(saved)


def activation_context(offload: bool):
    """Where the tensors saved for backward live. With `train.activation_offload` and CUDA they
    go to pinned CPU memory (torch.autograd.graph.save_on_cpu) and come back for backward; with
    gradient checkpointing those are only the block boundaries. Costs a host<->device copy of
    each saved tensor per step. Without CUDA there is nothing to offload: a no-op."""
    import contextlib

    if offload and torch.cuda.is_available():
        return torch.autograd.graph.save_on_cpu(pin_memory=True)
    return contextlib.nullcontext()
