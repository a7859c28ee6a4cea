import pytest

from e2v.config.load import load_config
from e2v.config.schema import ConfigError

BASE = {
    "model": {"preset": "tiny"},
    "data": {"datasets": [{"data_root": "."}], "num_frames": 17, "resolution": [64, 64],
             "elements": [{"name": "person", "suffixes": ["_person.png"]}]},
}


def cfg(**over):
    import copy

    raw = copy.deepcopy(BASE)
    for path, value in over.items():
        node = raw
        keys = path.split("__")
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
    return raw


def test_defaults_load():
    c = load_config(raw=cfg())
    assert c.data.num_frames == 17 and c.data.resolution == [64, 64]
    assert c.vae_elements[0].name == "person"


def test_unknown_key_names_path_and_nearest():
    with pytest.raises(ConfigError, match=r"unknown key 'train.learning_rat'; did you mean 'lr'\?"):
        load_config(raw=cfg(train__learning_rat=1e-4))
    with pytest.raises(ConfigError, match=r"unknown key 'train.max_step'; did you mean 'max_steps'"):
        load_config(raw=cfg(train__max_step=10))


def test_bad_frames_names_valid_counts():
    with pytest.raises(ConfigError, match=r"data.num_frames=16.*4k\+1.*use 13 or 17"):
        load_config(raw=cfg(data__num_frames=16))


def test_resolution_not_multiple_of_16():
    with pytest.raises(ConfigError, match=r"width 854 is not a multiple of 16.*848 and 864"):
        load_config(raw=cfg(data__resolution=[480, 854]))
    c = load_config(raw=cfg(data__resolution=[480, 854], data__resolution_policy="round"))
    assert c.data.resolution == [480, 848]


def test_wrong_type_and_literal():
    with pytest.raises(ConfigError, match=r"train.max_steps: expected an integer"):
        load_config(raw=cfg(train__max_steps="many"))
    with pytest.raises(ConfigError, match=r"processors.vae.combine: 'befor' is not one of.*did you mean 'before'"):
        load_config(raw=cfg(processors__vae={"combine": "befor"}))


def test_missing_data_root():
    with pytest.raises(ConfigError, match=r"data.datasets\[0\].data_root: /nonexistent/x does not exist"):
        load_config(raw=cfg(data__datasets=[{"data_root": "/nonexistent/x"}]))
    with pytest.raises(ConfigError, match=r"data.datasets\[0\].data_root is missing"):
        load_config(raw=cfg(data__datasets=[{"dataset_type": "e2v"}]))


def test_set_overrides_are_type_checked():
    c = load_config(raw=cfg(), overrides=["train.lr=5e-5", "data.num_frames=33", "train.trainable=[patch_embedding]"])
    assert c.train.lr == 5e-5 and c.data.num_frames == 33 and c.train.trainable == ["patch_embedding"]
    with pytest.raises(ConfigError, match="train.micro_batch_size: expected an integer"):
        load_config(raw=cfg(), overrides=["train.micro_batch_size=two"])
    with pytest.raises(ConfigError, match="unknown key 'train.lrr'"):
        load_config(raw=cfg(), overrides=["train.lrr=1"])


def test_yaml_boolean_spellings_reach_string_choices():
    # YAML 1.1 reads a bare `no` as False; `mixed_precision: no` must still mean "no".
    c = load_config(raw=cfg(), overrides=["train.mixed_precision=no"])
    assert c.train.mixed_precision == "no"
    with pytest.raises(ConfigError, match="train.mixed_precision: True is not one of 'bf16', 'no'"):
        load_config(raw=cfg(), overrides=["train.mixed_precision=yes"])


def test_clip_false_removes_element_from_clip_stream():
    raw = cfg()
    raw["data"]["elements"].append({"name": "bg", "suffixes": ["_bg.png"], "clip": False,
                                    "vae": {"repeat": 4, "position": 1}})
    c = load_config(raw=raw)
    assert [e.name for e in c.clip_elements] == ["person"]
    assert [e.name for e in c.vae_elements] == ["person", "bg"]


