"""Measured figures live once, in bench/RESULTS.md (section 7 from bench/results/measured.json);
code, configs and docs cite them by key (`bench/RESULTS.md, section 7: \\`key\\``). Every cited key
must be a row, every row must be cited, and the rendered RESULTS.md must list every row."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())  # the checkout
CITE = re.compile(r"section 7:\s*(?:#\s*)?`(\w+)`")


def cited_keys() -> dict[str, list[str]]:
    cited: dict[str, list[str]] = {}
    for folder in ("e2v", "configs", "tools", "bench", "docs", "tests"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix not in (".py", ".yaml", ".md") or path.name == "RESULTS.md" or path == Path(__file__).resolve():
                continue
            for key in CITE.findall(path.read_text(errors="replace")):
                cited.setdefault(key, []).append(str(path.relative_to(ROOT)))
    return cited


def test_the_citation_pattern_spans_a_wrapped_comment():  # the scan's own oracle
    assert CITE.findall("figures (bench/RESULTS.md, section 7:\n# `demo_run`) and section 7: `x_y`") == ["demo_run", "x_y"]


def test_every_cited_figure_is_a_row_and_every_row_is_cited():
    rows = {r["key"] for r in json.loads((ROOT / "bench/results/measured.json").read_text())["rows"]}
    cited = cited_keys()
    assert {k: v for k, v in cited.items() if k not in rows} == {}, "cited, but no row in bench/results/measured.json"
    assert sorted(rows - set(cited)) == [], "a row nothing cites: drop it, or cite it where the figure matters"
    results = (ROOT / "bench/RESULTS.md").read_text()
    assert [k for k in sorted(rows) if f"| `{k}` |" not in results] == [], "bench/RESULTS.md is stale: rerun bench.benchlib.report.render"
