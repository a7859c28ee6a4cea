"""Buckets and the bucket sampler: one bucket per step on every rank, batch > 1 within a bucket,
resume continues the same order, weights, and the plain seeded shuffle as the one-bucket oracle."""

import math
from collections import Counter

import pytest
import torch
from helpers import ROOT

from e2v.config.load import load_config
from e2v.data.buckets import bucket_table, choose_bucket
from e2v.data.dataset import BadSampleError, BucketBatchSampler, index_samples, make_loader
from e2v.data.media import TooShortError
from e2v.data.sample import Sample


def _cfg(*sets, data="/tmp"):
    return load_config(ROOT / "configs/e2v_tiny_lora.yaml", [f"data.datasets.0.data_root={data}", *sets])


def _ranks(buckets, datasets=None, weights=(1.0,), world=2, batch=2, seed=0, start=0, steps=40):
    datasets = datasets or [0] * len(buckets)
    out = []
    for r in range(world):
        it = iter(BucketBatchSampler(buckets, datasets, list(weights), batch_size=batch, rank=r, world=world,
                                     seed=seed, start_sample=start))
        out.append([next(it) for _ in range(steps)])
    return out


def test_every_rank_takes_the_same_bucket_each_step():
    buckets = [(17, 64, 64)] * 9 + [(9, 64, 112)] * 7 + [(17, 64, 112)] * 4
    per_rank = _ranks(buckets, steps=30)
    for step in zip(*per_rank):
        assert all(len(b) == 2 for b in step)  # batch size 2 within the bucket
        assert len({buckets[i] for b in step for i in b}) == 1
    # per epoch every sample appears (the tail of a bucket wraps, nothing is dropped)
    per_epoch = sum(math.ceil(n / 4) for n in (9, 7, 4))
    assert {i for r in per_rank for b in r[:per_epoch] for i in b} == set(range(20))
    # buckets are interleaved, not played one after the other
    firsts = [buckets[per_rank[0][s][0]] for s in range(per_epoch)]
    assert firsts != sorted(firsts)


def test_resume_continues_the_same_order():
    buckets = [(17, 64, 64)] * 6 + [(9, 64, 112)] * 5
    full = _ranks(buckets, steps=20)
    resumed = _ranks(buckets, start=7 * 2, steps=13)  # 7 steps of batch 2 consumed per rank
    assert [r[7:] for r in full] == resumed


def test_one_bucket_is_the_plain_seeded_shuffle():
    """Oracle: randperm(n, seed + epoch), rank r takes every world-th index (the sampler before buckets)."""
    n, world, batch, seed = 16, 2, 2, 42
    got = _ranks([(17, 64, 64)] * n, world=world, batch=batch, seed=seed, steps=8)
    for r in range(world):
        flat = [i for b in got[r] for i in b]
        expected = []
        for epoch in range(2):
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
            expected += perm[r::world]
        assert flat == expected


def test_dataset_weights():
    datasets = [0] * 10 + [1] * 10
    (steps,) = _ranks([(17, 64, 64)] * 20, datasets=datasets, weights=(2.0, 0.5), world=1, batch=5, steps=5)
    counts = Counter(datasets[i] for b in steps for i in b)  # one epoch: 20 + 5 samples
    assert counts == {0: 20, 1: 5}
    assert Counter(i for b in steps for i in b if i < 10) == {i: 2 for i in range(10)}


def test_choose_bucket_frames_and_aspect():
    cfg = _cfg("data.auto_frame_buckets=true", "data.frame_buckets=[9,17,33]",
               "data.resolution_buckets=[[64,64],[64,112],[112,64]]")
    assert choose_bucket(40, 480, 480, cfg) == (33, 64, 64)
    assert choose_bucket(20, 480, 854, cfg) == (17, 64, 112)  # largest 4k+1 count the clip supports
    assert choose_bucket(9, 854, 480, cfg) == (9, 112, 64)
    with pytest.raises(TooShortError, match="shortest frame bucket 9"):
        choose_bucket(8, 64, 64, cfg)
    stride = _cfg("data.auto_frame_buckets=true", "data.frame_buckets=[9,17]", "data.frame_stride=2")
    assert choose_bucket(33, 64, 64, stride)[0] == 17 and choose_bucket(32, 64, 64, stride)[0] == 9


