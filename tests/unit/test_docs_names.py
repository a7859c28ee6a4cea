"""Every module, file and function the project names in its prose exists: docs/*.md, README.md,
and the docstrings and comments of e2v/, tools/, bench/, tests/ and train_e2v.py. Three forms are
read: a dotted path (`e2v.train.loop.train_step`, a class's own name: `e2v.train.loop.StepRecord.mean_loss`), a
file path (`e2v/train/loop.py`, `configs/e2v.yaml`, `docs/data.md`), and names given after a file
(`e2v/data/preflight.py: `sample_facts``, `tools/sample.py's `main``). A rename that leaves
its old name in the prose fails here, naming the file and line."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Files a command writes where it runs (the GPU check on a CUDA machine, the bench with --model):
# named as outputs, absent from a checkout.
WRITTEN_BY_COMMANDS = {"bench/RESULTS_GPU.md", "bench/results/gpu.json", "bench/results/steps_model.json"}
# Packages installed under another folder (pyproject.toml: package-dir).
PACKAGE_DIRS = {("e2v", "tools"): ROOT / "tools"}
NOT_NAMES = {"yaml", "yml", "json", "jsonl", "md", "py", "txt", "log", "csv", "png", "mp4", "npz", "toml",
             "safetensors", "pt"}

DOTTED = re.compile(r"(?<![\w/.-])e2v(?:\.[A-Za-z_]\w*)+")
PATH = re.compile(r"(?<![\w/.-])((?:e2v|tools|bench|tests|docs|configs|ds_configs)/[\w./-]*\w\.(?:py|md|yaml|json|toml)"
                  r"|train_e2v\.py)(?![\w*<>])")
# In backticks, a path inside e2v/ without its first part (`train.step.draw_flow`), or a name of
# train_e2v.py (`train_e2v.main`); a config key (`train.max_steps`) names no module and is passed.
STAGE_PATH = re.compile(r"`((?:runtime|config|data|models|conditioning|train|eval)(?:\.\w+)+)`")
SCRIPT_NAME = re.compile(r"`train_e2v\.(\w+)`")
NAMES_AFTER_FILE = re.compile(r"(?<![\w/.-])((?:e2v|tools|bench|tests)/[\w/]+\.py|train_e2v\.py)(?::|'s) "
                              r"((?:`\w+(?:\(\))?`(?:, | and | or )?)+)")


def prose_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "train_e2v.py"] + sorted((ROOT / "docs").glob("*.md"))
    for folder in ("e2v", "tools", "bench", "tests"):
        files += sorted((ROOT / folder).rglob("*.py"))
    return files


def prose(path: Path) -> list[tuple[int, str]]:
    """(line, text) of a Markdown file, or of a Python file's docstrings and comments."""
    text = path.read_text()
    if path.suffix != ".py":
        return [(1, text)]
    out = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(text).readline)
           if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            out.append((node.lineno, node.value.value))
    return out


