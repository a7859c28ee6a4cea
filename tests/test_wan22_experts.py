"""Wan2.2-I2V-A14B's two experts (e2v/config/experts.py) against diffusers' WanImageToVideoPipeline as the
oracle: its boundary switch on base experts, and two runs of the real entry point whose LoRA
exports load into the pipeline (one expert: `load_into_transformer_2=True` only; both experts,
with image attention added for the CLIP pathway) and reproduce our sampler's trajectory. Plus the
config rules of `model.expert`, the per-expert sigma draw, the zero-initialised expansion, and the
memory plan of the released model. `pytest -k wan22` selects them all."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import ROOT, read_scalars
from helpers_launch import early, early_dir, early_leader, launch_train, starts_early
from PIL import Image
from safetensors.torch import load_file

from e2v.config.load import load_config
from e2v.config.schema import ConfigError

TINY = ("model.preset=tiny_wan22_a14b",)
ONE_ELEMENT = "data.elements=[{name: person, suffixes: [_person.png], vae: {repeat: 1, position: 0}}]"


def _cfg(*sets, check_paths=False):
    return load_config(ROOT / "configs/e2v_tiny_lora.yaml", list(sets), check_paths=check_paths)


def _image(seed=1):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (64, 64, 3), dtype=np.uint8))


def _pipe(parts, high, low, **kw):
    from diffusers import WanImageToVideoPipeline

    from e2v.config.experts import TINY_BOUNDARY_RATIO
    from e2v.eval.sampling import make_scheduler

    return WanImageToVideoPipeline(tokenizer=parts.tokenizer, text_encoder=parts.text_encoder, vae=parts.vae,
                                   transformer=high, transformer_2=low, boundary_ratio=TINY_BOUNDARY_RATIO,
                                   scheduler=make_scheduler(3.0), **kw)


SAMPLE = dict(prompt="a shape moves", negative_prompt="static", seed=5, steps=4, guidance=2.5)


def _pipeline_latents(pipe, image):
    return pipe(image=image, prompt=SAMPLE["prompt"], negative_prompt=SAMPLE["negative_prompt"], height=64, width=64,
                num_frames=17, num_inference_steps=SAMPLE["steps"], guidance_scale=SAMPLE["guidance"],
                output_type="latent", generator=torch.Generator().manual_seed(SAMPLE["seed"])).frames


def _our_latents(model, parts, cfg, image):
    from e2v.eval.sampling import generate

    return generate(model, parts, cfg, [SAMPLE["prompt"]], [{"person": image}], seed=SAMPLE["seed"],
                    num_steps=SAMPLE["steps"], guidance_scale=SAMPLE["guidance"], shift=3.0,
                    negative_prompt=SAMPLE["negative_prompt"])


# --- config -----------------------------------------------------------------------------------------


def _pipeline_folder(tmp_path, name: str, index: dict):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "model_index.json").write_text(json.dumps(index))
    return folder


def test_wan22_model_expert_rules_name_key_and_fix(tmp_path):
    from e2v.config.experts import boundary_ratio

    with pytest.raises(ConfigError, match=r"model.expert: both, but model.preset tiny has one transformer.*remove "
                                          r"model.expert.*tiny_wan22_a14b"):
        _cfg("model.expert=both")
    with pytest.raises(ConfigError, match=r"model.expert is required: .* two experts .*high_noise, low_noise .*both"):
        _cfg(*TINY)
    with pytest.raises(ConfigError, match=r"validation.sigmas \[0.1, 0.5\]: none is the high_noise expert's "
                                          r"\(sigma >= 0.9\)"):
        _cfg(*TINY, "model.expert=high_noise", "validation.sigmas=[0.1,0.5]")
    with pytest.raises(ConfigError, match=r"flow.denoising_step_list \[950.0\]: no timestep of the low_noise"):
        _cfg(*TINY, "model.expert=low_noise", "flow.denoising_step_list=[950]")
    with pytest.raises(ConfigError, match="model.base: t2v, but .* set model.base: i2v"):
        _cfg(*TINY, "model.expert=both", "model.base=t2v")

    # a local pipeline folder: its model_index.json decides (diffusers writes [null, null] for no component)
    two = _pipeline_folder(tmp_path, "two", {"_class_name": "WanImageToVideoPipeline", "boundary_ratio": 0.9,
                                      "transformer": ["diffusers", "WanTransformer3DModel"],
                                      "transformer_2": ["diffusers", "WanTransformer3DModel"]})
    cfg = _cfg("model.preset=null", f"model.pretrained={two}", "model.expert=low_noise", "e2v_type=vae")
    assert boundary_ratio(cfg) == 0.9
    with pytest.raises(ConfigError, match=r"e2v_type: dual needs a CLIP image encoder.*set model.image_encoder"):
        _cfg("model.preset=null", f"model.pretrained={two}", "model.expert=both")
    one = _pipeline_folder(tmp_path, "one", {"boundary_ratio": None, "transformer_2": [None, None],
                                             "expand_timesteps": True})
    with pytest.raises(ConfigError, match="its model_index.json has no transformer_2 and boundary_ratio"):
        _cfg("model.preset=null", f"model.pretrained={one}", "model.expert=low_noise")
    released = _cfg("model.preset=null", "model.pretrained=Wan-AI/Wan2.2-I2V-A14B-Diffusers", "model.expert=both",
                    "model.image_encoder=Wan-AI/Wan2.1-I2V-14B-480P-Diffusers")
    assert boundary_ratio(released) == 0.9


def test_wan22_pretrained_folder_written_by_diffusers_loads_the_expert(tmp_path):
    """A two-expert pipeline folder as diffusers' save_pretrained writes it (its model_index.json
    is the oracle of the format): the boundary is read from it, `low_noise` loads transformer_2's
    weights alone, and the plan builds from its config without reading weights."""
    from diffusers import WanImageToVideoPipeline

    from e2v.config.experts import boundary_ratio
    from e2v.models.load import load_parts
    from e2v.models.plan import build_meta_transformer
    from e2v.models.tiny import build_tiny_experts, build_tiny_parts

    p = build_tiny_parts(0, with_encoders=True)
    experts = build_tiny_experts(0, ("high_noise", "low_noise"))
    WanImageToVideoPipeline(tokenizer=p.tokenizer, text_encoder=p.text_encoder, vae=p.vae, scheduler=None,
                            transformer=experts["high_noise"], transformer_2=experts["low_noise"],
                            boundary_ratio=0.875).save_pretrained(tmp_path / "pipe")
    cfg = _cfg("model.preset=null", f"model.pretrained={tmp_path / 'pipe'}", "model.expert=low_noise", "e2v_type=vae")
    assert boundary_ratio(cfg) == 0.875
    model = load_parts(cfg, with_encoders=False).transformer
    assert list(model.experts) == ["low_noise"] and model.boundary_ratio == 0.875
    want = experts["low_noise"].state_dict()
    assert all(torch.equal(v, want[k]) for k, v in model.low_noise.state_dict().items())
    assert list(build_meta_transformer(cfg).experts) == ["low_noise"]


# --- the sigma draw ---------------------------------------------------------------------------------


@pytest.mark.parametrize("flow", [("flow.sigma_sampling=uniform", "flow.shift=3"),
                                  ("flow.sigma_sampling=logit_normal", "flow.shift=5", "flow.logit_mean=0.5"),
                                  ("flow.denoising_step_list=[999,950,900,800,500,100]",)])
def test_wan22_sigma_draw_per_expert_and_both(flow):
    """One expert: every drawn sigma's timestep is its expert's by the pipeline's rule, and the
    draw is the unrestricted one conditioned on that range (oracle: unrestricted draws, filtered).
    Both: each micro-batch stays on one side, and the mixture is the unrestricted distribution."""
    from e2v.config.experts import EXPERTS, expert_for, sigma_range
    from e2v.train.flow import sample_sigmas
    from e2v.train.step import expert_sigma_range

    n = 4000
    free = _cfg(*flow).flow
    kw = dict(mode=free.sigma_sampling, shift=free.shift, logit_mean=free.logit_mean, logit_std=free.logit_std,
              timestep_list=free.denoising_step_list)
    unrestricted = sample_sigmas(20 * n, generator=torch.Generator().manual_seed(0), **kw)
    quantiles = torch.linspace(0.05, 0.95, 19)
    for expert in EXPERTS:
        cfg = _cfg(*TINY, f"model.expert={expert}", *flow)
        gen = torch.Generator().manual_seed(1)
        sigmas = torch.cat([sample_sigmas(4, generator=gen, **kw, sigma_range=expert_sigma_range(cfg, 1, i))
                            for i in range(n // 4)])
        assert {expert_for(1000 * s.view(1), 0.9) for s in sigmas} == {expert}
        lo, hi = sigma_range(expert, 0.9)
        inside = unrestricted[(unrestricted >= lo) & (unrestricted <= hi)]
        assert (sigmas.quantile(quantiles) - inside.quantile(quantiles)).abs().max() < 0.02
    # the edge on the fp32 grid: the last low-noise sigma and the first high-noise one are neighbours
    low_hi, high_lo = sigma_range("low_noise", 0.9)[1], sigma_range("high_noise", 0.9)[0]
    assert torch.nextafter(torch.tensor(low_hi), torch.tensor(1.0)).item() == high_lo

    cfg = _cfg(*TINY, "model.expert=both", *flow)
    gen = torch.Generator().manual_seed(2)
    batches = [sample_sigmas(4, generator=gen, **kw, sigma_range=expert_sigma_range(cfg, i // 4, i % 4))
               for i in range(n)]
    sides = [expert_for(1000 * b, 0.9) for b in batches]  # raises if a micro-batch straddled the boundary
    assert set(sides) == set(EXPERTS)
    mixed = torch.cat(batches)
    assert (mixed.quantile(quantiles) - unrestricted.quantile(quantiles)).abs().max() < 0.02
    high_share = (unrestricted >= high_lo).float().mean().item()
    assert abs(sides.count("high_noise") / n - high_share) < 0.03


# --- the switch and the expansion -------------------------------------------------------------------


def test_wan22_switch_matches_pipeline_trajectory():
    """Two tiny base experts, one reference (A2's layout is then the Wan I2V layout): our sampler
    on the TwoExperts module gives the trajectory of WanImageToVideoPipeline(transformer,
    transformer_2, boundary_ratio) exactly; the schedule's timesteps (999, 900, 750, 500) put the
    boundary timestep itself on the high-noise side, and both experts ran."""
    from e2v.models.load import load_parts

    cfg = _cfg(*TINY, "model.expert=both", "e2v_type=vae", ONE_ELEMENT)
    parts = load_parts(cfg)
    two = parts.transformer
    calls = []
    hooks = [e.register_forward_pre_hook(lambda m, a, k, n=n: calls.append((n, int(k["timestep"][0]))),
                                         with_kwargs=True) for n, e in two.experts.items()]
    image = _image()
    ours = _our_latents(two, parts, cfg, image)
    for h in hooks:
        h.remove()
    assert sorted(set(calls)) == [("high_noise", 900), ("high_noise", 999), ("low_noise", 500), ("low_noise", 750)]
    ref = _pipeline_latents(_pipe(parts, two.high_noise, two.low_noise), image)
    torch.testing.assert_close(ours, ref, atol=0, rtol=0)
    probe = dict(hidden_states=torch.randn(1, 36, 5, 8, 8), timestep=torch.tensor([950]),
                 encoder_hidden_states=torch.randn(1, 512, 32), return_dict=False)
    with torch.no_grad():  # distinct experts: a wrong switch could not give the pipeline's trajectory
        assert (two.high_noise(**probe)[0] - two.low_noise(**probe)[0]).abs().max() > 1e-2


def test_wan22_clip_pathway_adds_zero_initialised_image_attention():
    """e2v_type dual on the two experts: each gains image attention (the T2V expansion's modules,
    trained in full) and keeps its 36-channel patch embedding (not retrained); at step 0 each
    expert's output with CLIP tokens equals the base expert's without them."""
    from e2v.models.load import load_parts
    from e2v.models.tiny import build_tiny_experts
    from e2v.train.engine import prepare_for_training

    cfg = _cfg(*TINY, "model.expert=both", "train.trainable=[]")
    parts = load_parts(cfg, with_encoders=False)
    base = build_tiny_experts(0, ("high_noise", "low_noise"))
    g = torch.Generator().manual_seed(0)
    x, text = torch.randn(1, 36, 5, 8, 8, generator=g), torch.randn(1, 512, 32, generator=g)
    clip = torch.randn(1, 17 * 3, 32, generator=g)
    for name, expert in parts.transformer.experts.items():
        assert expert.config.in_channels == 36 and expert.config.added_kv_proj_dim == 24
        t = torch.tensor([950.0 if name == "high_noise" else 300.0])
        with torch.no_grad():
            got = expert(x, timestep=t, encoder_hidden_states=text, encoder_hidden_states_image=clip, return_dict=False)[0]
            want = base[name](x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    full = prepare_for_training(parts, cfg)
    assert {n.split(".")[0] for n in full} == {"high_noise", "low_noise"}
    assert not any("patch_embedding" in n for n in full)
    assert any(n.startswith("low_noise.blocks.0.attn2.add_v_proj") for n in full)
    assert any("lora_A" in n for n, p in parts.transformer.low_noise.named_parameters() if p.requires_grad)


def test_wan22_memory_plan_of_the_released_model():
    """--dry_run's model on the meta device from the published config (no download): each expert
    has the 14B shape with 36 input channels and no image attention; `both` is exactly twice one
    expert; the dry run says so; tools/estimate_memory plans the shipped config."""
    from diffusers import WanTransformer3DModel

    from e2v.models.plan import KNOWN_WAN_CONFIGS, build_meta_transformer, count_params, describe_plan

    sets = ("model.preset=null", "model.pretrained=Wan-AI/Wan2.2-I2V-A14B-Diffusers", "e2v_type=vae")
    one = build_meta_transformer(load_config(ROOT / "configs/e2v_wan22_i2v_a14b.yaml", [*sets, "model.expert=low_noise"],
                                             check_paths=False))
    cfg = load_config(ROOT / "configs/e2v_wan22_i2v_a14b.yaml", [*sets, "model.expert=both"], check_paths=False)
    both = build_meta_transformer(cfg)
    c = one.low_noise.config
    assert (c.num_layers, c.num_attention_heads * c.attention_head_dim, c.ffn_dim, c.in_channels, c.image_dim) == \
           (40, 5120, 13824, 36, None)
    assert list(one.experts) == ["low_noise"] and list(both.experts) == ["high_noise", "low_noise"]
    with torch.device("meta"):
        t2v_14b = WanTransformer3DModel.from_config(KNOWN_WAN_CONFIGS["Wan-AI/Wan2.1-T2V-14B-Diffusers"])
    assert count_params(one) == count_params(t2v_14b) + 20 * 5120 * 4  # 20 more input channels x (1, 2, 2)
    assert count_params(both) == 2 * count_params(one)
    assert "experts: both trained in one module" in describe_plan(both, cfg, {"zero_optimization": {"stage": 3}}, [])
    from e2v.train import memory as estimate_memory

    shipped = load_config(ROOT / "configs/e2v_wan22_i2v_a14b.yaml", ["cache.enabled=true"], check_paths=False)
    r = estimate_memory.estimate(shipped, 1, 24)
    lora = 64 * (5120 + 5120) * 8 * 40  # rank 64 on 8 square 5120 projections in each of 40 blocks
    assert r["trainable"] == lora + 5120 * 36 * 4 + 5120  # + the patch embedding in full
    assert r["trainable"] + r["frozen"] == count_params(one) + lora
    assert r["best"] is not None  # one expert from the cache fits a 24 GB GPU


# --- two runs of the real entry point ---------------------------------------------------------------

RUN_BOTH = (*TINY, "model.expert=both", "train.max_steps=4", "train.micro_batch_size=2", "train.checkpoint_every=4",
            "validation.every_n_steps=4", "validation.num_videos=1", "validation.num_inference_steps=2",
            "validation.sigmas=[0.3,0.9]", "visualization.frequency=4")
RUN_LOW = (*TINY, "model.expert=low_noise", "e2v_type=vae", "train.max_steps=3", "train.micro_batch_size=2",
           "cache.enabled=true", "validation.every_n_steps=3", "validation.num_videos=1",
           "validation.num_inference_steps=2", "validation.sigmas=[0.3,0.9]", "visualization.enabled=false")


@starts_early("wan22_runs")
def _start_wan22_runs(request):
    """Side by side: both experts (dual: image attention added) with validation and visualization;
    the low-noise expert alone (vae) from a cache filled by tools/precompute.py first."""
    from tools.precompute import main as precompute

    out = early_dir(request, "wan22")
    data = request.getfixturevalue("demo_data")
    common = (f"data.datasets.0.data_root={data}", f"output_dir={out}")
    low = (*common, *RUN_LOW, f"cache.dir={out / 'cache'}")
    if early_leader():  # the cache the low-noise run reads (tests/helpers_launch.py: early runs are shared)
        assert precompute(["--config", str(ROOT / "configs/e2v_tiny_lora.yaml"),
                           *[a for s in low if s != "cache.enabled=true" for a in ("--set", s)]]) == 0
    return {"both": (launch_train("configs/e2v_tiny_lora.yaml", *common, *RUN_BOTH, "run_id=both"), out / "both"),
            "low": (launch_train("configs/e2v_tiny_lora.yaml", *low, "run_id=low"), out / "low")}


@pytest.fixture(scope="module")
def wan22_runs(request):
    runs = early("wan22_runs", request)
    for launch, _ in runs.values():
        launch.wait()
    return {name: run for name, (_, run) in runs.items()}


def test_wan22_runs_train_validate_and_export_per_expert(wan22_runs):
    both, low = read_scalars(wan22_runs["both"]), read_scalars(wan22_runs["low"])
    seen = {k for s in both.values() for k in s if k.startswith("train/loss_") and "noise" in k}
    assert seen == {"train/loss_high_noise", "train/loss_low_noise"}  # micro-batches went to each expert
    assert {k for s in low.values() for k in s if "noise" in k} == {"train/loss_low_noise"}
    assert {"val/loss_at_sigma_0.3", "val/loss_at_sigma_0.9", "val/reference_gap_shuffle"} <= set(both[4])
    # one expert: only its own sigmas are scored; the videos switch to the base high-noise expert
    assert "val/loss_at_sigma_0.3" in low[3] and "val/loss_at_sigma_0.9" not in low[3]
    for run in wan22_runs.values():
        assert list((run / "samples").glob("step_*/00.mp4"))
    assert (wan22_runs["both"] / "visualizations/step_000004/contact_sheet.png").exists()
    files = {"pytorch_lora_weights.safetensors", "pytorch_lora_weights_comfyui.safetensors", "e2v_model.json"}
    assert sorted(p.name for p in (wan22_runs["low"] / "lora").iterdir()) == ["low_noise"]
    assert files | {"e2v_modules.safetensors"} <= {p.name for p in (wan22_runs["low"] / "lora/low_noise").iterdir()}
    for expert in ("high_noise", "low_noise"):
        folder = wan22_runs["both"] / "lora" / expert
        assert files | {"e2v_modules.safetensors", "e2v_modules_comfyui.safetensors"} <= {p.name for p in folder.iterdir()}
        meta = json.loads((folder / "e2v_model.json").read_text())
        assert meta["image_dim"] == 32 and any("add_k_proj" in n for n in meta["extra_modules"])
        assert not any(k.startswith(("high_noise", "low_noise")) for k in load_file(str(folder / "pytorch_lora_weights.safetensors")))
        comfy = load_file(str(folder / "pytorch_lora_weights_comfyui.safetensors"))
        # the expert's base modules trained in full are differences; the added image attention is not
        assert "diffusion_model.patch_embedding.diff" in comfy and "diffusion_model.head.head.diff" in comfy
        assert not any(".k_img." in k and k.endswith("diff") for k in comfy)


def test_wan22_offline_export_of_a_checkpoint_matches_the_run_export(wan22_runs, tmp_path):
    from e2v.train.checkpoint import export_checkpoint

    run = wan22_runs["both"]
    export_checkpoint(run / "checkpoints/step_000004", tmp_path)
    for expert in ("high_noise", "low_noise"):
        for name in ("pytorch_lora_weights.safetensors", "e2v_modules.safetensors", "e2v_modules_comfyui.safetensors",
                     "pytorch_lora_weights_comfyui.safetensors"):
            want, got = load_file(str(run / "lora" / expert / name)), load_file(str(tmp_path / expert / name))
            assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want), (expert, name)


def test_wan22_both_expert_exports_load_into_the_pipeline(wan22_runs):
    """Both experts trained (dual: image attention added): the T2V-style rebuild of each expert's
    shape (expand_from_export), its LoRA (`load_into_transformer_2=True` for low noise) and its
    modules trained in full, in WanImageToVideoPipeline with CLIP: the trajectory equals our
    sampler's on the model tools/sample.py loads, and differs from the base pipeline's."""
    from e2v.eval.sampling import load_trained
    from e2v.models.expand import expand_from_export
    from e2v.models.load import load_parts
    from e2v.models.tiny import build_tiny_experts
    from e2v.train.export import load_extra_modules

    run = wan22_runs["both"]
    cfg = load_config(run / "config.yaml", check_paths=False)
    parts = load_parts(cfg, all_experts=True)
    ours = _our_latents(load_trained(parts.transformer, run / "lora"), parts, cfg, _image(2))

    def pipe(trained: bool):
        base = build_tiny_experts(0, ("high_noise", "low_noise"))
        high, low = (expand_from_export(base[e], run / "lora" / e) for e in ("high_noise", "low_noise"))
        p = _pipe(parts, high, low, image_encoder=parts.image_encoder, image_processor=parts.image_processor)
        if trained:
            p.load_lora_weights(str(run / "lora/high_noise"))
            p.load_lora_weights(str(run / "lora/low_noise"), load_into_transformer_2=True)
            load_extra_modules(p.transformer, run / "lora/high_noise")
            load_extra_modules(p.transformer_2, run / "lora/low_noise")
        return p

    ref = _pipeline_latents(pipe(True), _image(2))
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=0)
    assert (ref - _pipeline_latents(pipe(False), _image(2))).abs().max() > 1e-3


def test_wan22_one_expert_export_loads_into_transformer_2(wan22_runs, tmp_path):
    """The low-noise expert alone: its LoRA and modules in the pipeline's transformer_2, the base
    transformer untouched, equal our sampler on (base high, trained low), and not the base video.
    Its ComfyUI copy (the LoRA through diffusers' ComfyUI converter, the modules trained in full
    added as ComfyUI adds `.diff`s) gives the same trajectory. tools/sample.py writes the video."""
    import importlib.util

    import imageio.v3 as iio
    from helpers_comfy import apply_diffs, split

    from e2v.eval.sampling import load_trained
    from e2v.models.load import load_parts
    from e2v.models.tiny import build_tiny_experts
    from e2v.train.export import load_extra_modules

    run = wan22_runs["low"]
    cfg = load_config(run / "config.yaml", check_paths=False)
    parts = load_parts(cfg, all_experts=True)
    model = load_trained(parts.transformer, run / "lora")
    assert not hasattr(model.high_noise, "peft_config") and hasattr(model.low_noise, "peft_config")
    ours = _our_latents(model, parts, cfg, _image(3))

    def pipe():
        base = build_tiny_experts(0, ("high_noise", "low_noise"))
        return _pipe(parts, base["high_noise"], base["low_noise"])

    p = pipe()
    p.load_lora_weights(str(run / "lora/low_noise"), load_into_transformer_2=True)
    load_extra_modules(p.transformer_2, run / "lora/low_noise")
    assert not hasattr(p.transformer, "peft_config")
    ref = _pipeline_latents(p, _image(3))
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=0)
    assert (ref - _pipeline_latents(pipe(), _image(3))).abs().max() > 1e-3

    lora, diffs = split(load_file(str(run / "lora/low_noise/pytorch_lora_weights_comfyui.safetensors")))
    assert diffs and all(k.startswith("diffusion_model.") for k in lora)
    comfy = pipe()
    comfy.load_lora_weights(lora, load_into_transformer_2=True)
    apply_diffs(comfy.transformer_2, diffs)
    torch.testing.assert_close(_pipeline_latents(comfy, _image(3)), ref, atol=2e-5, rtol=0)

    spec = importlib.util.spec_from_file_location("sample_tool", ROOT / "tools/sample.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    _image(3).save(tmp_path / "p.png")
    tool.main(["--config", str(run / "config.yaml"), "--lora", str(run / "lora"), "--prompt", "a shape moves",
               "--element", f"person={tmp_path / 'p.png'}", "--steps", "2", "--out", str(tmp_path / "v.mp4")])
    assert iio.imread(tmp_path / "v.mp4").shape == (17, 64, 64, 3)
