"""What the GPU check needs installed, checked by importing it, and how it gets there on a machine
with no package registry.

A fresh GPU machine has a CUDA torch (with its own dependencies), transformers and peft
(MACHINE_HAS); everything else the check imports (NEEDS, versions from requirements.txt) comes from
a folder of wheels carried with the checkout:

    python bench/gpulib/packages.py wheels --out wheels --python-version 3.12 --torch 2.8.0   # with network
    make gpu-check WHEELS=wheels                                                              # on the GPU machine

`wheels` resolves the dependency closure of NEEDS for the target Python on manylinux x86_64 with
pip (metadata only) against a stand-in torch of the given version that requires nothing (the
machine's torch brings its own dependencies; nothing of torch is downloaded), drops MACHINE_HAS,
downloads the rest (deepspeed, which PyPI has only as a source archive, is built into a wheel
first: no op is compiled) and writes the list to `wheels/LIST.txt` (docs/gpu.md quotes it).
`venv-check` proves a folder complete: a clean venv, this interpreter's torch, transformers and peft
made visible in it (the machine's), `pip install --no-index --find-links`, then `check` in it.
`check` imports every module of NEEDS, the lazily imported objects the check reaches (DEEP), every
e2v module the check runs, and asks imageio-ffmpeg for its ffmpeg binary: imports, not metadata.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MACHINE_HAS = ("torch", "transformers", "peft")  # a GPU image's own: never carried, never reinstalled
# import name -> distribution; the version ranges are requirements.txt's
NEEDS = {"torch": "torch", "transformers": "transformers", "peft": "peft", "deepspeed": "deepspeed",
         "diffusers": "diffusers", "huggingface_hub": "huggingface-hub", "tokenizers": "tokenizers",
         "safetensors": "safetensors", "numpy": "numpy", "PIL": "pillow", "yaml": "pyyaml", "tqdm": "tqdm",
         "psutil": "psutil", "ftfy": "ftfy", "decord": "decord", "cv2": "opencv-python-headless",
         "imageio": "imageio", "imageio_ffmpeg": "imageio-ffmpeg", "bitsandbytes": "bitsandbytes"}
# what importing a package alone does not reach (diffusers and transformers import lazily): the
# objects the check's code paths use, as module:attribute
DEEP = ("diffusers:WanTransformer3DModel", "diffusers:AutoencoderKLWan", "diffusers:FlowMatchEulerDiscreteScheduler",
        "diffusers:WanImageToVideoPipeline", "diffusers.pipelines.wan.pipeline_wan:prompt_clean",
        "transformers:UMT5EncoderModel", "transformers:CLIPVisionModelWithProjection", "transformers:AutoTokenizer",
        "peft:LoraConfig", "peft:get_peft_model_state_dict", "deepspeed.runtime.engine:DeepSpeedEngine",
        "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3", "deepspeed.utils.zero_to_fp32:"
        "get_fp32_state_dict_from_zero_checkpoint", "imageio.v2:mimread")
# e2v modules the check does not run (data preparation: its own tools and extras)
NOT_RUN = ("e2v.data.prepare",)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux_2_12_x86_64", "manylinux2010_x86_64", "manylinux_2_5_x86_64",
             "manylinux1_x86_64")
STAND_IN = "present"  # the local version label of the stand-in torch: a version no index has


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_specs() -> dict[str, str]:
    """requirements.txt's lines by canonical distribution name."""
    out = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            out[_canonical(re.split(r"[<>=!~ ;\[]", line, 1)[0])] = line
    return out


def carried_specs() -> list[str]:
    """The requirement lines a wheel folder must satisfy: NEEDS less MACHINE_HAS."""
    specs = requirement_specs()
    return [specs[_canonical(d)] for d in NEEDS.values() if d not in MACHINE_HAS]


def resolved_specs() -> list[str]:
    """What the wheel list is the closure of: NEEDS but torch (MACHINE_HAS are resolved, so that
    their dependencies are listed, and dropped from the list after)."""
    specs = requirement_specs()
    return [specs[_canonical(d)] for d in NEEDS.values() if d != "torch"]


def install_args(wheels: Path | None) -> list[str]:
    """What pip installs: a folder's LIST.txt (every wheel of it, pinned: the dependencies of
    MACHINE_HAS too, which a machine's image can lack, e.g. peft's accelerate), else the carried
    requirement lines."""
    if wheels is not None and (Path(wheels) / "LIST.txt").is_file():
        return ["-r", str(Path(wheels) / "LIST.txt")]
    return carried_specs()


# --- the check ---------------------------------------------------------------------------------


def e2v_modules() -> list[str]:
    names = []
    for p in sorted((ROOT / "e2v").rglob("*.py")):
        name = ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        if not name.startswith(NOT_RUN):
            names.append(name)
    return names


