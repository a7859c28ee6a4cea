"""The device convention (e2v/runtime/device.py) on a CPU-only machine: every model goes to the meta
device, which stands in for CUDA. An op that mixes a CPU tensor with a meta one raises ("Tensor on
device meta is not on the expected device cpu"), as a CPU/CUDA mix does on a GPU, and copying a
meta tensor to the CPU raises too ("Cannot copy out of meta tensor"), as a silent per-step
device-to-host copy would cost a sync on a GPU. So each stage that runs here to the end with meta
outputs follows the convention: online conditioning, the cached conditions, the step's forward
and loss, validation scoring, the sampler, the validation's CLIP element similarity, the
visualization decode, precompute, and the rope tables of the ZeRO-3 partitioned load."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch
from helpers_conditioning import make_batch, make_cfg
from PIL import Image

from e2v.runtime.device import to_device

META = torch.device("meta")


@pytest.fixture(scope="module")
def meta_parts(tiny_parts):
    """The tiny parts on the meta device. UMT5's mask builder peeks at the mask's values
    (`padding_mask.all()`, to skip an all-ones mask), which meta tensors do not have: on the meta
    device the peek answers "not all ones", and the full mask is built, as it is for any padded
    prompt on a GPU."""
    import transformers.masking_utils as masking

    from e2v.models.parts import place_encoders

    peek = masking._ignore_bidirectional_mask_sdpa
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(masking, "_ignore_bidirectional_mask_sdpa",
                   lambda mask, *a, **kw: False if mask is not None and mask.is_meta else peek(mask, *a, **kw))
        parts = copy.deepcopy(tiny_parts)
        parts.transformer.to(META)
        yield place_encoders(parts, META)


def assert_on(device: torch.device, **tensors) -> None:
    for name, t in tensors.items():
        if t is not None:
            assert t.device == device, f"{name} is on {t.device}, not {device}"


def encode(batch, parts, cfg, **kw):
    from e2v.conditioning.layout import batch_conditions

    with torch.no_grad():
        return batch_conditions(batch, parts, cfg, rng=random.Random(0), generator=torch.Generator().manual_seed(0), **kw)


@pytest.mark.parametrize("over", [{}, {"processors__vae__combine": "after"}, {"processors__vae__sample_mode": "sample"},
                                  {"conditioning__target_layout": "prepend"}])
@pytest.mark.parametrize("moved", [True, False], ids=["batch_on_device", "cpu_batch"])
def test_online_conditioning_lands_on_the_models_device(meta_parts, over, moved):
    """The loader's CPU batch given to models on another device (the first-VAE-call crash), and
    the batch moved first as the loop does: every condition tensor on the models' device."""
    cfg = make_cfg(**over)
    batch = make_batch([3, 1])
    batch["video"] = ((batch["video"] + 1) * 127.5).round().to(torch.uint8)  # as the loader ships it
    c = encode(to_device(batch, META) if moved else batch, meta_parts, cfg)
    assert_on(META, latents=c.latents_BCTHW, cond=c.cond_BCTHW, text=c.text_BLD, clip=c.clip_BLD)
    assert c.cond_BCTHW.shape[1] == 20 and c.clip_BLD is not None


def test_cached_conditions_land_on_the_batch_device(tiny_parts):
    """batch_conditions on a cached batch with the batch moved: posterior samples, zero conditions, CLIP padding
    and the text rows are made on the batch's device."""
    from e2v.conditioning.cached import compute_entry
    from e2v.conditioning.encode import encode_text
    from e2v.conditioning.layout import batch_conditions

    cfg = make_cfg(processors__vae__sample_mode="sample", conditioning__target_sample_mode="sample")
    raw = make_batch([2, 1])
    items = [{k: v[i] for k, v in raw.items() if k not in ("id", "skipped")} for i in range(2)]
    entries = [compute_entry(it, tiny_parts, cfg) for it in items]
    empty = encode_text([""], tiny_parts.tokenizer, tiny_parts.text_encoder)[0, :1]
    shared = {"empty_text": empty, "clip_shape": (17, 32)}
    batch = {"id": raw["id"], "prompt": raw["prompt"], "element_names": raw["element_names"], "cached": entries,
             "shared": [shared, shared], "skipped": []}
    meta = copy.copy(tiny_parts)
    meta.transformer = copy.deepcopy(tiny_parts.transformer).to(META)
    with torch.no_grad():
        c = batch_conditions(to_device(batch, META), meta, cfg, rng=random.Random(0),
                                  generator=torch.Generator().manual_seed(0))
    assert_on(META, latents=c.latents_BCTHW, cond=c.cond_BCTHW, text=c.text_BLD, clip=c.clip_BLD)


