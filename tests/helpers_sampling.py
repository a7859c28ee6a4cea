"""What tests/unit/test_sampling.py and tests/launch/test_sampling_runs.py share."""

from __future__ import annotations

from helpers import ROOT


def _sample_tool():
    import importlib.util

    spec = importlib.util.spec_from_file_location("sample_tool", ROOT / "tools/sample.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
