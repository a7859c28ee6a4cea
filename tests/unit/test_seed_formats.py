"""The configs users already have (docs/formats.md): nested and flat E2V dataset JSON
and the finetrainers-style flags, mapped onto the YAML schema with a printed note; unknown keys
still fail; a seed width of 854 rounds to 848 with a printed note (our YAML stops on it instead),
and the seed examples as users have them dry-run through the real entry point."""

from __future__ import annotations

import copy
import json
import sys

import pytest

from e2v.config.load import load_config
from e2v.config.schema import ConfigError
from e2v.config.seed_formats import map_seed_flags

# The seed's nested-style example (docs/formats.md, "Element keys"), verbatim except the
# resolution (854 is tested on its own below).
NESTED = {"datasets": [{
    "data_root": "REPLACED", "dataset_type": "e2v",
    "target_resolution": [480, 832], "auto_frame_buckets": True, "reshape_mode": "bicubic",
    "remove_common_llm_caption_prefixes": True,
    "elements": [
        {"name": "main_subject", "suffixes": ["_dog.png", "_person.png", "_mask.png"], "required": True,
         "vae": {"repeat": 4, "position": 0}, "clip": {"preprocess": "center_crop"}},
        {"name": "secondary", "suffixes": ["_object.png", "_toy.png"], "required": False,
         "vae": {"repeat": 4, "position": 1}, "clip": {"preprocess": "pad_white"}},
        {"name": "environment", "suffixes": ["_background.png", "_scene.png"], "required": False,
         "vae": {"repeat": 4, "position": 2}, "clip": {"preprocess": "letterbox"}}],
    "processors": {
        "vae": {"resolution": [480, 832], "combine": "before", "default_preprocess": "resize",
                "frame_conditioning": "full", "frame_index": 0, "concatenate_mask": True},
        "clip": {"resolution": [512, 512], "default_preprocess": "center_crop"}},
    "visualization": {"enabled": True, "output_dir": "visualizations/{run_id}", "frequency": 100,
                      "processors": [
                          {"type": "latent_save", "data": ["input_latents", "predicted_latents"], "format": "pt"},
                          {"type": "vae_decode", "data": ["input_latents", "predicted_latents"], "frames": [0, -1],
                           "format": "png"}]}}]}


def flat_style() -> dict:
    """Flat style (docs/formats.md, "Element keys"): per element vae_repeat / position /
    clip_process, per dataset clip_resolution / vae_combine."""
    raw = copy.deepcopy(NESTED)
    ds = raw["datasets"][0]
    del ds["processors"]
    ds.update(clip_resolution=[384, 384], vae_combine="after")
    ds["elements"] = [
        {"name": "main_subject", "suffixes": ["_person.png"], "required": True, "vae_repeat": 1, "position": 0,
         "clip_process": "center_crop"},
        {"name": "secondary", "suffixes": ["_object.png"], "required": False, "vae_repeat": 4, "position": 1,
         "clip": False},
        {"name": "environment", "suffixes": ["_background.png"], "required": False, "vae_repeat": 4, "position": 2,
         "clip_process": "letterbox"}]
    return raw


def write(tmp_path, raw: dict, data_root) -> str:
    raw = copy.deepcopy(raw)
    for ds in raw["datasets"]:
        ds["data_root"] = str(data_root)
    path = tmp_path / "dataset_config.json"
    path.write_text(json.dumps(raw))
    return str(path)


def test_nested_json_maps_onto_the_yaml_schema(tmp_path, demo_data, capsys):
    cfg = load_config(write(tmp_path, NESTED, demo_data))
    notes = capsys.readouterr().out
    assert "target_resolution -> data.resolution" in notes and "model, lora, flow, train and deepspeed" in notes
    assert cfg.data.datasets[0].data_root == str(demo_data) and cfg.data.resolution == [480, 832]
    assert cfg.data.auto_frame_buckets and cfg.data.remove_common_llm_caption_prefixes
    assert [(e.name, e.vae.repeat, e.vae.position, e.clip.preprocess, e.required) for e in cfg.data.elements] == [
        ("main_subject", 4, 0, "center_crop", True), ("secondary", 4, 1, "pad_white", False),
        ("environment", 4, 2, "letterbox", False)]
    assert cfg.data.elements[0].suffixes == ["_dog.png", "_person.png", "_mask.png"]
    pv, pc = cfg.processors.vae, cfg.processors.clip
    assert (pv.combine, pv.default_preprocess, pv.frame_conditioning, pv.frame_index, pv.concatenate_mask) == \
        ("before", "resize", "full", 0, True)
    assert (pc.resolution, pc.default_preprocess) == ([512, 512], "center_crop")
    assert cfg.visualization.enabled and [p.type for p in cfg.visualization.processors] == ["latent_save", "vae_decode"]
    # what the JSON does not hold comes from the A2 recipe
    assert cfg.model.pretrained == "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers" and cfg.train.lr == 1e-5