def test_step_forward_and_loss_stay_on_the_models_device(meta_parts):
    """The flow draw (CPU generator, then moved) and the forward and loss: no copy back to the CPU."""
    from e2v.train.step import draw_flow, forward_loss

    cfg = make_cfg()
    c = encode(to_device(make_batch([2, 3]), META), meta_parts, cfg)
    gen = torch.Generator().manual_seed(0)
    sigma, noise, noisy = draw_flow(c, cfg.flow, gen)
    loss, per_sample, pred, target = forward_loss(meta_parts.transformer, c, sigma, noise, noisy, cfg, torch.float32)
    assert_on(META, sigma=sigma, noise=noise, noisy=noisy, loss=loss, per_sample=per_sample, pred=pred, target=target)


def test_validation_scores_on_the_models_device(meta_parts, tmp_path):
    from e2v.eval.validation import Validator

    cfg = make_cfg()
    conds = [encode(to_device(make_batch([n], seed=n), META), meta_parts, cfg, train=False) for n in (1, 2, 3)]
    v = Validator(cfg, [], meta_parts, tmp_path, rank=0, device=META, dtype=torch.float32)
    variants = {"true": [0, 1, 2], "shuffled": [1, 2, 0], "dropped": [None] * 3}
    losses = v.per_sample_losses(meta_parts.transformer, conds, variants, 0.9, seed=0)
    assert set(losses) == set(variants)
    for name, per_sample in losses.items():
        assert per_sample.device == META and per_sample.shape == (3,), name


def test_sampler_runs_on_the_models_device(meta_parts):
    """generate: noise drawn on the CPU and moved, conditions encoded on the device, UniPC with
    CFG; the latents come back on the models' device."""
    from e2v.eval.sampling import generate

    cfg = make_cfg()
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8))
    latents = generate(meta_parts.transformer, meta_parts, cfg, ["a shape moves"], [{"subject": image}], seed=1,
                       num_steps=3, guidance_scale=3.0, shift=3.0, device=META)
    assert latents.device == META and latents.shape == (1, 16, 5, 4, 4)


def test_visualization_decode_on_the_vae_device(meta_parts):
    from e2v.eval.viz import decode_pixels

    pixels = decode_pixels(torch.randn(2, 16, 5, 4, 4), meta_parts.vae)
    assert pixels.device == META and pixels.shape == (2, 3, 17, 32, 32)


def test_element_similarity_on_the_clip_device(meta_parts):
    """The validation's CLIP element similarity (e2v/eval/fidelity.py): frames and references (uint8 on
    the host, as decoded videos and loaded images are) embedded on the encoder's device, the
    similarities left there for one copy of the logged means."""
    from e2v.eval.fidelity import element_similarity

    rng = np.random.default_rng(0)
    videos = [rng.integers(0, 256, (5, 32, 32, 3), dtype=np.uint8) for _ in range(2)]
    refs = [{"subject": rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)} for _ in range(3)]
    sims = element_similarity(videos, refs, [1, 2], meta_parts.image_encoder, meta_parts.image_processor)
    own, other = sims["subject"]
    assert own.device == META == other.device and own.shape == (2,) == other.shape


