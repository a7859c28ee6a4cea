"""The Wan parts: load them (diffusers `from_pretrained`), or build the tiny random-weight preset in
code; expand a T2V transformer to take element conditions; attach LoRA and pick what trains.

The tiny preset is the real code path with small configs (FACTS.md), so tests and the CPU demo
exercise exactly what a 14B run does. Nothing here downloads anything unless `model.pretrained`
names a hub id.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from diffusers import AutoencoderKLWan, WanTransformer3DModel

from e2v.config import Config

# LoRA targets that wrap exactly the attention and FFN layers of every Wan block (FACTS.md).
ALL_LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_k_proj", "add_v_proj", "ffn.net.0.proj", "ffn.net.2"]

# Modules a T2V base gains when expanded for elements; they start neutral and train in full.
EXPANSION_MODULES = [r"patch_embedding", r"\.add_k_proj", r"\.add_v_proj", r"\.norm_added_k", r"image_embedder"]

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


# --- tiny preset -------------------------------------------------------------------------------


def tiny_transformer_config(base: str = "i2v") -> dict:
    """2 heads x 12, 2 layers: ~30k parameters, 12 ms a step on CPU (FACTS.md)."""
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


def build_tiny_parts(seed: int = 0, base: str = "i2v", informative_vae: bool = True,
                     with_encoders: bool = True) -> Parts:
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel, UMT5Config, UMT5EncoderModel

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
        image_processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    finally:
        ctx.__exit__(None, None, None)
    for m in (text_encoder, image_encoder, vae):
        m.eval()
    return Parts(transformer, vae, text_encoder, tokenizer, image_encoder, image_processor)


# --- real weights ------------------------------------------------------------------------------


def load_pretrained_parts(cfg: Config, with_encoders: bool = True, device: str = "cpu") -> Parts:
    """Wan2.1 diffusers folders: transformer/ vae/ text_encoder/ tokenizer/ (+ image_encoder/,
    image_processor/ for I2V). VAE and CLIP stay fp32 as in A2's inference; UMT5 in weight_dtype."""
    from transformers import AutoTokenizer, CLIPImageProcessor, CLIPVisionModel, UMT5EncoderModel

    path = cfg.model.pretrained
    wdtype = torch.bfloat16 if cfg.model.weight_dtype == "bf16" else torch.float32
    transformer = WanTransformer3DModel.from_pretrained(path, subfolder="transformer", torch_dtype=torch.float32,
                                                        low_cpu_mem_usage=True)
    if not with_encoders:
        return Parts(transformer)
    parts = Parts(transformer)
    # The target video always goes through the VAE, whatever e2v_type.
    parts.vae = AutoencoderKLWan.from_pretrained(path, subfolder="vae", torch_dtype=torch.float32).to(device)
    parts.tokenizer = AutoTokenizer.from_pretrained(path, subfolder="tokenizer")
    parts.text_encoder = UMT5EncoderModel.from_pretrained(path, subfolder="text_encoder", torch_dtype=wdtype).to(device)
    if cfg.uses_clip:
        clip_path = cfg.model.image_encoder or path
        sub = None if cfg.model.image_encoder else "image_encoder"
        parts.image_encoder = CLIPVisionModel.from_pretrained(clip_path, subfolder=sub, torch_dtype=torch.float32).to(device)
        parts.image_processor = CLIPImageProcessor.from_pretrained(
            clip_path, subfolder=None if cfg.model.image_encoder else "image_processor")
    for m in (parts.vae, parts.text_encoder, parts.image_encoder):
        if m is not None:
            m.requires_grad_(False).eval()
    return parts


def load_parts(cfg: Config, with_encoders: bool = True, device: str = "cpu") -> Parts:
    if cfg.model.preset == "tiny":
        base = "t2v" if cfg.model.base == "t2v" else "i2v"
        parts = build_tiny_parts(cfg.model.tiny_seed, base=base,
                                 informative_vae=cfg.model.tiny_vae == "informative", with_encoders=with_encoders)
    else:
        parts = load_pretrained_parts(cfg, with_encoders, device)
    if needs_expansion(parts.transformer, cfg):
        parts.transformer = expand_for_elements(
            parts.transformer,
            in_channels=36 if cfg.processors.vae.concatenate_mask else 32,
            image_dim=clip_width(parts, cfg),
            seed=cfg.model.tiny_seed,
        )
    return parts


