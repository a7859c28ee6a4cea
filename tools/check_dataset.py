"""Check every sample of a dataset before training on it: the rules, the report and the exit codes
live in e2v/eval/dataset_check.py (the preparer runs the same check on its output).

    python tools/check_dataset.py --config configs/e2v.yaml [--set ...] [--world_size 8]
    python tools/check_dataset.py --data_root path/to/e2v_folder        # elements of configs/e2v.yaml
        [--report report.json] [--contact-sheet DIR] [--workers N]
"""

import sys

if __name__ == "__main__" and not __package__:  # started as a file: is the package installed? (tools/_installed.py)
    import _installed  # noqa: F401

from e2v.eval.dataset_check import main

if __name__ == "__main__":
    sys.exit(main())