def test_flat_json_maps_onto_the_yaml_schema(tmp_path, demo_data, capsys):
    cfg = load_config(write(tmp_path, flat_style(), demo_data))
    assert "vae_repeat -> data.elements[].vae.repeat" in capsys.readouterr().out
    assert [(e.name, e.vae.repeat, e.vae.position) for e in cfg.data.elements] == [
        ("main_subject", 1, 0), ("secondary", 4, 1), ("environment", 4, 2)]
    assert cfg.data.elements[0].clip.preprocess == "center_crop" and cfg.data.elements[1].clip is None
    assert [e.name for e in cfg.clip_elements] == ["main_subject", "environment"]
    assert cfg.processors.clip.resolution == [384, 384] and cfg.processors.vae.combine == "after"


def test_seed_json_unknown_keys_fail_with_the_path(tmp_path, demo_data):
    raw = copy.deepcopy(NESTED)
    raw["datasets"][0]["target_resolutoin"] = raw["datasets"][0].pop("target_resolution")
    with pytest.raises(ConfigError, match=r"unknown key '.*datasets\[0\].target_resolutoin'; did you mean "
                                          r"'target_resolution'"):
        load_config(write(tmp_path, raw, demo_data))
    raw = flat_style()
    raw["datasets"][0]["elements"][0]["vae_repaet"] = 1
    with pytest.raises(ConfigError, match=r"unknown key 'data.elements\[0\].vae_repaet'"):
        load_config(write(tmp_path, raw, demo_data))
    raw = copy.deepcopy(NESTED)
    raw["datasets"][0]["processors"]["vae"]["combin"] = "after"
    with pytest.raises(ConfigError, match=r"unknown key 'processors.vae.combin'; did you mean 'combine'"):
        load_config(write(tmp_path, raw, demo_data))


def section_1_verbatim() -> dict:
    """The nested seed example of docs/formats.md exactly as users have it: 854 wide."""
    raw = copy.deepcopy(NESTED)
    raw["datasets"][0]["target_resolution"] = [480, 854]
    raw["datasets"][0]["processors"]["vae"]["resolution"] = [480, 854]
    return raw


def test_seed_json_width_854_rounds_to_848_with_a_note(tmp_path, demo_data, capsys):
    cfg = load_config(write(tmp_path, section_1_verbatim(), demo_data))
    assert cfg.data.resolution == [480, 848] and cfg.data.resolution_policy == "error"
    assert "target_resolution [480, 854] -> data.resolution [480, 848] (854 -> 848: " in capsys.readouterr().out
    with pytest.raises(ConfigError, match=r"width 854 is not a multiple of 16.*848 and 864"):
        load_config("configs/e2v.yaml", ["data.resolution=[480,854]"], check_paths=False)  # our YAML: no guessing


def no_vis_formats() -> dict:
    """Section 1 with visualization processors that name no format (the default follows the type)."""
    raw = section_1_verbatim()
    for proc in raw["datasets"][0]["visualization"]["processors"]:
        del proc["format"]
    return raw


@pytest.mark.parametrize("example", [section_1_verbatim, no_vis_formats, flat_style])
def test_seed_examples_dry_run_verbatim(tmp_path, demo_data, capsys, monkeypatch, example):
    """`train_e2v.py --config seed.json --dry_run` with only data_root changed."""
    import train_e2v

    monkeypatch.setattr(sys, "argv", ["train_e2v.py", "--config", write(tmp_path, example(), demo_data), "--dry_run"])
    train_e2v.main()
    out = capsys.readouterr().out
    assert "8 usable samples" in out
    if example is not flat_style:
        assert "854 -> 848" in out
    cfg = load_config(write(tmp_path, example(), demo_data))
    assert [(p.type, p.format) for p in cfg.visualization.processors] == [("latent_save", "pt"), ("vae_decode", "png")]


