"""The weight downloads the docs and the offline message name are commands the installed
huggingface_hub runs: each is parsed (never run: no network) by `hf`'s own command-line parser,
and must name a known repo, no stray file name, and one `--include` per pattern."""

from __future__ import annotations

import re
import shlex
from importlib.metadata import distribution

import pytest
from helpers import ROOT

CLIP_PATTERNS = {"image_encoder/*", "image_processor/*"}


def parse_hf(command: str) -> dict:
    """`hf ...` -> the parameters hf's click command receives (its parser, not ours; nothing runs)."""
    import click
    from huggingface_hub.cli.hf import app

    argv = shlex.split(command)
    assert argv[0] == "hf", command
    name, cmd, rest = app.resolve_command(click.Context(app, info_name="hf"), argv[1:])
    cmd = cmd.materialize() if hasattr(cmd, "materialize") else cmd  # hf imports a command when chosen
    return cmd.make_context(name, rest).params


def documented_commands() -> list[str]:
    """Every `hf ...` command in README.md and docs/*.md: indented code lines (with their `\\`
    continuations) and inline code."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        found += [m.group(1) for m in re.finditer(r"`(hf [^`]+)`", text)]
        joined = re.sub(r"\\\n\s*", "", text)
        found += [line.strip() for line in joined.splitlines() if line.startswith("    hf ")]
    return found


def check(command: str, repos: set[str]) -> dict:
    params = parse_hf(command)
    assert params["repo_id"] in repos | {"REPO"}, command
    assert params["filenames"] == (), f"{command}: hf reads {params['filenames']} as file names"
    assert set(params["include"]) <= CLIP_PATTERNS and len(params["include"]) in (0, 2), command
    assert params["local_dir"], command
    return params


def test_hf_is_what_the_installed_hub_ships():
    scripts = {e.name for e in distribution("huggingface_hub").entry_points if e.group == "console_scripts"}
    assert "hf" in scripts and "huggingface-cli" not in scripts
    for path in [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "e2v").rglob("*.py"),
                 *(ROOT / "tools").rglob("*.py")]:
        assert "huggingface-cli download" not in path.read_text(), path  # named once, as what is gone


def test_the_old_two_pattern_form_is_a_file_name_to_hf():
    """Why one flag per pattern: the second pattern after one --include is a positional file name."""
    params = parse_hf('hf download Wan-AI/Wan2.1-I2V-14B-480P-Diffusers --include "image_encoder/*" '
                      '"image_processor/*" --local-dir models/x')
    assert params["include"] == ("image_encoder/*",) and params["filenames"] == ("image_processor/*",)


def test_documented_download_commands_parse():
    from e2v.models.weights import REPOS

    commands = documented_commands()
    assert len(commands) >= 5, commands  # README's table, docs/weights.md's blocks and its offline example
    parsed = [check(c, set(REPOS)) for c in commands]
    assert any(set(p["include"]) == CLIP_PATTERNS for p in parsed)  # the T2V config's CLIP folders


def test_offline_message_commands_parse(tmp_path, monkeypatch):
    from e2v.config.bases import resolve_pretrained
    from e2v.config.load import load_config
    from e2v.models.weights import REPOS, download_command, missing_weights

    for repo in REPOS:
        assert parse_hf(download_command(repo))["include"] == ()
        assert set(check(download_command(repo, "model.image_encoder"), set(REPOS))["include"]) == CLIP_PATTERNS
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    resolve_pretrained.cache_clear()
    try:
        error, _ = missing_weights(load_config(ROOT / "configs/e2v_t2v_1.3b.yaml", [], check_paths=False))
        in_message = re.findall(r"run `(hf [^`]+)`", error)
        assert len(in_message) == 2  # model.pretrained and model.image_encoder
        for c in in_message:
            check(c, set(REPOS))
        error, _ = missing_weights(load_config(ROOT / "configs/e2v_t2v_1.3b.yaml", [
            f"model.pretrained={tmp_path / 'nowhere'}", "model.image_encoder=null"], check_paths=False))
        params = parse_hf(re.search(r"(hf download \S+ --local-dir \S+)", error).group(1))
        assert params["local_dir"] == str(tmp_path / "nowhere")
    finally:
        resolve_pretrained.cache_clear()


@pytest.mark.parametrize("command", ["hf download Wan-AI/x --local-dirr models/x", "hf download Wan-AI/x --include"])
def test_parser_refuses_broken_commands(command):
    import click

    with pytest.raises(click.UsageError):
        parse_hf(command)