@cache
def defined(path: Path) -> tuple[frozenset, dict]:
    """Top-level names of a module (functions, classes, assignments, imports, also under a
    top-level if/try), and each class's own names."""
    tree = ast.parse(path.read_text())
    names, classes = set(), {}
    nodes = list(tree.body)
    for node in tree.body:
        if isinstance(node, (ast.If, ast.Try)):
            nodes += [n for n in ast.walk(node) if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom))]
    for node in nodes:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                classes[node.name] = {m.name for m in node.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))} | {
                    t.id for m in node.body if isinstance(m, (ast.Assign, ast.AnnAssign))
                    for t in (m.targets if isinstance(m, ast.Assign) else [m.target]) if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return frozenset(names), classes


def _folder(parts: tuple[str, ...]) -> Path:
    for prefix, folder in PACKAGE_DIRS.items():
        if parts[:len(prefix)] == prefix:
            return folder.joinpath(*parts[len(prefix):])
    return ROOT.joinpath(*parts)


def dotted_problem(name: str) -> str | None:
    """Why a dotted path does not resolve (None when it does): the longest prefix that is a module
    or package, then a name it defines, then (for a class) a name of the class."""
    parts = tuple(name.split("."))
    if parts[-1] in NOT_NAMES:  # a file name such as e2v.yaml
        return None
    for i in range(len(parts), 0, -1):
        base = _folder(parts[:i])
        module = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if not module.is_file():
            if i == len(parts) and base.is_dir():
                return None
            continue
        rest = parts[i:]
        if not rest:
            return None
        names, classes = defined(module)
        if rest[0] not in names:
            return f"{'.'.join(parts[:i])} defines no {rest[0]}"
        if len(rest) > 1 and rest[0] in classes and rest[1] not in classes[rest[0]]:
            return f"{'.'.join(parts[:i + 1])} defines no {rest[1]}"
        return None
    return f"no module {name}"


def located_problems(text: str) -> list[tuple[int, str]]:
    """(line within `text`, problem) of every name in it that does not exist."""
    def line(m) -> int:
        return text.count("\n", 0, m.start())

    out = [(line(m), f"{m.group(0)}: {why}") for m in DOTTED.finditer(text) if (why := dotted_problem(m.group(0)))]
    out += [(line(m), f"{m.group(1)}: no such file") for m in PATH.finditer(text)
            if m.group(1) not in WRITTEN_BY_COMMANDS and not (ROOT / m.group(1)).exists()]
    for m in STAGE_PATH.finditer(text):
        if m.group(1) in config_keys():  # `conditioning.sequence.slots`: a key of the config, not a module path
            continue
        stage, module = m.group(1).split(".")[:2]
        if (ROOT / "e2v" / stage / f"{module}.py").is_file() or (ROOT / "e2v" / stage / module).is_dir():
            if why := dotted_problem("e2v." + m.group(1)):
                out.append((line(m), f"{m.group(1)}: {why}"))
    out += [(line(m), f"train_e2v.{m.group(1)}: train_e2v.py defines no {m.group(1)}") for m in SCRIPT_NAME.finditer(text)
            if m.group(1) not in NOT_NAMES and m.group(1) not in defined(ROOT / "train_e2v.py")[0]]
    for m in NAMES_AFTER_FILE.finditer(text):
        path = ROOT / m.group(1)
        if path.is_file():
            out += [(line(m), f"{m.group(1)}: defines no {n}") for n in re.findall(r"`(\w+)(?:\(\))?`", m.group(2))
                    if n not in defined(path)[0]]
    return sorted(out)


@cache
def config_keys() -> frozenset:
    """Every dotted key of the YAML schema (a section can share its name with a module)."""
    from e2v.config.schema import schema_keys

    return frozenset(k for keys in schema_keys().values() for k in keys)


def problems(text: str) -> list[str]:
    return [p for _, p in located_problems(text)]


def test_every_name_in_the_prose_exists():
    found = [f"{path.relative_to(ROOT)}:{start + offset}: {p}" for path in prose_files() for start, text in prose(path)
             for offset, p in located_problems(text)]
    assert not found, "names that no longer exist (rename them in the prose):\n" + "\n".join(found)


def test_a_renamed_function_or_moved_file_is_caught():
    assert problems("the step (e2v.train.loop.train_step, e2v/train/loop.py: `micro_step`)") == []
    assert problems("e2v.train.loop.StepRecord.mean_loss, e2v.tools.check_dataset, configs/e2v.yaml") == []
    assert problems("e2v.train.loop.train_steps") == ["e2v.train.loop.train_steps: e2v.train.loop defines no train_steps"]
    assert problems("e2v.train.loop.StepRecord.mean") == ["e2v.train.loop.StepRecord.mean: "
                                                         "e2v.train.loop.StepRecord defines no mean"]
    assert problems("e2v.media.supported_frames") == ["e2v.media.supported_frames: e2v defines no media"]
    assert problems("tools/bench.py") == ["tools/bench.py: no such file"]
    assert problems("e2v/train/loop.py's `train_step` and `log_step`") == ["e2v/train/loop.py: defines no log_step"]
    assert problems("`train.loop.train_step`, `train.max_steps`, `train_e2v.main`") == []
    assert problems("`train.loop.draw_flows`") == ["train.loop.draw_flows: e2v.train.loop defines no draw_flows"]
    assert problems("`train_e2v.train_step`") == ["train_e2v.train_step: train_e2v.py defines no train_step"]