def test_precompute_entry_on_the_encoders_device(meta_parts):
    from e2v.conditioning.cached import compute_entry

    for over in ({}, {"processors__vae__combine": "after"}):
        cfg = make_cfg(**over)
        raw = make_batch([3])
        item = {k: v[0] for k, v in raw.items() if k not in ("id", "skipped")}
        entry = compute_entry(item, meta_parts, cfg)
        assert entry and all(t.device == META for t in entry.values()), {k: t.device for k, t in entry.items()}


def test_zero3_partitioned_load_puts_the_buffers_on_the_engine_device(tiny_parts, tmp_path, monkeypatch,
                                                                     one_rank_group):
    """deepspeed.initialize does not move a module built under zero.Init: the rope tables (the
    model's buffers) must be made on the engine's device. The accelerator's device name is stubbed
    to the meta device; the partitions themselves are DeepSpeed's (on the accelerator it reports)."""
    import e2v.models.zero3_load as zero3_load

    tiny_parts.transformer.save_pretrained(tmp_path / "transformer")
    monkeypatch.setattr(zero3_load, "accelerator_device", lambda: META)
    ds = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    model, _ = zero3_load.load_transformer_zero3(tmp_path / "transformer", ds, torch.float32)
    buffers = dict(model.named_buffers())
    assert buffers and all(b.device == META for b in buffers.values()), {n: b.device for n, b in buffers.items()}
    # and the partitions in the training dtype: deepspeed 0.19's zero.Init turns an fp32 `dtype`
    # argument into bf16 on a CPU accelerator, so the load takes it from the ds_config instead
    assert {p.ds_tensor.dtype for p in model.parameters()} == {torch.float32}


# --- the optimizer DeepSpeed can build, and the loader -------------------------------------------


@pytest.mark.parametrize("ds_file,offload", [("ds_configs/zero2.json", False), ("ds_configs/zero2_offload.json", True)])
def test_with_cuda_torch_adamw_is_fused_where_the_fp32_partition_lives(ds_file, offload):
    """Under ZeRO the optimizer steps one flat fp32 partition: on the GPU, or on the CPU under
    optimizer offload, where torch's fused CPU AdamW runs it (DeepSpeed told so by
    zero_force_ds_cpu_optimizer: false). Fused AdamW does not need the parameters on the GPU.
    tests/unit/test_optimizer.py: DeepSpeed's Adam by name, and its preflight."""
    from e2v.train.ds_config import adam_choice, resolve_deepspeed_config

    cfg = make_cfg(deepspeed__config=ds_file)
    ds = resolve_deepspeed_config(cfg, world_size=1, cuda=True)
    assert ds["optimizer"]["params"]["torch_adam"] is True and ds["optimizer"]["params"]["fused"] is True
    assert ("zero_force_ds_cpu_optimizer" in ds) is offload
    assert ("on the CPU (optimizer offload)" if offload else "on the GPU") in adam_choice(cfg, ds, cuda=True)[1]


def test_without_cuda_torch_adamw_is_used_and_never_fused():
    """The CPU-only runs (the tests, the golden losses) keep torch's default AdamW implementation."""
    from e2v.train.ds_config import resolve_deepspeed_config

    ds = resolve_deepspeed_config(make_cfg(), world_size=1, cuda=False)
    assert ds["optimizer"]["params"]["torch_adam"] is True and "fused" not in ds["optimizer"]["params"]


def test_loader_workers_default_to_cores_per_gpu_with_cuda(monkeypatch):
    import e2v.data.dataset as data

    cfg = make_cfg()
    assert cfg.data.num_workers is None and data.loader_workers(cfg) == 0  # CPU-only: the step needs the cores
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(data.os, "cpu_count", lambda: 64)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert data.loader_workers(cfg) == 4
    monkeypatch.setattr(data.os, "cpu_count", lambda: 8)
    assert data.loader_workers(cfg) == 0  # one core per GPU: the main thread decodes
    cfg.data.num_workers = 2
    assert data.loader_workers(cfg) == 2