def import_problems() -> dict[str, str]:
    """{what: why it cannot be imported} for NEEDS, DEEP and the e2v modules the check runs (empty:
    all import), and the ffmpeg binary imageio-ffmpeg carries. In this process."""
    sys.path.insert(0, str(ROOT))  # the GPU machine's interpreter has no install of e2v (docs/gpu.md)
    out = {}

    def attempt(what: str, fn) -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - any failure to import is the finding, named
            out[what] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"

    for module in NEEDS:
        attempt(module, lambda m=module: importlib.import_module(m))
    for item in DEEP:
        module, attr = item.split(":")
        attempt(item, lambda m=module, a=attr: getattr(importlib.import_module(m), a))
    if "imageio_ffmpeg" not in out:
        attempt("ffmpeg binary", lambda: Path(importlib.import_module("imageio_ffmpeg").get_ffmpeg_exe()).stat())
    for module in e2v_modules():
        attempt(module, lambda m=module: importlib.import_module(m))
    return out


def check_in(python: str | Path) -> dict[str, str]:
    """import_problems() as `python` sees it (a fresh process: nothing already imported counts)."""
    p = subprocess.run([str(python), str(Path(__file__).resolve()), "check", "--json"], capture_output=True,
                       text=True, cwd=ROOT, timeout=600)
    try:
        return json.loads(p.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"check": f"exit {p.returncode}: {(p.stderr or p.stdout).strip()[-300:]}"}


def install(python: str | Path, wheels: Path | None, no_install: bool, problems: dict | None = None) -> dict:
    """Make NEEDS importable by `python` before the check runs: nothing when everything imports
    (`problems`: what check_in found, checked here when not given) or `no_install`; else pip from the
    `wheels` folder only (--no-index), or from the index when no folder is given.
    -> {"installed_from", "problems" (after), "pip" (its tail on failure)}"""
    problems = check_in(python) if problems is None else problems
    if not problems or no_install:
        return {"installed_from": None, "problems": problems}
    if wheels is not None and not Path(wheels).is_dir():
        return {"installed_from": str(wheels), "problems": problems, "pip": f"{wheels} is not a folder"}
    where = ["--no-index", "--find-links", str(wheels)] if wheels is not None else []
    p = subprocess.run([str(python), "-m", "pip", "install", "-q", *where, *install_args(wheels)],
                       capture_output=True, text=True)
    return {"installed_from": str(wheels) if wheels is not None else "the package index",
            "problems": check_in(python), "pip": (p.stdout + p.stderr)[-1500:] if p.returncode else None}


# --- the wheel folder --------------------------------------------------------------------------


def _stand_in_torch(folder: Path, version: str) -> str:
    """A wheel named torch at `version`+present that requires nothing: what pip resolves against in
    place of the machine's torch, whose dependencies the machine has. Returns the version."""
    v = f"{version.split('+')[0]}+{STAND_IN}"
    info = f"torch-{v}.dist-info"
    with zipfile.ZipFile(folder / f"torch-{v}-py3-none-any.whl", "w") as z:
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: torch\nVersion: {v}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: e2v\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return v


def resolve(python_version: str, torch_version: str, local: Path) -> list[tuple[str, str]]:
    """(name, version) of every distribution NEEDS pulls in on the target, torch and what only it
    needs excluded, MACHINE_HAS themselves dropped (their dependencies kept). Reads package
    metadata; downloads no torch."""
    stand_in = Path(tempfile.mkdtemp(prefix="e2v-stand-in-"))
    v = _stand_in_torch(stand_in, torch_version)
    constraint = stand_in / "constraints.txt"
    constraint.write_text(f"torch=={v}\n")
    report = stand_in / "report.json"
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed", "--report", str(report),
           "--target", str(stand_in / "target"), "--only-binary=:all:", "--python-version", python_version,
           "--implementation", "cp", "--find-links", str(stand_in), "--find-links", str(local),
           "-c", str(constraint), *[a for p in PLATFORMS for a in ("--platform", p)], *resolved_specs()]
    env = {**os.environ, "PIP_CONSTRAINT": ""}  # a machine-wide constraint file must not cap the target's pins
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode:
        raise SystemExit(f"pip could not resolve the wheel list:\n{p.stderr[-3000:]}")
    found = [(i["metadata"]["name"], i["metadata"]["version"]) for i in json.loads(report.read_text())["install"]]
    shutil.rmtree(stand_in, ignore_errors=True)
    return sorted((n, ver) for n, ver in found if _canonical(n) not in map(_canonical, MACHINE_HAS))


