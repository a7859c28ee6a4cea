"""Imported first by every command in tools/ started as a file (`python tools/check_dataset.py`, a launcher
running it): Python then looks for imports in tools/, not in the checkout, so without the package
installed the first `from e2v ...` would end in a ModuleNotFoundError traceback. This says in one
line what to run instead. The console scripts (`e2v-*`), `python -m e2v.tools.check_dataset` and
an imported module never come here; train_e2v.py, at the checkout's root, finds e2v beside it."""

import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("e2v") is None:
    checkout = Path(__file__).resolve().parent.parent
    sys.exit(f"e2v is not installed in this Python ({sys.executable}): run `make install` in {checkout} "
             f"(its venv, .venv), or `pip install -e {checkout}` in yours (README.md, \"Start here\")")