SECTION_3 = ("--model_name Wan-AI/Wan2.1-T2V-1.3B-Diffusers --training_type e2v-lora --output_dir ./output/x "
             "--dataset_configs ./config.json --e2v_type dual --frame_conditioning_type full "
             "--frame_conditioning_index 0 --frame_conditioning_concatenate_mask --mixed_precision bf16 "
             "--rank 64 --lora_alpha 64").split()


def test_old_flags_map_to_set_overrides():
    config, sets, notes = map_seed_flags(SECTION_3 + ["--target_modules", "blocks.*(to_q|to_k|to_v|to_out.0)"])
    assert config == "./config.json"
    assert sets == ["model.pretrained=Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "model.base=t2v", "model.training_type=lora",
                    "output_dir=./output/x", "e2v_type=dual", "processors.vae.frame_conditioning=full",
                    "processors.vae.frame_index=0", "processors.vae.concatenate_mask=true",
                    "train.mixed_precision=bf16", "lora.rank=64", "lora.alpha=64",
                    "lora.target_modules=[blocks.*(to_q|to_k|to_v|to_out.0)]"]
    assert "--rank 64 -> --set lora.rank=64" in notes
    cfg = load_config("configs/e2v.yaml", sets, check_paths=False)
    assert cfg.lora.target_modules == ["blocks.*(to_q|to_k|to_v|to_out.0)"] and cfg.lora.rank == 64
    with pytest.raises(ConfigError, match=r"unknown flag --learning_rat \(did you mean --learning_rate\?\)"):
        map_seed_flags(["--learning_rat", "1e-4"])
    with pytest.raises(ConfigError, match=r"--mixed_precision fp16: no equivalent; use one of bf16, no, fp32"):
        map_seed_flags(["--mixed_precision", "fp16"])
    _, sets, _ = map_seed_flags(["--lr_scheduler", "constant_with_warmup", "--weight_decay", "0.01",
                                 "--caption_dropout_p", "0.3", "--dataloader_num_workers", "4",
                                 "--flow_weighting_scheme", "logit_normal"])
    assert sets == ["train.lr_scheduler=constant", "train.weight_decay=0.01", "conditioning.caption_dropout=0.3",
                    "data.num_workers=4", "flow.sigma_sampling=logit_normal"]
    cfg = load_config("configs/e2v.yaml", sets, check_paths=False)
    assert (cfg.train.weight_decay, cfg.conditioning.caption_dropout, cfg.flow.sigma_sampling) == (0.01, 0.3,
                                                                                                 "logit_normal")
    assert map_seed_flags(["--flow_weighting_scheme", "sigma_sqrt"])[1] == ["flow.weighting=sigma_sqrt"]


def test_old_command_line_runs_the_entry_point(tmp_path, demo_data, capsys, monkeypatch):
    """`train_e2v.py <the seed's old flags> --dry_run` with the nested-style JSON: notes printed,
    the T2V 1.3B base planned expanded on the meta device (nothing downloaded)."""
    import train_e2v

    argv = list(SECTION_3)
    argv[argv.index("--dataset_configs") + 1] = write(tmp_path, NESTED, demo_data)
    monkeypatch.setattr(sys, "argv", ["train_e2v.py", *argv, "--dry_run"])
    train_e2v.main()
    out = capsys.readouterr().out
    assert "--frame_conditioning_concatenate_mask -> --set processors.vae.concatenate_mask=true" in out
    assert "8 usable samples" in out
    assert "30 layers x 12 heads x 128, in_channels 36, image attention yes (expanded from a T2V base)" in out
    monkeypatch.setattr(sys, "argv", ["train_e2v.py", *argv, "--use_8bit_adam"])
    with pytest.raises(SystemExit):
        train_e2v.parse_args()
    assert "unknown flag --use_8bit_adam" in capsys.readouterr().err