def build_wheels(out: Path, python_version: str, torch_version: str, list_only: bool = False) -> list[tuple[str, str]]:
    """The folder: deepspeed built from its source archive (pure Python, no op compiled), then every
    other wheel of `resolve`'s list downloaded for the target; LIST.txt names them all. With
    `list_only`, the list alone (deepspeed's wheel is still built: pip resolves against it)."""
    out.mkdir(parents=True, exist_ok=True)
    specs = requirement_specs()
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out),
                            specs["deepspeed"]], capture_output=True, text=True, env={**os.environ, "DS_BUILD_OPS": "0"})
    if built.returncode:
        raise SystemExit(f"could not build the deepspeed wheel:\n{built.stderr[-2000:]}")
    wanted = resolve(python_version, torch_version, out)
    if list_only:
        return wanted
    rest = [f"{n}=={v}" for n, v in wanted if _canonical(n) != "deepspeed"]
    got = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                          "--python-version", python_version, "--implementation", "cp", "-d", str(out),
                          *[a for p in PLATFORMS for a in ("--platform", p)], *rest], capture_output=True, text=True)
    if got.returncode:
        raise SystemExit(f"could not download the wheels:\n{got.stderr[-2000:]}")
    (out / "LIST.txt").write_text("".join(f"{n}=={v}\n" for n, v in wanted))
    return wanted


# --- the clean-venv proof ----------------------------------------------------------------------


def _top_level(dist: md.Distribution) -> set[str]:
    """The site-packages entries a distribution installed (packages, modules, its dist-info)."""
    return {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}


def _closure(name: str) -> list[str]:
    """`name` and the installed distributions it requires, recursively (extras left out)."""
    seen, todo = [], [name]
    while todo:
        n = _canonical(todo.pop())
        if n in seen:
            continue
        try:
            dist = md.distribution(n)
        except md.PackageNotFoundError:
            continue
        seen.append(n)
        todo += [re.split(r"[<>=!~ ;\[(]", r, 1)[0] for r in dist.requires or [] if "extra ==" not in r]
    return seen


def venv_check(wheels: Path, where: Path) -> dict:
    """A clean venv at `where` (no system site-packages) that sees this interpreter's torch (with
    its dependencies), transformers and peft, as a GPU machine has them; `pip install --no-index
    --find-links wheels` of the carried list; `check` in it. -> {"pip_rc", "problems", "machine"}"""
    shutil.rmtree(where, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True)
    # the venv's bundled setuptools would shadow the machine's (torch requires a recent one)
    subprocess.run([str(where / "bin/python"), "-m", "pip", "uninstall", "-q", "-y", "setuptools"], capture_output=True)
    machine = where / "machine-site"
    machine.mkdir()
    names = _closure("torch") + [n for n in MACHINE_HAS if n != "torch"]
    for n in names:
        dist = md.distribution(n)
        base = Path(dist.locate_file(""))
        for entry in _top_level(dist):
            if (base / entry).exists() and not (machine / entry).exists():
                (machine / entry).symlink_to(base / entry)
    site = next((where / "lib").glob("python3*/site-packages"))
    (site / "machine.pth").write_text(str(machine) + "\n")  # after the venv's own: pip installs shadow nothing of it
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    p = subprocess.run([str(where / "bin/python"), "-m", "pip", "install", "-q", "--isolated", "--no-index",
                        "--find-links", str(wheels), *install_args(wheels)], capture_output=True, text=True, env=env)
    return {"pip_rc": p.returncode, "pip": (p.stdout + p.stderr)[-3000:], "machine": sorted(names),
            "problems": check_in(where / "bin/python")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="import everything the GPU check needs; exit 1 naming what fails")
    c.add_argument("--json", action="store_true")
    w = sub.add_parser("wheels", help="build the wheel folder for a target machine (needs the package index)")
    w.add_argument("--out", type=Path, required=True)
    w.add_argument("--python-version", default="3.12", help="the GPU machine's Python (default 3.12)")
    w.add_argument("--torch", default="2.8.0", help="the GPU machine's torch version (it is not carried)")
    w.add_argument("--list-only", action="store_true", help="print the list (docs/gpu.md), download nothing")
    v = sub.add_parser("venv-check", help="install a wheel folder into a clean venv with no index; check it")
    v.add_argument("--wheels", type=Path, required=True)
    v.add_argument("--venv", type=Path, default=Path(tempfile.gettempdir()) / "e2v-gpu-wheels-venv")
    args = p.parse_args(argv)
    if args.cmd == "check":
        problems = import_problems()
        print(json.dumps(problems) if args.json else
              "\n".join(f"cannot import {k}: {x}" for k, x in problems.items()) or "every module imports")
        return 1 if problems else 0
    if args.cmd == "wheels":
        wanted = build_wheels(args.out, args.python_version, args.torch, args.list_only)
        print(f"{len(wanted)} wheels {'listed' if args.list_only else f'in {args.out} (LIST.txt)'} for Python {args.python_version}, torch {args.torch} "
              f"and {', '.join(MACHINE_HAS)} already on the machine:")
        print("\n".join(f"    {n}=={ver}" for n, ver in wanted))
        return 0
    r = venv_check(args.wheels, args.venv)
    print(f"clean venv {args.venv}: machine's own {', '.join(r['machine'])}; pip --no-index rc {r['pip_rc']}")
    if r["pip_rc"]:
        print(r["pip"])
    print("\n".join(f"cannot import {k}: {x}" for k, x in r["problems"].items()) or "every module imports")
    return 1 if r["pip_rc"] or r["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
