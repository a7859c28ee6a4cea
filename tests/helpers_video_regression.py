"""What tests/unit/test_video_regression.py and tests/launch/test_video_regression_runs.py share."""

from helpers import ROOT

CONFIG = str(ROOT / "configs/video_regression.yaml")


STEP_LIST = [1000, 750, 500, 250]


NUM_FRAMES, SIZE, BATCH, STEPS = 9, 32, 2, 4
