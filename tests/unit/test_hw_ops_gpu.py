"""`make gpu-check` in one go on a fresh GPU machine, without a GPU: the verdict (a skipped section
or check is INCOMPLETE, never PASSED), the packages checked by importing them and installed from a
wheel folder only (pip --no-index) or not at all, the Makefile target that uses the interpreter it
is given and installs nothing itself, the documented wheel list, the SDPA backend named by the op
torch dispatched to (cuDNN's kernels carry "flash" in their names), and the step section's
loss-falls rule."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
from helpers import ROOT


def test_the_verdict_is_incomplete_when_anything_was_skipped():
    from bench.gpu_check import EXIT, verdict

    ok = {"passed": True}
    assert verdict({"a": ok, "b": ok}) == "PASSED"
    assert verdict({"a": ok, "b": {"skipped": "needs ~40 s, 3 s left"}}) == "INCOMPLETE"
    assert verdict({"a": ok, "b": {**ok, "skipped_checks": ["the peak drop (no CUDA)"]}}) == "INCOMPLETE"
    assert verdict({"a": {"passed": False}, "b": {"skipped": "x"}}) == "FAILED"
    assert EXIT == {"PASSED": 0, "FAILED": 1, "INCOMPLETE": 3}


def test_a_package_that_does_not_import_fails_the_environment_and_skips_the_rest(tmp_path, monkeypatch, capsys):
    """--no-install: nothing is installed; the import error is reported, every other section is
    skipped for it, and the verdict is FAILED."""
    import bench.gpu_check as gc
    from bench.gpulib import packages

    monkeypatch.setattr(packages, "import_problems", lambda: {"decord": "ModuleNotFoundError: No module named 'decord'"})
    monkeypatch.setattr(packages, "install", lambda *a, **k: pytest.fail("--no-install installs nothing"))
    rc = gc.main(["--allow-cpu", "--no-install", "--only", "environment,attention", "--out", str(tmp_path / "out"),
                  "--work", str(tmp_path / "work")])
    final = json.loads((tmp_path / "out/results/gpu.json").read_text())
    assert rc == 1 and final["verdict"] == "FAILED"
    env = final["sections"]["environment"]
    assert not env["passed"] and env["import_problems"] == {"decord": "ModuleNotFoundError: No module named 'decord'"}
    assert final["sections"]["attention"] == {"skipped": "packages do not import (environment)"}
    md = (tmp_path / "out/RESULTS_GPU.md").read_text()
    assert "**cannot import decord**" in md and "WHEELS=" in md


def test_install_takes_the_wheel_folder_alone(tmp_path, monkeypatch):
    """With a folder: pip --no-index --find-links FOLDER -r FOLDER/LIST.txt, then the imports are
    checked again in a fresh process; nothing runs pip when everything imports."""
    from bench.gpulib import packages

    calls = []
    monkeypatch.setattr(packages.subprocess, "run",
                        lambda cmd, **kw: calls.append(cmd) or subprocess.CompletedProcess(cmd, 0, "", ""))
    checks = iter([{}])
    monkeypatch.setattr(packages, "check_in", lambda python: next(checks))
    (tmp_path / "LIST.txt").write_text("hjson==3.1.0\n")
    out = packages.install("/machine/python", tmp_path, False, {"deepspeed": "ModuleNotFoundError"})
    assert calls == [["/machine/python", "-m", "pip", "install", "-q", "--no-index", "--find-links", str(tmp_path),
                      "-r", str(tmp_path / "LIST.txt")]]
    assert out == {"installed_from": str(tmp_path), "problems": {}, "pip": None}
    calls.clear()
    assert packages.install("/machine/python", tmp_path, False, {})["installed_from"] is None and calls == []
    assert packages.install("/machine/python", tmp_path, True, {"x": "y"})["problems"] == {"x": "y"} and calls == []
    missing = packages.install("/machine/python", tmp_path / "nope", False, {"x": "y"})
    assert "is not a folder" in missing["pip"] and calls == []


def test_the_import_check_covers_what_the_checks_code_imports():
    """Every third-party module the check's code imports (e2v outside data preparation, train_e2v.py,
    the tools the sections launch) is in NEEDS: an independent scan of the sources."""
    import ast
    import sys

    from bench.gpulib.packages import NEEDS, e2v_modules

    files = [ROOT / (m.replace(".", "/") + ".py") for m in e2v_modules()]
    files = [f if f.exists() else f.with_suffix("") / "__init__.py" for f in files]
    files += [ROOT / "train_e2v.py", ROOT / "bench/gpu_check.py", ROOT / "bench/bench.py"]
    files += [ROOT / f"tools/{n}.py" for n in ("precompute", "sample", "make_demo_dataset", "estimate_memory")]
    files += [p for d in ("gpulib", "smokelib", "benchlib") for p in (ROOT / "bench" / d).glob("*.py")]
    imported = set()
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                imported.add(node.module.split(".")[0])
    # helpers_t2v: tests/ (smokelib's test-only path); _installed: tools/_installed.py (a command started as a file)
    local = {"e2v", "tools", "bench", "helpers_t2v", "_installed"}
    third_party = {m for m in imported if m not in sys.stdlib_module_names and m not in local}
    # pycocotools: OpenS2V RLE masks only; wandb: imported only by a run whose train.log_to names it (the check's don't)
    assert third_party - {"pycocotools", "wandb"} <= set(NEEDS), third_party - set(NEEDS)


def test_the_makefile_target_uses_the_given_interpreter_and_installs_nothing_itself():
    def dry(*args, env=None):
        import os

        p = subprocess.run(["make", "-n", "-s", *args], cwd=ROOT, capture_output=True, text=True,
                           env={**{k: v for k, v in os.environ.items() if k != "PYTHON"}, **(env or {})})
        assert p.returncode == 0, p.stderr
        return p.stdout.split()

    assert dry("gpu-check", "PYTHON=/opt/conda/bin/python", "WHEELS=wheels") == \
        ["/opt/conda/bin/python", "bench/gpu_check.py", "--wheels", "wheels"]
    assert dry("gpu-check", "NO_INSTALL=1", env={"PYTHON": "/usr/bin/python3.12"}) == \
        ["/usr/bin/python3.12", "bench/gpu_check.py", "--no-install"]
    default = dry("gpu-check", "VENV=/nonexistent-venv")  # no venv: the machine's python3
    assert default == ["python3", "bench/gpu_check.py"]
    assert dry("gpu-wheels", "WHEELS=w")[-6:] == ["--out", "w", "--python-version", "3.12", "--torch", "2.8.0"]


def test_the_documented_wheel_list_is_complete():
    """docs/gpu.md's list: every carried need, the dependencies a first list missed (deepspeed's and
    peft's), none of what the machine has."""
    from bench.gpulib.packages import MACHINE_HAS, NEEDS, _canonical

    text = (ROOT / "docs/gpu.md").read_text()
    block = text[text.index("<!-- wheel list -->"):text.index("<!-- /wheel list -->")]
    listed = {_canonical(m.group(1)) for m in re.finditer(r"^\s*([A-Za-z0-9_.-]+)==\S+$", block, re.M)}
    assert {_canonical(d) for d in NEEDS.values() if d not in MACHINE_HAS} <= listed
    assert {"hjson", "msgpack", "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "einops",
            "py-cpuinfo", "ninja", "importlib-metadata", "accelerate"} <= listed
    assert not {_canonical(n) for n in MACHINE_HAS} & listed
    assert not {n for n in listed if n.startswith("nvidia-") or n == "triton"}, "torch's own stay on the machine"


