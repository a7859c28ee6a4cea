"""The start-up data check spread over the ranks (e2v/data/preflight.py: facts_over_ranks): two gloo
ranks check the bad demo set, each reading only its share of the samples, and reach the same
problems and buckets as the single-rank check; the gather's timeout and the note that names
tools/check_dataset.py are sized to the set; tools/check_dataset.py fills the cache the training
check reads, so that check then reads no file."""

from __future__ import annotations

import json

import pytest
from helpers_agree import two_ranks
from helpers_preflight import BAD, _cfg

import e2v.data.dataset  # noqa: F401  (the ranks fork from here: imported once)

RANK_SCRIPT = """
import datetime, json, os, sys
import torch.distributed as dist
from e2v.config.load import load_config
from e2v.data import preflight
from e2v.data.elements import discover
data, config, cache = json.loads(sys.argv[1])
os.environ["E2V_CACHE_DIR"] = cache
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
cfg = load_config(config, [f"data.datasets.0.data_root={data}"])
found, _ = discover(cfg.data.datasets[0], cfg.data.elements, cfg.data.remove_common_llm_caption_prefixes, 0,
                    cfg.data.allow_outside_root)
read, real = [], preflight.sample_facts
preflight.sample_facts = lambda job: read.append(os.path.basename(job[0])) or real(job)
real_group = dist.new_group
def new_group(*a, **k):  # the check's own group: gloo, with the timeout sized to the set
    print("GROUP " + json.dumps([k.get("backend"), k["timeout"].total_seconds()]), flush=True)
    return real_group(*a, **k)
dist.new_group = new_group
for attempt in ("cold", "warm"):  # the second finds everything in rank 0's cache
    read.clear()
    problems = preflight.check_samples(cfg, found, workers=1, progress=False)
    print("READ " + attempt + " " + json.dumps(sorted(read)), flush=True)
    print("PROBLEMS " + attempt + " " + json.dumps(sorted([p.sample, p.kind, p.severity, p.problem] for p in problems)),
          flush=True)
    print("BUCKETS " + attempt + " " + json.dumps(sorted([s.id, list(s.bucket or [])] for s in found)), flush=True)
dist.destroy_process_group()
"""


def _single_rank(data, tmp_path, monkeypatch):
    """The check on one rank (no process group): problems and buckets, the reference."""
    from e2v.data import preflight
    from e2v.data.elements import discover

    monkeypatch.setenv("E2V_CACHE_DIR", str(tmp_path / "one_rank_cache"))
    cfg = _cfg(data)
    found, _ = discover(cfg.data.datasets[0], cfg.data.elements, cfg.data.remove_common_llm_caption_prefixes, 0,
                        cfg.data.allow_outside_root)
    problems = preflight.check_samples(cfg, found, workers=1, progress=False)
    return (sorted([p.sample, p.kind, p.severity, p.problem] for p in problems),
            sorted([s.id, list(s.bucket or [])] for s in found))


def test_two_ranks_share_the_reading_and_agree_with_one_rank(bad_data, tmp_path, monkeypatch):  # noqa: F811
    from helpers import ROOT

    from e2v.config.load import load_config  # noqa: F401  (imported before the fork)

    problems_1, buckets_1 = _single_rank(bad_data, tmp_path, monkeypatch)
    assert {p[0] for p in problems_1 if p[2] == "error"} == set(BAD)  # the reference sees the three bad samples
    arg = json.dumps([str(bad_data), str(ROOT / "configs/e2v_tiny_lora.yaml"), str(tmp_path / "shared_cache")])
    ranks = two_ranks(RANK_SCRIPT, arg, marks=("READ", "PROBLEMS", "BUCKETS", "GROUP", "Traceback"), timeout=240)
    from e2v.data.preflight import MIN_TIMEOUT_S

    for r in ranks:  # one group per check, each with the sized timeout (8 samples: the floor, 30 min)
        assert [json.loads(line.split(" ", 1)[1]) for line in r if line.startswith("GROUP")] == \
            [["gloo", MIN_TIMEOUT_S]] * 2, r
    lines = [{line.split(" ", 2)[0] + " " + line.split(" ", 2)[1]: json.loads(line.split(" ", 2)[2]) for line in r
              if line.startswith(("READ", "PROBLEMS", "BUCKETS"))} for r in ranks]
    assert all(len(d) == 6 for d in lines), ranks
    cold = [set(d["READ cold"]) for d in lines]
    assert not cold[0] & cold[1], "each sample is read by one rank"
    assert cold[0] | cold[1] == {f"{i:03d}.mp4" for i in range(8)} and all(len(c) == 4 for c in cold)
    assert lines[0]["READ warm"] == lines[1]["READ warm"] == [], "the second check reads rank 0's cache"
    for d in lines:
        for attempt in ("cold", "warm"):
            assert d[f"PROBLEMS {attempt}"] == problems_1
            assert d[f"BUCKETS {attempt}"] == buckets_1


def test_the_gather_timeout_and_the_note_are_sized_to_the_set():
    from e2v.data import preflight

    assert preflight.long_check_note(100, 0, 8, 8) is None  # seconds: nothing to say
    assert preflight.gather_timeout_s(100, 8, 8) == preflight.MIN_TIMEOUT_S
    # a million clips over 16 ranks of 8 workers: ~2 s x 62,500 / 8 = ~4.3 h
    expected = preflight.check_seconds(1_000_000, 16, 8)
    assert expected == pytest.approx(2.0 * 62_500 / 8)
    assert preflight.gather_timeout_s(1_000_000, 16, 8) == pytest.approx(4 * expected)  # beyond DeepSpeed's 10 min
    note = preflight.long_check_note(1_000_000, 5, 16, 8)
    assert "tools/check_dataset.py" in note and "~260 min" in note and "1000000 samples (5 cached)" in note
    assert "E2V_CACHE_DIR" in note


def test_rank_workers_share_the_nodes_cores(monkeypatch):
    from e2v.data import preflight

    monkeypatch.setattr(preflight.os, "cpu_count", lambda: 96)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert preflight.default_workers() == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")
    assert preflight.default_workers() == 3
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setattr(preflight.os, "cpu_count", lambda: 2)
    assert preflight.default_workers() == 2


def test_check_dataset_fills_the_cache_training_reads(bad_data, tmp_path, monkeypatch):  # noqa: F811
    """tools/check_dataset.py then the training check: the training check opens no file."""
    from helpers import ROOT

    from e2v.data import preflight
    from e2v.data.dataset import index_samples
    from tools.check_dataset import main

    monkeypatch.setenv("E2V_CACHE_DIR", str(tmp_path / "cache"))
    rc = main(["--config", str(ROOT / "configs/e2v_tiny_lora.yaml"), "--set", f"data.datasets.0.data_root={bad_data}",
               "--json", str(tmp_path / "report.json"), "--workers", "1"])
    assert rc == 1  # the bad samples are errors
    read = []
    real = preflight.sample_facts
    monkeypatch.setattr(preflight, "sample_facts", lambda job: read.append(job[0]) or real(job))
    excluded = []
    index_samples(_cfg(bad_data, "data.on_bad_sample=skip"), verbose=False, excluded=excluded)
    assert read == [], read
    assert sorted(p.sample for p in excluded) == sorted(BAD)