def clip_width(parts: Parts, cfg: Config) -> int:
    if parts.image_encoder is not None:
        return parts.image_encoder.config.hidden_size
    return 32 if cfg.model.preset == "tiny" else 1280  # CLIP ViT-H/14


def is_expanded(cfg: Config) -> bool:
    """A T2V base that load_parts widened for elements (its new modules train in full)."""
    return cfg.model.base == "t2v" and cfg.e2v_type != "none"


def needs_expansion(transformer: WanTransformer3DModel, cfg: Config) -> bool:
    """A 16-channel T2V transformer asked to take element conditions."""
    return transformer.config.in_channels == 16 and cfg.e2v_type != "none"


# --- T2V -> E2V expansion ----------------------------------------------------------------------


def expand_for_elements(t2v: WanTransformer3DModel, in_channels: int = 36, image_dim: int = 1280,
                        seed: int = 0) -> WanTransformer3DModel:
    """Widen the patch embedding from 16 to `in_channels` and add image cross-attention, such that
    the output is unchanged at step 0 (FACTS.md): the new input channels are zero, `add_v_proj` is
    zero (weight and bias), so the image branch adds exactly 0; `add_k_proj`, `norm_added_k` and
    the image embedder start at their default init so gradients reach them from step 1.
    The model is rebuilt from its config (meta device, then weights assigned), so save_pretrained
    and from_pretrained see a consistent config."""
    c = dict(t2v.config)
    inner = c["num_attention_heads"] * c["attention_head_dim"]
    new_cfg = {k: v for k, v in c.items() if not k.startswith("_")}
    new_cfg.update(in_channels=in_channels, image_dim=image_dim, added_kv_proj_dim=inner)
    with torch.device("meta"):
        model = WanTransformer3DModel.from_config(new_cfg)
    old_sd = t2v.state_dict()
    patch_w = old_sd.pop("patch_embedding.weight")
    model.load_state_dict(old_sd, strict=False, assign=True)

    ctx = _seeded(seed + 1)
    try:
        # Materialise every module that still has meta tensors, with its own default init.
        for module in model.modules():
            own = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
            if any(t.is_meta for t in own):
                module.to_empty(device=patch_w.device, recurse=False)
                if hasattr(module, "reset_parameters"):
                    module.reset_parameters()
        with torch.no_grad():
            w = torch.zeros(patch_w.shape[0], in_channels, *patch_w.shape[2:], dtype=patch_w.dtype)
            w[:, : patch_w.shape[1]] = patch_w
            model.patch_embedding.weight = torch.nn.Parameter(w)
            for block in model.blocks:
                block.attn2.add_v_proj.weight.zero_()
                block.attn2.add_v_proj.bias.zero_()
    finally:
        ctx.__exit__(None, None, None)
    bad = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if bad:
        raise RuntimeError(f"expansion left uninitialised tensors: {bad[:5]}")
    return model.to(patch_w.dtype)


# --- what trains -------------------------------------------------------------------------------


def lora_target(patterns: list[str]) -> list[str] | str:
    """A list of module-name suffixes, or (seed style) one regex such as `blocks.*(to_q|to_k)`."""
    if len(patterns) == 1 and re.search(r"[*|()\[\]^$]", patterns[0]):
        return patterns[0]
    return list(patterns)


def setup_training(transformer: WanTransformer3DModel, cfg: Config, expanded: bool) -> list[str]:
    """Freeze everything, then add LoRA (training_type lora) and unfreeze `train.trainable`
    (plus the expansion modules of an expanded T2V base). Returns the names of parameters trained
    in full beside the LoRA."""
    from peft import LoraConfig

    transformer.requires_grad_(False)
    full_patterns = list(cfg.train.trainable) + (EXPANSION_MODULES if expanded else [])
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
    if full_patterns and not full:
        raise ValueError(f"train.trainable {cfg.train.trainable}: no parameter name matches these patterns")
    return full


def count_params(module: torch.nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)
