"""The tree reads as the pipeline (docs/architecture.md, "Module map"): e2v/ is one subpackage per
stage, a module imports only its own stage and the stages above it, nothing imports in a loop, and
every third-party package that e2v/, tools/, bench/, tests/ or train_e2v.py imports is declared in
requirements.txt, so a venv built from that file alone runs the suite. Read from the source (AST):
imports inside functions count too, since a lazy import in a loop is still a loop."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Imported from outside any package index, by the tests that use it when it is there (they skip
# otherwise): ComfyUI's own code, the oracle of the ComfyUI export, from the checkout E2V_COMFYUI names.
NOT_FROM_AN_INDEX = {"comfy"}
STAGES = ("runtime", "config", "data", "models", "conditioning", "train", "eval")


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / "e2v").rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _optional_imports(tree: ast.AST) -> set[ast.AST]:
    """Imports inside a `try` whose handler catches ImportError: the code runs without them."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
                isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError") for h in node.handlers):
            out |= {n for stmt in node.body for n in ast.walk(stmt) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return out


def _imports(path: Path, required_only: bool = False) -> list[tuple[str, int]]:
    """(imported module or module.name, line) of every import in a file, relative ones resolved;
    with `required_only`, not those a `try: ... except ImportError` makes optional."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    skip = _optional_imports(tree) if required_only else set()
    out = []
    for node in ast.walk(tree):
        if node in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            out += [(f"{base}.{a.name}", node.lineno) for a in node.names]
    return out


def _graph() -> dict[str, dict[str, int]]:
    """module -> {e2v module it imports: line}."""
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        edges = {}
        for target, line in _imports(path):
            while target and target not in mods:  # `from e2v.data.media import load_image` -> e2v.data.media
                target = target.rpartition(".")[0]
            if target.startswith("e2v.") and target != name:
                edges.setdefault(target, line)
        graph[name] = edges
    return graph


def _stage(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in STAGES) else None


def test_every_module_lives_in_a_stage():
    loose = [n for n in _modules() if n != "e2v" and _stage(n) not in STAGES]
    assert not loose, f"modules outside the stage subpackages {STAGES}: {loose}"


def test_a_stage_imports_only_the_stages_above_it():
    wrong = []
    for module, edges in _graph().items():
        if module == "e2v":
            continue
        for target, line in edges.items():
            if STAGES.index(_stage(target)) > STAGES.index(_stage(module)):
                wrong.append(f"{_modules()[module].relative_to(ROOT)}:{line} imports {target} "
                             f"(stage {_stage(target)} comes after {_stage(module)})")
    assert not wrong, "\n".join(wrong)


def _find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in graph.get(node, {}):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt, path + [nxt])):
                return cycle
        state[node] = 2
        return None

    for node in graph:
        if node not in state and (cycle := visit(node, [node])):
            return cycle
    return None


def test_no_import_cycle():
    cycle = _find_cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    """The check above can fail: a two-module loop and a three-module loop are found."""
    assert _find_cycle({"a": {"b": 1}, "b": {"a": 1}}) in (["a", "b", "a"], ["b", "a", "b"])
    assert _find_cycle({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b": 1}, "b": {}}) is None


def _declared() -> set[str]:
    names = set()
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            names.add(_normal(re.split(r"[<>=!~\[; ]", line, maxsplit=1)[0]))
    return names


def _normal(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def _local_names() -> set[str]:
    """Top-level names that are the project's own: its packages and the test/tool helper modules."""
    names = {"e2v", "tools", "bench", "tests", "train_e2v"}
    for folder in ("tests", "tools", "bench"):
        names |= {p.stem for p in (ROOT / folder).glob("*.py")} | {p.name for p in (ROOT / folder).iterdir() if p.is_dir()}
    return names


def third_party_imports() -> dict[str, list[str]]:
    """Top-level import name -> where it is imported, for every import in the project's code that
    is neither the standard library nor the project's own."""
    files = [ROOT / "train_e2v.py"] + [p for d in ("e2v", "tools", "bench", "tests") for p in sorted((ROOT / d).rglob("*.py"))]
    local, out = _local_names() | NOT_FROM_AN_INDEX, {}
    for path in files:
        for target, line in _imports(path, required_only=True):
            top = target.split(".")[0]
            if top and top not in sys.stdlib_module_names and top not in local and top != "__future__":
                out.setdefault(top, []).append(f"{path.relative_to(ROOT)}:{line}")
    return out


def test_every_third_party_import_is_declared_in_requirements():
    declared, dists = _declared(), importlib.metadata.packages_distributions()
    missing = []
    for top, where in sorted(third_party_imports().items()):
        candidates = {_normal(d) for d in dists.get(top, [])}
        if not candidates:
            missing.append(f"{top} (not installed here; imported at {where[0]})")
        elif not candidates & declared:
            missing.append(f"{top} (distribution {' or '.join(sorted(candidates))}; imported at {where[0]})")
    assert not missing, "imports that requirements.txt does not declare:\n" + "\n".join(missing)


def test_an_import_made_optional_by_its_try_is_not_required():
    tree = ast.parse("try:\n    import torchvision\nexcept ImportError:\n    pass\nimport yaml\n")
    assert [type(n).__name__ for n in _optional_imports(tree)] == ["Import"]
    assert {a.name for n in _optional_imports(tree) for a in n.names} == {"torchvision"}


@pytest.mark.parametrize("top", ["torch", "yaml", "cv2", "scipy"])
def test_the_declaration_check_knows_the_import_names(top):
    """The map from import name to distribution is the installed metadata's (yaml -> PyYAML,
    cv2 -> opencv-python-headless): each of these is found and declared."""
    assert {_normal(d) for d in importlib.metadata.packages_distributions().get(top, [])} & _declared()


def test_the_benchmark_states_no_step_of_its_own():
    """The benchmark times the package's loop (e2v/train/loop.py) through its phase hook: none of
    its files calls the step's parts itself, so a change to the step (Wan2.2's expert draw, a new
    statistic) cannot leave a stale copy behind."""
    import e2v.train.loop as loop

    root = ROOT
    step_parts = {"draw_flow", "forward_loss", "add_step_stats", "step_scalars", "batch_conditions",
                  "expert_sigma_range", "to_device", "next_agreed"}
    for path in sorted((root / "bench").rglob("*.py")):
        tree = ast.parse(path.read_text())
        named = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
            n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)} | {
            a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        assert not named & step_parts, f"{path.relative_to(root)} re-states the step: {sorted(named & step_parts)}"
    step_py = (root / "bench/benchlib/step.py").read_text()
    assert "loop.train_step(" in step_py and "loop.micro_step(" in step_py
    assert set(loop.PHASES) >= {"data_wait", "conditioning", "forward_and_loss", "backward", "optimizer"}


def test_no_test_imports_conftest_or_another_test():
    """Test helpers live in tests/helpers*.py; conftest.py holds fixtures and hooks only, so pytest
    alone imports it (a second import under another name would start a second warm server), and a
    test file imports no other test file (what two share is a helper module both import); test
    files live in tests/unit/ or tests/launch/ only (tests/conftest.py: the folder is the suite)."""
    files = sorted((ROOT / "tests").rglob("*.py"))
    importing = [str(p.relative_to(ROOT)) for p in files
                 if any(target.split(".")[0] == "conftest" or any(part.startswith("test_") for part in target.split("."))
                        for target, _ in _imports(p))]
    assert not importing, f"import from helpers / helpers_launch / helpers_<topic> instead: {importing}"
    assert len((ROOT / "tests/conftest.py").read_text().splitlines()) < 250
    assert {p.parent.name for p in files if p.name.startswith("test_")} == {"unit", "launch"}


def test_a_unit_test_that_launches_fails_naming_the_move(request):
    """The folder is the suite (tests/conftest.py): this test carries no `launch` marker, and a
    launch from it stops before anything starts, naming the fix."""
    from helpers_launch import launch_python, launch_train

    assert request.node.get_closest_marker("launch") is None
    for start in (lambda: launch_train("configs/e2v_tiny_lora.yaml"), lambda: launch_python("train_e2v.py")):
        with pytest.raises(pytest.fail.Exception, match=r"test_layout\.py::test_a_unit_test_that_launches.* move it to "
                                                         r"tests/launch/"):
            start()
