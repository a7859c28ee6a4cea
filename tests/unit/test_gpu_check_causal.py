"""bench/gpu_check.py's causal_step section without a GPU (bench/gpulib/causal_section.py): its report
from a recorded result dict (three modes on a GPU, one failed by out of memory; the CPU's two) and
the section itself at tiny sizes on the CPU (--allow-cpu): the bidirectional and per-block causal
steps run, and the real-shape timings and the compiled flex path are named as not run, so the
verdict is INCOMPLETE, never PASSED."""

import json

import pytest
from helpers import gpu_report

pytestmark = pytest.mark.usefixtures("one_thread")

GPU = {"passed": False, "wall_s": 95.2, "shape": [81, 480, 832], "latent_shape": [1, 16, 21, 60, 104],
       "frames_per_block": 3, "build_s": 4.1, "timed_steps": 3, "flex_blocks_rel_diff": 0.0031,
       "modes": {"bidirectional": {"passed": True, "step_s": 2.412, "first_step_s": 3.05, "forward_and_loss_s": 0.8,
                                   "backward_s": 1.6, "over_bidirectional": 1.0,
                                   "max_memory_allocated_gib": 9.87, "losses": [0.71, 0.71, 0.71, 0.71]},
                 "causal_flex": {"passed": True, "step_s": 1.9, "first_step_s": 41.3, "forward_and_loss_s": 0.61,
                                 "backward_s": 1.28, "over_bidirectional": 0.788,
                                 "max_memory_allocated_gib": 10.42, "losses": [0.69, 0.69, 0.69, 0.69]},
                 "causal_blocks": {"passed": False, "oom": "CUDA out of memory. Tried to allocate 2.00 GiB",
                                   "over_bidirectional": None}}}


def test_the_report_of_a_recorded_gpu_result():
    text = gpu_report({"causal_step": GPU})
    assert "| causal_step | FAILED | 95 |" in text
    assert "## causal_step: Causal training step against the bidirectional, 1.3B at 480 x 832 x 81" in text
    assert "| bidirectional | ok | 2.412 | 0.800 | 1.600 | 1.00 | 3.0 | 9.87 | [0.71, 0.71, 0.71, 0.71] |" in text
    assert "| causal_flex | ok | 1.900 | 0.610 | 1.280 | 0.79 | 41.3 | 10.42 | [0.69, 0.69, 0.69, 0.69] |" in text
    assert "| causal_blocks | FAILED | - | - | - | - | - | - | CUDA out of memory. Tried to allocate 2.00 GiB |" in text
    assert ("81 x 480 x 832 (latents [1, 16, 21, 60, 104]), blocks of 3 frames; the loop's micro-step (draw, forward, "
            "x0 loss, backward) of the whole transformer with gradient checkpointing, no optimizer step; median of 3 "
            "step(s) after a warm-up (flex compiles there); model built in 4.1 s; flex and blocks losses differ by "
            "3.10e-03 (relative; at most 0.02).") in text


def test_on_the_cpu_the_section_runs_tiny_and_says_what_it_did_not_measure(tmp_path):
    import bench.gpu_check as gc

    rc = gc.main(["--allow-cpu", "--only", "causal_step", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "w")])
    r = json.loads((tmp_path / "out/results/gpu.json").read_text())["sections"]["causal_step"]
    assert rc == 3, r  # the real shape was not measured: INCOMPLETE
    r = json.loads((tmp_path / "out/results/gpu.json").read_text())["sections"]["causal_step"]
    assert r["passed"] and list(r["modes"]) == ["bidirectional", "causal_blocks"]
    assert r["latent_shape"] == [1, 16, 6, 4, 4] and r["frames_per_block"] == 3
    for m in r["modes"].values():
        # medians of each phase over the steps: the step's dominates each phase's (not their sum's)
        assert m["step_s"] >= max(m["forward_and_loss_s"], m["backward_s"]) > 0 and len(m["losses"]) == 2 and m["losses"][0] == m["losses"][1]  # one seed every step
    assert r["modes"]["bidirectional"]["losses"] != r["modes"]["causal_blocks"]["losses"]  # another rule, another draw
    assert "480 x 832 x 81 and the compiled flex path" in r["skipped_checks"][0]
    text = (tmp_path / "out/RESULTS_GPU.md").read_text()
    assert "Overall: INCOMPLETE." in text and "| causal_step | INCOMPLETE |" in text
    assert "Not run, so not shown to work: causal_step: the causal step's time and peak memory" in text