def test_resolved_config_round_trips(tmp_path):
    from e2v.config.load import save_config

    c = load_config(raw=cfg(train__lr=3e-4))
    save_config(c, tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert again == c


def test_shipped_tiny_config_loads():
    c = load_config("configs/e2v_tiny.yaml", check_paths=False)
    assert c.model.preset == "tiny" and [e.vae.repeat for e in c.vae_elements] == [1, 4, 4]


@pytest.mark.parametrize("over, message", [
    ({"train__lr": float("nan")}, r"train.lr=nan must be a positive number"),
    ({"train__checkpoint_every": -1}, r"train.checkpoint_every=-1 must be >= 0"),
    ({"train__log_every": 0}, r"train.log_every=0 must be >= 1"),
    ({"processors__vae": {"frame_conditioning": "index", "frame_index": 1}},
     r"processors.vae.frame_index=1: .*use 0..0"),
    ({"processors__vae": {"frame_conditioning": "index", "frame_index": -1}}, r"frame_index=-1"),
    ({"processors__clip": {"resolution": [512]}}, r"processors.clip.resolution: expected \[height, width\]"),
    ({"e2v_type": "clip", "conditioning": {"target_layout": "prepend"}},
     r"target_layout: prepend .* e2v_type=clip has no VAE condition"),
])
def test_impossible_values_fail_at_load_naming_the_key(over, message):
    """Values that used to pass and then fail mid-run (ZeroDivisionError at the first log step,
    IndexError in the first batch) or silently do nothing (prepend without a VAE stream)."""
    with pytest.raises(ConfigError, match=message):
        load_config(raw=cfg(**over))


def test_set_into_a_list_needs_an_index():
    raw = cfg()
    with pytest.raises(ConfigError, match=r"--set data.datasets.x.data_root: 'data.datasets' is a list of 1; "
                                          r"use an index 0..0 after it, e.g. data.datasets.0.data_root"):
        load_config(raw=raw, overrides=["data.datasets.x.data_root=y"])
    with pytest.raises(ConfigError, match=r"is a list of 1"):
        load_config(raw=raw, overrides=["data.datasets.3.data_root=y"])
    assert load_config(raw=raw, overrides=["data.datasets.0.repeat=2"]).data.datasets[0].repeat == 2


def test_preflight_rejects_model_mismatches_on_the_meta_device():
    """Checks that need the model's shape run before any weight loads (seconds, not a 14B load)."""
    from e2v.models.plan import preflight

    with pytest.raises(ValueError, match=r"train.trainable: no parameter name matches \['no_such_module'\]"):
        preflight(load_config(raw=cfg(train__trainable=["no_such_module"])))
    with pytest.raises(ValueError, match=r"e2v_type: none trains plain text-to-video.*36 input channels"):
        preflight(load_config(raw=cfg(e2v_type="none")))
    with pytest.raises(ValueError, match=r"set model.base: t2v to expand it"):
        preflight(load_config(raw=cfg(model={"pretrained": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"})))
    transformer, full = preflight(load_config(raw=cfg(train__trainable=["patch_embedding"])))
    assert full == ["patch_embedding.weight", "patch_embedding.bias"]
    assert transformer.patch_embedding.weight.is_meta


@pytest.mark.parametrize("key, value, home", [("lr", 1.0e-4, "train.lr"), ("num_frames", 17, "data.num_frames"),
                                              ("rank", 8, "lora.rank"), ("learning_rate", 1e-4, "train.lr"),
                                              ("max_steps", 10, "train.max_steps")])
def test_misplaced_top_level_key_names_where_it_belongs(tmp_path, key, value, home):
    """A stray top-level key in our YAML stops, naming where it belongs; it used to switch the file
    to the video-regression seed format and silently set e2v_type: none with data.elements still set."""
    import yaml

    path = tmp_path / "e2v.yaml"
    path.write_text(yaml.safe_dump({**cfg(), key: value}))
    with pytest.raises(ConfigError, match=rf"^{key}: not a top-level key; did you mean {home}\?"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"train.num_frames: not a key of train; did you mean data.num_frames\?"):
        load_config(raw=cfg(train__num_frames=17))


def test_bounds_are_declared_beside_the_field():
    """Every field with bounds (schema.bounded) is checked at load, in lists of sections too."""
    with pytest.raises(ConfigError, match=r"lora.rank=0 must be >= 1"):
        load_config(raw=cfg(lora={"rank": 0}))
    with pytest.raises(ConfigError, match=r"validation.sigmas: 1.0 must be within \(0, 1\)"):
        load_config(raw=cfg(validation={"sigmas": [0.5, 1.0]}))
    with pytest.raises(ConfigError, match=r"data.datasets\[0\].weight=0.0 must be a positive number \(remove the "
                                          r"dataset instead\)"):
        load_config(raw=cfg(data__datasets=[{"data_root": ".", "weight": 0}]))
    with pytest.raises(ConfigError, match=r"data.elements\[0\].vae.repeat=0 must be >= 1"):
        load_config(raw=cfg(data__elements=[{"name": "p", "suffixes": ["_p.png"], "vae": {"repeat": 0}}]))
    with pytest.raises(ConfigError, match=r"conditioning.caption_dropout=1.5 must be within \[0, 1\]"):
        load_config(raw=cfg(conditioning={"caption_dropout": 1.5}))


def test_validate_reads_and_never_changes_the_config():
    """Implied defaults (rounded resolution, time_division_factor's buckets, a processor's format)
    are filled in at load (config.normalise); validate only reads."""
    import copy

    from e2v.config.load import validate

    c = load_config(raw=cfg(data__resolution=[64, 72], data__resolution_policy="round", data__elements=[],
                            e2v_type="none", data__time_division_factor=4,
                            visualization={"processors": [{"type": "vae_decode"}]}))
    assert c.data.resolution == [64, 64] and c.data.auto_frame_buckets
    assert c.visualization.processors[0].format == "png"
    before = copy.deepcopy(c)
    validate(c)
    assert c == before


