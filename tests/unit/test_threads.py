"""CPU threads per rank (e2v/runtime/threads.py): each rank its share of the usable cores unless
OMP_NUM_THREADS says otherwise, every DataLoader worker one thread."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_each_rank_takes_its_share_of_the_cores(monkeypatch, restore_threads):
    import e2v.runtime.threads as threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("LOCAL_SIZE", "8")  # DeepSpeed's launcher
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    assert threads.set_rank_threads() == "CPU threads per rank: 8 (64 cores / 8 local rank(s))"
    assert torch.get_num_threads() == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # torchrun's wins; at least one thread each
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert threads.rank_threads() == (1, "2 cores / 3 local rank(s)")


def test_omp_num_threads_is_the_users_choice(monkeypatch, restore_threads):
    import e2v.runtime.threads as threads

    torch.set_num_threads(1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("LOCAL_SIZE", "1")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    assert threads.set_rank_threads() == "CPU threads per rank: 1 (OMP_NUM_THREADS=1)"
    assert torch.get_num_threads() == 1


def test_loader_workers_run_one_thread_each(demo_data, restore_threads):
    from helpers import ROOT

    from e2v.config.load import load_config
    from e2v.data.dataset import index_samples, make_loader
    from e2v.runtime.threads import one_thread_worker

    torch.set_num_threads(2)
    one_thread_worker(0)
    assert torch.get_num_threads() == 1
    cfg = load_config(ROOT / "configs/e2v_tiny.yaml", [f"data.datasets.0.data_root={demo_data}",
                                                       "data.num_workers=1", "cache.enabled=false"])
    loader = make_loader(cfg, index_samples(cfg), rank=0, world=1)
    assert loader.num_workers == 1 and loader.worker_init_fn is one_thread_worker
