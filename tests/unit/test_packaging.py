"""The package as a newcomer installs it (pyproject.toml): requirements.txt (the README's pip
command) and the package's dependencies are the same list; every package folder of e2v/ is
installed; tools/ holds the user commands only, each a console script, none with a sys.path
preamble (tests/launch/test_packaging_install.py installs it into a fresh venv and runs a script)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _requirements(text: str) -> set[str]:
    """Requirement lines, comments and blanks dropped, names normalized (PEP 503), spaces removed."""
    out = set()
    for line in text.splitlines():
        line = line.split("#")[0].strip().replace(" ", "")
        if line:
            name = re.match(r"[A-Za-z0-9_.-]+", line).group(0)
            out.add(re.sub(r"[-_.]+", "-", name).lower() + line[len(name):])
    return out


def test_requirements_txt_is_the_package_and_its_dev_extra():
    project = PYPROJECT["project"]
    declared = _requirements("\n".join(project["dependencies"] + project["optional-dependencies"]["dev"]))
    assert _requirements((ROOT / "requirements.txt").read_text()) == declared


def test_every_package_folder_is_installed():
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    folders = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "e2v").rglob("__init__.py")}
    assert folders | {"e2v.tools"} == listed
    assert PYPROJECT["tool"]["setuptools"]["package-dir"] == {"e2v.tools": "tools"}


def test_tools_are_the_user_commands_each_a_console_script():
    scripts = PYPROJECT["project"]["scripts"]
    commands = sorted(p.stem for p in (ROOT / "tools").glob("*.py") if not p.stem.startswith("_"))  # _installed: a guard
    assert sorted(target.split(":")[0].removeprefix("e2v.tools.") for target in scripts.values()) == commands
    for name, target in scripts.items():
        module, func = target.split(":")
        stem = module.rsplit(".", 1)[1]
        assert name == "e2v-" + stem.replace("_", "-")
        tree = ast.parse((ROOT / "tools" / f"{stem}.py").read_text())
        defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)} | {
            a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names}
        assert func in defined, f"{target}: tools/{stem}.py has no {func}"
    for path in sorted((ROOT / "tools").glob("*.py")):
        assert "sys.path" not in path.read_text(), f"{path.relative_to(ROOT)}: a sys.path preamble (the package is installed)"
        tree = ast.parse(path.read_text())
        tools = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and (n.module or "").startswith(("tools", "bench"))]
        assert not tools, f"{path.relative_to(ROOT)} imports another command or the harness: move the shared part into e2v/"


