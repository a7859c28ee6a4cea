"""tools/sample.py uses every reference it is given or refuses it, in one line and before any
weight loads: an element given twice, a name the run did not train (with how to train one more:
data.elements, conditioning.sequence.slots), a reference the loader cannot fit, and
`--image-guidance` where guidance 1 leaves it nothing to act on. And bench/seed_fidelity.py on a
run stopped before its last step names the export command instead of a FileNotFoundError."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import ROOT
from helpers_r2v import R2V_TINY
from PIL import Image


@pytest.fixture
def refs(tmp_path):
    out = {}
    for name, size in (("person", (40, 56)), ("object", (48, 48)), ("strip", (1000, 2))):
        out[name] = tmp_path / f"{name}.png"
        Image.fromarray(np.full((size[1], size[0], 3), 90, np.uint8)).save(out[name])
    return out


def _refusal(tmp_path, *argv, config=R2V_TINY) -> str:
    import e2v.eval.sample_cli as sample
    import e2v.models.load as load  # sample_cli imports load_parts from here once the command line is good

    loaded = []
    real, load.load_parts = load.load_parts, lambda *a, **k: loaded.append(1)  # reached: the refusal came late
    try:
        with pytest.raises(SystemExit) as e:
            sample.main(["--config", str(config), "--prompt", "x", "--out", str(tmp_path / "v.mp4"), *argv])
    finally:
        load.load_parts = real
    assert not loaded and "\n" not in str(e.value)
    return str(e.value)


def test_an_element_given_twice_is_refused_by_name(tmp_path, refs):
    said = _refusal(tmp_path, "--element", f"person={refs['person']}", "--element", f"person={refs['object']}")
    assert said.startswith(f"--element person given twice ({refs['person']}, {refs['object']})")
    assert "several images for one element are not supported" in said and "data.elements" in said


def test_a_name_beyond_the_runs_elements_says_how_to_get_a_slot(tmp_path, refs):
    said = _refusal(tmp_path, "--element", f"person={refs['person']}", "--element", f"hat={refs['object']}")
    assert said.startswith("--element hat: not an element of")
    assert "3 element(s) (person, object, background)" in said
    assert "add it to data.elements and train with it" in said and "conditioning.sequence.slots (now 4" in said
    said = _refusal(tmp_path, "--element", f"hat={refs['object']}", config=ROOT / "configs/e2v_tiny_lora.yaml")
    assert "add it to data.elements and train with it" in said and "slots" not in said  # A2's layout: no slots


def test_image_guidance_without_text_guidance_above_1_is_an_error(tmp_path, refs):
    said = _refusal(tmp_path, "--element", f"person={refs['person']}", "--image-guidance", "3")
    assert said.startswith("--image-guidance 3 cannot act at text guidance 1")  # r2v_tiny validates at guidance 1
    assert "--guidance G > 1" in said
    said = _refusal(tmp_path, "--element", f"person={refs['person']}", "--image-guidance", "3", "--guidance", "1")
    assert said.startswith("--image-guidance 3 cannot act at text guidance 1")


def test_a_config_whose_image_guidance_cannot_act_is_refused():
    from e2v.config.load import load_config
    from e2v.config.schema import ConfigError

    sets = ["validation.guidance_scale=1", "validation.image_guidance_scale=3"]
    with pytest.raises(ConfigError, match=r"validation.image_guidance_scale 3 cannot act at validation.guidance_scale 1"):
        load_config(R2V_TINY, sets, check_paths=False)
    assert load_config(R2V_TINY, ["validation.guidance_scale=2", sets[1]], check_paths=False).validation.image_guidance_scale == 3


def test_a_reference_the_loader_cannot_fit_is_refused_naming_the_file(tmp_path, refs):
    said = _refusal(tmp_path, "--element", f"person={refs['strip']}")
    assert said.startswith(f"--element person={refs['strip']}: 1000x2 fitted inside the 64x64 video")


def test_seed_fidelity_on_a_stopped_run_names_the_export(tmp_path):
    from bench import seed_fidelity

    run = tmp_path / "r2v_tiny-x"
    (run / "checkpoints/step_000151").mkdir(parents=True)
    (run / "config.yaml").write_text((ROOT / "configs/r2v_tiny.yaml").read_text())
    with pytest.raises(SystemExit) as e:
        seed_fidelity.main(["--run", str(run), "--seeds", "0"])
    assert str(e.value) == (f"{run}: no lora/ (the run stopped before its last step, or is not a run folder); export "
                            f"its last checkpoint first: python tools/export_lora.py {run}/checkpoints/latest --out "
                            f"{run}/lora")
