"""tools/prepare_data.py on footage it did not make, with known truth (bench/make_raw_footage.py
write_hard_footage: scikit-image's photographs, a pan and a zoom, a subject that stands still for
half its shot, two subjects, a dissolve, a hard cut between two textures of similar colours, a
portrait clip, two shots of one place, a still shot with a large subject): every cut and dissolve found, no reference showing another subject, the still
subject dropped and named, pans registered, the portrait kept portrait; the identity check on a
wrong reference with both measures; a run that writes nothing exits non-zero with the fix.

This file: the tests that train through the launcher; the in-process ones are in tests/unit/test_prepare_hard.py."""

from __future__ import annotations


def test_the_prepared_portrait_and_landscape_samples_train(hard_prepared, tmp_path):
    """The prepared set, its portrait clip included, trains: two steps of the tiny LoRA config with the
    trainer's buckets holding both orientations (as the summary says to set them), the portrait
    sample in its own 160 x 96 bucket."""
    from helpers_launch import launch_python, wait_all

    out, summary = hard_prepared
    assert [160, 96] in summary["sample_sizes_hw"]
    sets = [f"data.datasets.0.data_root={out}", f"output_dir={tmp_path}", "run_id=hard", "data.num_frames=17",
            "data.fps=8", "data.resolution=[96, 160]", "data.resolution_buckets=[[96, 160], [160, 96]]",
            "validation.every_n_steps=0", "train.max_steps=2",
            "train.micro_batch_size=1", "train.checkpoint_every=100"]
    done, = wait_all(launch_python("train_e2v.py", "--config", "configs/e2v_tiny_lora.yaml",
                                   *[a for s in sets for a in ("--set", s)]), check=False)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    text = done.stdout + done.stderr
    assert "17x160x96" in text, text[-3000:]  # the portrait bucket, as training lists it
    assert (tmp_path / "hard" / "lora").is_dir()
