"""Weights & Biases beside TensorBoard (train.log_to, the `wandb:` keys, e2v/train/runlog.py): a tiny
run in this process logging offline to both writes the same scalars as scalars.jsonl into its W&B
run file (read back here with wandb's own record format), the speed scalars among them, and the
validation video; a missing wandb package stops the run at start, before any weight loads."""

from __future__ import annotations

import json

import pytest
from helpers import ROOT, train_main

LEVELDB_BLOCK, HEADER = 32768, 7  # W&B's run file: ":W&B", a 2-byte magic, a version byte, then a LevelDB log
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def history(run_file) -> dict[int, dict]:
    """step -> {key: value} of every history record in an offline run's .wandb file: LevelDB log
    records (7-byte headers: crc, length, type; 32 KiB blocks) holding wandb's protobuf Records."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    pos, pending, out = HEADER, b"", {}
    while pos + 7 <= len(data):
        if LEVELDB_BLOCK - pos % LEVELDB_BLOCK < 7:  # a block's tail too short for a header is padding
            pos += LEVELDB_BLOCK - pos % LEVELDB_BLOCK
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind not in (FULL, LAST):
            continue
        record = pb.Record()
        record.ParseFromString(pending)
        if record.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            out.setdefault(record.history.step.num, {}).update(items)
    return out


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """No network, nothing under the home folder, no console chatter."""
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def _sets(data, out, *extra) -> list[str]:
    sets = [f"data.datasets.0.data_root={data}", f"output_dir={out}", "run_id=wb", "train.max_steps=1",
            "train.checkpoint_every=0", "train.micro_batch_size=2", "data.num_workers=0", "visualization.enabled=false",
            "validation.every_n_steps=1", "validation.num_samples=2", "validation.num_videos=1",
            "validation.num_inference_steps=1", "validation.sigmas=[0.5]", *extra]
    return [a for s in sets for a in ("--set", s)]


def test_offline_run_logs_the_scalars_and_the_video(demo_data, tmp_path, offline_wandb):
    # the config's default mode is online: WANDB_MODE=offline (the fixture) holds it offline
    code = train_main("--config", str(ROOT / "configs/e2v_tiny_lora.yaml"),
                      *_sets(demo_data, tmp_path, "train.log_to=both", "wandb.project=e2v-test"))
    assert code is None
    run = tmp_path / "wb"
    jsonl = [json.loads(line) for line in (run / "scalars.jsonl").read_text().splitlines()]
    files = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    logged = history(files[0])
    for row in jsonl:  # every scalar of every logged step, the same value
        step = row.pop("step")
        assert {k: logged[step][k] for k in row} == pytest.approx(row), step
    assert {0, 1} <= set(logged) and "perf/tokens_per_s" in logged[1] and "perf/tflops_per_gpu" in logged[1]
    assert "perf/mfu" not in logged[1]  # a CPU: no peak to divide by
    assert logged[1]["val/video_00/_type"] == "image-file"  # the frame strip TensorBoard shows too
    assert logged[1]["val/video_00_mp4/_type"] == "video-file"
    assert (files[0].parent / "files" / logged[1]["val/video_00_mp4/path"]).stat().st_size > 0
    assert (run / "tb").is_dir()  # TensorBoard beside it


def test_missing_wandb_stops_the_run_before_weights_load(demo_data, tmp_path, monkeypatch, capsys):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    code = train_main("--config", str(ROOT / "configs/e2v_tiny_lora.yaml"), *_sets(demo_data, tmp_path, "train.log_to=wandb"))
    assert code == ("start-up check: rank 0: train.log_to: wandb needs the wandb package, which is not installed; "
                    "fix: pip install wandb (or set train.log_to: tensorboard)")
    assert "frozen encoders loaded" not in capsys.readouterr().out
