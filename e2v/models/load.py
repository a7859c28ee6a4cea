"""The Wan parts of a config: the tiny preset (e2v/models/tiny.py) or a diffusers folder / hub id
(`from_pretrained`), the ZeRO-3 partitioned load when DeepSpeed asks for it (e2v/models/zero3_load.py),
the T2V expansion when the base needs it (e2v/models/expand.py), Wan2.2's experts (e2v/config/experts.py) and
the encoders frozen on the device (e2v/models/parts.py). Nothing here downloads anything unless `model.pretrained` names a hub id that is
not in the local cache."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKLWan, WanTransformer3DModel

from e2v.config.bases import resolve_pretrained, tiny_base, tiny_expert_base
from e2v.config.experts import EXPERTS, SUBFOLDERS, boundary_ratio, expert_for, trained_experts
from e2v.config.schema import Config
from e2v.models.expand import (
    clip_width,
    expand_for_elements,
    expanded_config,
    expansion_shape,
    init_new_modules,
    needs_expansion,
    widened_patch_weight,
)
from e2v.models.experts import TwoExperts, map_experts, switch
from e2v.models.parts import CLIP_VIT_H, Parts, clip_image_processor, clip_location, place_encoders
from e2v.models.plan import build_meta_transformer
from e2v.models.precision import kept_in_fp32, to_inference_dtype
from e2v.models.tiny import build_tiny_experts, build_tiny_parts, build_tiny_tokenizer
from e2v.models.zero3_load import load_transformer_zero3, zero3_load_blocker
from e2v.runtime.device import TF32_ATTR
from e2v.runtime.log import get_logger

log = get_logger("e2v")


def load_tokenizer(cfg: Config, offline: bool = True, raise_errors: bool = False):
    """The configured prompt tokenizer without its encoder (tools/check_dataset.py counts tokens
    with it): the tiny one, or model.pretrained's tokenizer/ folder; None when that cannot be
    loaded (offline: nothing is downloaded), or with `raise_errors` the loader's error (the
    start-up check names it)."""
    if cfg.model.preset is not None:
        return build_tiny_tokenizer()
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(resolve_pretrained(cfg.model.pretrained), subfolder="tokenizer",
                                             local_files_only=offline)
    except Exception:  # not downloaded, no tokenizer/ folder, a missing sentencepiece: the caller estimates
        if raise_errors:
            raise
        return None


def _transformer_dtype(cfg: Config) -> torch.dtype:
    # Under bf16 DeepSpeed casts the module to bf16 before it makes the fp32 master copies, so
    # loading in bf16 gives the same weights at half the CPU RAM per rank (31 GiB instead of 61 GiB
    # for I2V-14B); diffusers keeps the _keep_in_fp32_modules in fp32 either way.
    return torch.bfloat16 if cfg.train.mixed_precision == "bf16" else torch.float32


def load_transformer(cfg: Config, subfolder: str = "transformer", ds_config: dict | None = None,
                     image_width: int = CLIP_VIT_H[1]) -> tuple[WanTransformer3DModel, dict | None]:
    """One transformer of a pretrained folder (`transformer`, or a Wan2.2 expert's subfolder),
    widened for elements as the config asks (e2v/models/expand.py; `image_width`: the CLIP's), and,
    partitioned at load under a ZeRO-3 `ds_config` (load_transformer_zero3), its fp32 file values."""
    path, tdtype = resolve_pretrained(cfg.model.pretrained), _transformer_dtype(cfg)
    blocker = zero3_load_blocker(cfg, ds_config, subfolder)
    if blocker is None:
        folder = Path(path) / subfolder
        config = WanTransformer3DModel.load_config(str(folder))
        expand_to = expansion_shape(cfg, image_width, config["in_channels"]) if needs_expansion(config, cfg) else None
        return load_transformer_zero3(folder, ds_config, tdtype, expand_to, seed=cfg.model.tiny_seed)
    if blocker != "not ZeRO-3":
        log.info(f"note: ZeRO-3, but every rank loads the whole transformer: {blocker}")
    transformer = WanTransformer3DModel.from_pretrained(path, subfolder=subfolder, torch_dtype=tdtype,
                                                        low_cpu_mem_usage=True)
    return expanded(transformer, cfg, image_width), None


def load_pretrained_parts(cfg: Config, with_encoders: bool = True, with_transformer: bool = True,
                          ds_config: dict | None = None, experts: tuple[str, ...] = (), device="cpu") -> Parts:
    """Wan diffusers folders: transformer/ vae/ text_encoder/ tokenizer/ (+ image_encoder/,
    image_processor/ for Wan2.1 I2V; + transformer_2/ for Wan2.2's two experts: `experts` names
    those to load, held by a TwoExperts). VAE and CLIP stay fp32 as in A2's inference; UMT5 in
    weight_dtype. Under a ZeRO-3 `ds_config` the transformer is partitioned at load
    (load_transformer_zero3). Without `with_transformer` it is built on the meta device from its
    config (tools that only read its shape, such as precompute). UMT5 and CLIP are read straight
    onto `device` (`device_map`: each tensor goes from the file's mapped pages to the device, so a
    rank never holds a host copy: ~11 GiB of UMT5 and 2.5 GiB of CLIP per rank before, ~110 GB on
    an 8-GPU node)."""
    from transformers import AutoTokenizer, CLIPVisionModel, UMT5EncoderModel

    path = resolve_pretrained(cfg.model.pretrained)
    wdtype = torch.bfloat16 if cfg.model.weight_dtype == "bf16" else torch.float32
    straight = {"device_map": {"": str(torch.device(device))}}  # transformers' loader: file -> device
    parts = Parts(transformer=None)  # the encoders first: expansion needs the CLIP's width
    if with_encoders:
        # The target video always goes through the VAE, whatever e2v_type.
        parts.vae = AutoencoderKLWan.from_pretrained(path, subfolder="vae", torch_dtype=torch.float32)
        parts.tokenizer = AutoTokenizer.from_pretrained(path, subfolder="tokenizer")
        parts.text_encoder = UMT5EncoderModel.from_pretrained(path, subfolder="text_encoder", torch_dtype=wdtype,
                                                              **straight)
        if cfg.uses_clip:
            clip_path, in_pipeline = clip_location(cfg)
            # A plain folder is subfolder "": transformers 5 fails on subfolder=None.
            parts.image_encoder = CLIPVisionModel.from_pretrained(
                clip_path, subfolder="image_encoder" if in_pipeline else "", torch_dtype=torch.float32, **straight)
            parts.image_processor = clip_image_processor(clip_path, "image_processor" if in_pipeline else "")
    if not with_transformer:
        return parts  # load_parts puts the meta-device model here
    width = clip_width(parts, cfg)
    if experts:
        loaded = {name: load_transformer(cfg, SUBFOLDERS[name], ds_config, width) for name in experts}
        fp32 = {f"{name}.{k}": v for name, (_, values) in loaded.items() for k, v in (values or {}).items()}
        parts.transformer = TwoExperts({name: m for name, (m, _) in loaded.items()}, boundary_ratio(cfg))
        parts.fp32_file_values = fp32 or None
    else:
        parts.transformer, parts.fp32_file_values = load_transformer(cfg, "transformer", ds_config, width)
    return parts


def load_parts(cfg: Config, with_encoders: bool = True, device="cpu", ds_config: dict | None = None,
               with_transformer: bool = True, all_experts: bool = False) -> Parts:
    """Every part of the config's model, encoders frozen on `device` (place_encoders).
    `ds_config`: the resolved DeepSpeed config; under ZeRO-3 a pretrained transformer is
    partitioned at load. Without it (tools, tests) every part loads whole. `with_transformer`
    False: the transformer is the meta-device model of the config (its shape, no weights).
    A two-expert base: a TwoExperts of the experts the run trains (model.expert), or of both
    with `all_experts` (sampling)."""
    experts = (EXPERTS if all_experts else trained_experts(cfg)) if boundary_ratio(cfg) is not None else ()
    if cfg.model.preset is not None:
        parts = build_tiny_parts(cfg.model.tiny_seed, base=tiny_base(cfg.model), shape=cfg.model.tiny,
                                 informative_vae=cfg.model.tiny_vae == "informative", with_encoders=with_encoders)
        if experts:  # the encoders are the Wan2.1 preset's; the transformer is the two tiny experts
            experts = build_tiny_experts(cfg.model.tiny_seed, experts, cfg.model.tiny, tiny_expert_base(cfg.model))
            parts.transformer = TwoExperts(experts, boundary_ratio(cfg))
        if with_transformer:
            parts.transformer = map_experts(parts.transformer, lambda t: expanded(t, cfg, clip_width(parts, cfg)))
        if cfg.e2v_type == "none":  # plain T2V reads no reference: no CLIP, as a pretrained base's load gives
            parts.image_encoder = parts.image_processor = None
    else:
        parts = load_pretrained_parts(cfg, with_encoders, with_transformer, ds_config, experts, device)
    if parts.vae is not None and cfg.model.vae_dtype == "bf16":  # loaded fp32 (A2's dtype); model.vae_dtype
        parts.vae.to(torch.bfloat16)
    place_encoders(parts, device)
    if parts.vae is not None:
        setattr(parts.vae, TF32_ATTR, cfg.model.vae_tf32)  # runtime.device.vae_tf32 reads it
    if not with_transformer:
        return replace(parts, transformer=build_meta_transformer(cfg))
    return parts


def base_state(cfg: Config) -> dict:
    """The base a run trains on, as a state dict, unrounded: the transformer `cfg` loads
    (model.pretrained or the tiny preset, expanded as in training), model.generator_ckpt read into
    it, in the dtype training holds it (bf16 under train.mixed_precision: bf16, diffusers' fp32
    modules kept), before any fp8 storage (the engine's). A LoRA fuses into this base for the
    files that hold the whole transformer (e2v_causvid.pt). Costs the base's size in host memory."""
    from e2v.models.causvid_ckpt import load_causvid_checkpoint

    transformer = load_parts(cfg, with_encoders=False).transformer
    if cfg.model.generator_ckpt:  # read into the base before training (engine.prepare_for_training)
        load_causvid_checkpoint(transformer, cfg.model.generator_ckpt, cfg.model.generator_ckpt_dict)
    to_inference_dtype(transformer, "cpu", _transformer_dtype(cfg))
    return dict(transformer.state_dict())


def expanded(transformer: WanTransformer3DModel, cfg: Config, image_width: int) -> WanTransformer3DModel:
    """The transformer widened as the config needs (e2v/models/expand.py), or itself."""
    if not needs_expansion(transformer.config, cfg):
        return transformer
    in_channels, image_dim = expansion_shape(cfg, image_width, transformer.config.in_channels)
    return expand_for_elements(transformer, in_channels=in_channels, image_dim=image_dim, seed=cfg.model.tiny_seed)


@contextlib.contextmanager
def with_all_experts(model, parts: Parts, cfg: Config, device, dtype: torch.dtype, host: dict | None = None):
    """The model inference runs. A run that trains one of two experts: a callable that switches at
    the boundary (experts.switch) between `model` for that expert's timesteps and the other
    expert's base weights (expanded as training expands them, zero-initialised: the base's
    output), on `device` in `dtype` while the context is open: a 14B expert costs ~29 GB of bf16
    on the GPU while it is held. The host keeps the expert as its files' memory-mapped pages
    (host_expert): every rank of a node maps the same page cache, so a node holds one copy (~29
    GB of bf16 for 14B) instead of one per rank (~230 GB on 8 GPUs), and the device copy is made
    from it tensor by tensor (expert_on_device) and dropped when the context closes, never moved
    back. `host` (a dict the caller keeps, the Validator's): the mapping is made once, not at
    every validation. Anything else: `model` itself."""
    trained = trained_experts(cfg)
    if len(trained) != 1:
        yield model
        return
    missing = [name for name in EXPERTS if name not in trained]
    kept = host.get("experts") if host is not None else None
    if kept is None:
        kept = load_base_experts(cfg, missing, clip_width(parts, cfg))
        if host is not None:
            host["experts"] = kept
    base = {name: expert_on_device(h, device, dtype) for name, h in kept.items()}
    try:
        yield switch({**base, trained[0]: model}, boundary_ratio(cfg))
    finally:
        del base
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


@dataclass
class HostExpert:
    """A frozen transformer's weights on the host without a module: its (expanded) config and
    name -> tensor, the file's own memory-mapped pages where it came from files (safetensors maps
    them; nothing is cast or copied on the host), plus the few tensors expansion makes."""

    config: dict
    state: dict[str, torch.Tensor]


def load_base_experts(cfg: Config, names, image_width: int) -> dict[str, HostExpert]:
    """The named experts' base weights on the host, expanded as training expands them: from the
    pretrained folder's files, mapped (host_expert); the tiny preset's, built in memory."""
    if cfg.model.preset is not None:
        built = build_tiny_experts(cfg.model.tiny_seed, names, cfg.model.tiny, tiny_expert_base(cfg.model))
        return {name: HostExpert(dict(e.config), e.state_dict())
                for name, e in ((n, expanded(e, cfg, image_width)) for n, e in built.items())}
    folder = Path(resolve_pretrained(cfg.model.pretrained))
    return {name: host_expert(folder / SUBFOLDERS[name], cfg, image_width) for name in names}


def host_expert(folder: Path, cfg: Config | None = None, image_width: int = CLIP_VIT_H[1]) -> HostExpert:
    """One transformer folder's weights as views of its safetensors files' pages (safe_open maps
    each file privately, copy-on-write: the pages are the page cache's, shared by every process of
    the machine that maps the file, and the file is never written). Widened for elements as `cfg`
    asks: the patch embedding becomes a widened copy and the added modules get init_new_modules'
    values (the whole load's, for the same seed), the only host memory of its own."""
    from safetensors import safe_open

    from e2v.models.zero3_load import _safetensors_files

    files = _safetensors_files(Path(folder))
    if not files:
        raise FileNotFoundError(f"{folder}: no diffusion_pytorch_model*.safetensors (a diffusers transformer folder)")
    config = dict(WanTransformer3DModel.load_config(str(folder)))
    state = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            state.update({k: f.get_tensor(k) for k in f.keys()})  # views of the file's mapping
    if cfg is not None and needs_expansion(config, cfg):
        in_channels, image_dim = expansion_shape(cfg, image_width, config["in_channels"])
        config = expanded_config(config, in_channels, image_dim)
        state["patch_embedding.weight"] = widened_patch_weight(state["patch_embedding.weight"], in_channels)
        with torch.device("meta"):
            reference = WanTransformer3DModel.from_config(config)
        new = {n for n, _ in reference.named_parameters()} - set(state)
        owners = {id(reference.get_submodule(n.rpartition(".")[0])) for n in new}
        init_new_modules(reference, lambda m: id(m) in owners, "cpu", torch.float32, cfg.model.tiny_seed)
        state.update({n: p.detach() for n, p in reference.named_parameters() if n in new})
    return HostExpert(config, state)


def expert_on_device(host: HostExpert, device, dtype: torch.dtype) -> WanTransformer3DModel:
    """A frozen transformer on `device` made from its host weights tensor by tensor, in `dtype`
    except the modules diffusers keeps in fp32 (precision.to_inference_dtype's rule): the host
    weights are read, never moved or replaced, so the next call finds them as they were."""
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    with torch.device("meta"):
        model = WanTransformer3DModel.from_config({k: v for k, v in host.config.items() if not k.startswith("_")})
    model.load_state_dict({k: v.to(device, torch.float32 if kept_in_fp32(k) else dtype)
                           for k, v in host.state.items()}, strict=True, assign=True)
    c = model.config  # the rope tables are non-persistent buffers: made again, kept fp32 by the same rule
    model.rope = WanRotaryPosEmbed(c.attention_head_dim, c.patch_size, c.rope_max_seq_len).to(device)
    for name, b in model.named_buffers():
        if b.is_floating_point():
            model.get_submodule(name.rpartition(".")[0])._buffers[name.rpartition(".")[2]] = b.to(
                torch.float32 if kept_in_fp32(name) else dtype)
    return model.eval().requires_grad_(False)


def load_vae(cfg: Config, device) -> AutoencoderKLWan:
    """The frozen VAE alone, on `device` (fp32, as A2 runs it): what visualization decodes with."""
    if cfg.model.preset is not None:  # the tiny parts are built together, seeded: the VAE equals the run's
        return load_parts(cfg, device=device, with_transformer=False).vae
    vae = AutoencoderKLWan.from_pretrained(resolve_pretrained(cfg.model.pretrained), subfolder="vae",
                                           torch_dtype=torch.float32)
    setattr(vae, TF32_ATTR, cfg.model.vae_tf32)
    return vae.requires_grad_(False).eval().to(device)


def load_clip(cfg: Config, device="cpu") -> tuple[Any, Any]:
    """The frozen CLIP image encoder alone with its processor, on `device` (fp32, as A2 runs it):
    what validation's element similarity needs in a run from the cache, without the text encoder.
    (None, None) for a config without CLIP."""
    if not cfg.uses_clip:
        return None, None
    if cfg.model.preset is not None:  # seeded together: the tiny CLIP equals the run's
        tiny = build_tiny_parts(cfg.model.tiny_seed, base=tiny_base(cfg.model), shape=cfg.model.tiny,
                                informative_vae=cfg.model.tiny_vae == "informative", with_encoders=True)
        encoder, processor = tiny.image_encoder, tiny.image_processor
    else:
        from transformers import CLIPVisionModel

        clip_path, in_pipeline = clip_location(cfg)
        encoder = CLIPVisionModel.from_pretrained(clip_path, subfolder="image_encoder" if in_pipeline else "",
                                                  torch_dtype=torch.float32)
        processor = clip_image_processor(clip_path, "image_processor" if in_pipeline else "")
    return encoder.requires_grad_(False).eval().to(device), processor


@contextlib.contextmanager
def with_encoders(parts: Parts, cfg: Config, device, host: dict | None = None):
    """`parts` with its frozen encoders: as they are when loaded (an online run), else (a run from
    the cache, which never builds them) on `device` while the context is open, so a cached run
    holds the ~13 GiB of encoders on the GPU only while validation runs, not for the whole run.
    `host` (a dict the caller keeps, the Validator's): they are read from disk once, kept on the
    host between validations and moved to `device` for each, instead of read at every one."""
    if parts.vae is not None or not cfg.cache.enabled:
        yield parts
        return
    loaded = host.get("encoders") if host is not None else None
    if loaded is None:
        loaded = load_parts(cfg, device="cpu" if host is not None else device, with_transformer=False)
        if host is not None:
            host["encoders"] = loaded
    place_encoders(loaded, device)
    try:
        yield replace(loaded, transformer=parts.transformer, fp32_file_values=parts.fp32_file_values)
    finally:
        if host is not None:
            place_encoders(loaded, "cpu")
        del loaded
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


@contextlib.contextmanager
def visiting(module: torch.nn.Module, device):
    """`module` on `device` while the context is open, then back on the host (its memory freed)."""
    module.to(device)
    try:
        yield module
    finally:
        module.to("cpu")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def for_sampling(model, device, dtype: torch.dtype):
    """The transformer ready to sample on `device` in `dtype` (precision.to_inference_dtype). Two
    experts (a TwoExperts) stay on the host and take turns on the device, swapped at the boundary:
    one 14B expert's ~29 GB of bf16 on the GPU instead of both (~58 GB)."""
    if not isinstance(model, TwoExperts):
        return to_inference_dtype(model, device, dtype)
    experts = {name: to_inference_dtype(e, "cpu", dtype) for name, e in model.experts.items()}
    return swap_on_device(experts, model.boundary_ratio, device)


def swap_on_device(experts: dict, boundary: float, device):
    """experts.switch over `experts` kept on the host, each moved to `device` when its timesteps
    come (the other one moved back first): a denoising loop runs the high-noise expert, then the
    low-noise one, so a video costs one swap each way."""
    on_device = {"name": None}

    def call(hidden_states, timestep, **kwargs):
        name = expert_for(timestep, boundary)
        if on_device["name"] != name:
            if on_device["name"] is not None:
                experts[on_device["name"]].to("cpu")
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            experts[name].to(device)
            on_device["name"] = name
        return experts[name](hidden_states, timestep=timestep, **kwargs)

    call.experts, call.on_device = experts, on_device  # what tests and callers inspect
    return call
