"""The logging rule (e2v/runtime/log.py's docstring): nothing in e2v/ prints except a command's
`main(argv)`; every other message goes through the rank-0 logger. Checked on the source (a print
anywhere else is named with its file and line), and on one library message end to end."""

from __future__ import annotations

import ast
from pathlib import Path

E2V = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file()) / "e2v"


def prints_outside_main(source: str) -> list[int]:
    """Line numbers of print(...) calls not inside a function named main."""
    found = []

    def visit(node: ast.AST, in_main: bool) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            in_main = in_main or node.name == "main"
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print"
                and not in_main):
            found.append(node.lineno)
        for child in ast.iter_child_nodes(node):
            visit(child, in_main)

    visit(ast.parse(source), False)
    return found


def test_the_scan_finds_a_print_outside_main_only():  # the oracle for the scan itself: a hand-made module
    source = ("def helper():\n    print('x')\n\ndef main(argv=None):\n    def inner():\n        print('y')\n"
              "    print('z')\n\nclass C:\n    def main(self):\n        print('w')\n\nprint('top')\n")
    assert prints_outside_main(source) == [2, 13]


def test_no_module_of_e2v_prints_outside_a_command_main():
    offenders = [f"{path.relative_to(E2V.parent)}:{line}"
                 for path in sorted(E2V.rglob("*.py")) for line in prints_outside_main(path.read_text())]
    assert offenders == [], ("print outside a command's main (log with e2v.runtime.log.get_logger, or return the "
                             f"text): {offenders}")


def test_a_library_message_is_tagged_and_said_by_rank_zero_only(tmp_path, capsys, monkeypatch):
    from e2v.runtime.runlock import cut_scalars

    path = tmp_path / "scalars.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n')
    monkeypatch.setenv("RANK", "1")
    assert cut_scalars(path, 2) == 1
    assert capsys.readouterr().out == ""
    path.write_text('{"step": 1}\n{"step": 2}\n')
    monkeypatch.setenv("RANK", "0")
    assert cut_scalars(path, 2) == 1
    assert capsys.readouterr().out == (f"[e2v] {path}: dropped 1 line(s) of steps >= 2, logged by an earlier run "
                                       "past the point this run starts from\n")