def test_small_bucket_is_named_never_dropped_silently():
    cfg = _cfg("train.micro_batch_size=2")
    samples = [Sample(f"{i}", ROOT / f"{i}.mp4", "p", bucket=b)
               for i, b in enumerate([(17, 64, 64)] * 4 + [(9, 64, 112)] * 1)]
    table, small = bucket_table(samples, cfg, world=2)
    assert small == [(9, 64, 112)] and "9x64x112" in table
    with pytest.raises(BadSampleError, match=r"bucket\(s\) 9x64x112 hold fewer samples"):
        make_loader(cfg, samples, rank=0, world=2)
    drop = _cfg("train.micro_batch_size=2", "data.small_bucket=drop")
    loader = make_loader(drop, samples, rank=0, world=2)
    assert len(loader.dataset) == 4


def test_index_assigns_buckets_from_the_clips(tmp_path):
    from helpers_cache import make_mixed_dataset

    data = make_mixed_dataset(tmp_path / "d", n_square=2, n_wide=3)
    (tmp_path / "d/004.mp4").write_bytes(b"broken")
    cfg = _cfg("data.resolution_buckets=[[64,64],[64,112]]", "data.auto_frame_buckets=true",
               "data.frame_buckets=[9,17]", data=data)
    with pytest.raises(BadSampleError, match="004"):
        index_samples(cfg, verbose=False)
    cfg.data.on_bad_sample = "skip"
    samples = index_samples(cfg, verbose=False)
    assert {s.id: s.bucket for s in samples} == {"000": (17, 64, 64), "001": (17, 64, 64),
                                                 "002": (9, 64, 112), "003": (9, 64, 112)}
    cfg.train.micro_batch_size = 2
    it = iter(make_loader(cfg, samples, rank=0, world=1))
    shapes = [tuple(next(it)["video"].shape) for _ in range(4)]
    assert sorted(set(shapes)) == [(2, 3, 9, 64, 112), (2, 3, 17, 64, 64)]


def test_frame_bucket_counts_default_and_time_division_factor():
    from e2v.config.schema import ConfigError
    from e2v.config.shapes import frame_bucket_list

    none = ("e2v_type=none", "data.elements=[]")
    assert frame_bucket_list(_cfg(*none, "data.num_frames=49")) == [17, 33, 49]
    cfg = _cfg(*none, "data.num_frames=17", "data.time_division_factor=4")
    assert cfg.data.auto_frame_buckets and frame_bucket_list(cfg) == [5, 9, 13, 17]
    assert choose_bucket(11, 64, 64, cfg)[0] == 9 and choose_bucket(40, 64, 64, cfg)[0] == 17
    with pytest.raises(TooShortError, match="shortest frame bucket 5"):
        choose_bucket(4, 64, 64, cfg)
    with pytest.raises(ConfigError, match="time_division_factor and data.frame_buckets"):
        _cfg(*none, "data.time_division_factor=4", "data.frame_buckets=[9]")


def test_bucket_counts_follow_repeat_and_weight():
    """Oracle: one epoch of the sampler itself (the indices it draws, counted by bucket)."""
    from e2v.config.schema import Dataset
    from e2v.data.buckets import bucket_counts, with_repeats

    cfg = _cfg()
    cfg.data.datasets = [Dataset(data_root="/tmp", repeat=2), Dataset(data_root="/tmp", weight=0.5)]
    unique = ([Sample(f"a{i}", ROOT / "a.mp4", "p", dataset=0, bucket=(17, 64, 64)) for i in range(3)]
              + [Sample(f"b{i}", ROOT / "b.mp4", "p", dataset=1, bucket=(9, 64, 64)) for i in range(4)]
              + [Sample("a3", ROOT / "c.mp4", "p", dataset=0, bucket=(9, 64, 64))])
    indexed = with_repeats(unique, cfg)
    assert [s.id for s in indexed] == ["a0", "a1", "a2", "a3"] * 2 + ["b0", "b1", "b2", "b3"]
    sampler = BucketBatchSampler([s.bucket for s in indexed], [s.dataset for s in indexed],
                                 [d.weight for d in cfg.data.datasets], batch_size=1)
    drawn = Counter(indexed[i].bucket for i in sampler.epoch_indices(0))
    assert bucket_counts(indexed, cfg) == drawn == {(17, 64, 64): 6, (9, 64, 64): 2 + 2}


def _distinct(rank, world, port, out):
    import torch.distributed as dist

    from e2v.runtime.distributed import distinct_over_ranks

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    out.put((rank, distinct_over_ranks([{"a", "b"}, {"b", "c"}][rank])))
    dist.destroy_process_group()


def test_distinct_over_ranks_counts_a_sample_seen_by_two_ranks_once():
    import torch.multiprocessing as mp
    from helpers import _free_port

    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.start_processes(_distinct, args=(2, _free_port(), out), nprocs=2, start_method="fork")
    assert sorted(out.get() for _ in range(2)) == [(0, 3), (1, 3)]
