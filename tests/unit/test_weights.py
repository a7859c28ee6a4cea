"""A missing model stops in one line (e2v/models/weights.py): offline and not downloaded names
each repo, where it was looked for and the download command; a local folder that does not exist
is named; the tiny presets need nothing."""

from __future__ import annotations

from helpers import ROOT, train_main


def _cfg(*sets):
    from e2v.config.load import load_config

    return load_config(ROOT / "configs/e2v_t2v_1.3b.yaml", list(sets), check_paths=False)


def test_offline_and_not_downloaded_names_both_repos_and_the_commands(tmp_path, monkeypatch):
    from e2v.config.bases import resolve_pretrained
    from e2v.models.weights import missing_weights

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    resolve_pretrained.cache_clear()
    error, notes = missing_weights(_cfg())
    assert notes == [] and "\n" not in error
    assert ("model.pretrained: Wan-AI/Wan2.1-T2V-1.3B-Diffusers is not downloaded (looked in "
            f"{tmp_path / 'hub/models--Wan-AI--Wan2.1-T2V-1.3B-Diffusers'}) and HF_HUB_OFFLINE is set") in error
    assert "hf download Wan-AI/Wan2.1-T2V-1.3B-Diffusers --local-dir models/Wan2.1-T2V-1.3B-Diffusers" in error
    # the T2V base takes only the CLIP folders of the I2V repo (tests/unit/test_firstday_weights.py parses it with hf's CLI)
    assert ('hf download Wan-AI/Wan2.1-I2V-14B-480P-Diffusers --include "image_encoder/*" '
            '--include "image_processor/*" --local-dir models/Wan2.1-I2V-14B-480P-Diffusers') in error
    error, _ = missing_weights(_cfg(f"model.pretrained={tmp_path / 'nowhere'}", f"model.image_encoder={tmp_path}"))
    assert error.startswith(f"model.pretrained: folder {tmp_path / 'nowhere'} does not exist")
    assert missing_weights(_cfg("model.preset=tiny", "model.pretrained=null", "model.image_encoder=null")) == (None, [])
    resolve_pretrained.cache_clear()


def test_train_stops_in_one_line_without_a_traceback(demo_data, tmp_path, monkeypatch, capsys):
    """`python train_e2v.py --config configs/e2v.yaml` offline with an empty hub cache: a SystemExit
    whose message is the one line the interpreter prints (no traceback), before any process group."""
    from e2v.config.bases import resolve_pretrained

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    resolve_pretrained.cache_clear()
    code = train_main("--config", str(ROOT / "configs/e2v.yaml"), "--set", f"data.datasets.0.data_root={demo_data}")
    assert isinstance(code, str) and "\n" not in code, code
    assert code.startswith("weights: model.pretrained: Wan-AI/Wan2.1-I2V-14B-480P-Diffusers is not downloaded"), code