def test_the_sdpa_backend_is_named_by_the_op_that_ran():
    from bench.gpulib.sections import sdpa_backends

    cudnn = ["aten::scaled_dot_product_attention", "aten::_scaled_dot_product_cudnn_attention",
             "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1"]
    assert sdpa_backends(cudnn) == ["cuDNN"]  # its kernel's name says flash; the op says cuDNN
    assert sdpa_backends(["aten::_scaled_dot_product_flash_attention", "flash_fwd_kernel"]) == ["flash"]
    assert sdpa_backends(["aten::_scaled_dot_product_efficient_attention", "fmha_cutlassF"]) == ["efficient"]
    assert sdpa_backends(["aten::_scaled_dot_product_attention_math", "aten::bmm"]) == ["math"]
    assert sdpa_backends(["aten::mm"]) == []


def test_the_loss_must_fall_and_stay_finite():
    from bench.gpulib.sections import STEP_TRAINING, loss_falls

    assert loss_falls([1.76, 1.2, 0.9])["passed"]
    assert not loss_falls([1.76, 9.37, 5.51, 1.9])["passed"]  # the H200 run without warmup: up, not down
    assert not loss_falls([1.0, float("nan"), 0.5])["passed"] and not loss_falls([1.0])["passed"]
    assert "train.warmup_steps=4" in STEP_TRAINING and any(s.startswith("flow.denoising_step_list=") for s in STEP_TRAINING)
