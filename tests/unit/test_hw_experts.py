"""Wan2.2's frozen other expert (e2v/models/load.py): kept on the host as its files' mapped pages,
one copy per machine however many local ranks map it (measured by PSS across two processes), and
made on the device tensor by tensor with the same weights the whole load gave."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch

from e2v.config.load import load_config
from e2v.config.schema import TinyShape

ROOT = Path(__file__).resolve().parents[2]
SHAPE = TinyShape(layers=4, heads=4, head_dim=64, ffn_dim=2048)  # ~27 MB of fp32: far above RSS noise


def _two_expert_folder(root: Path, shape: TinyShape | None = None, names=("high_noise", "low_noise")) -> Path:
    """The tiny Wan2.2 experts (`names`) as a diffusers pipeline folder's transformer/ and transformer_2/."""
    from e2v.models.tiny import build_tiny_experts

    for name, expert in build_tiny_experts(0, names, shape).items():
        expert.save_pretrained(root / ("transformer" if name == "high_noise" else "transformer_2"))
    (root / "model_index.json").write_text(json.dumps({
        "_class_name": "WanImageToVideoPipeline", "boundary_ratio": 0.9,
        "transformer": ["diffusers", "WanTransformer3DModel"],
        "transformer_2": ["diffusers", "WanTransformer3DModel"]}))
    return root


def _cfg(folder: Path, *sets):
    return load_config(ROOT / "configs/e2v_tiny_lora.yaml", ["model.preset=null", f"model.pretrained={folder}",
                                                              "model.expert=high_noise", "e2v_type=vae", *sets],
                       check_paths=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_device_copy_equals_the_whole_load(tmp_path, dtype):
    """The oracle: the path it replaces (from_pretrained, expanded, precision.to_inference_dtype)."""
    from e2v.models.load import expert_on_device, load_base_experts, load_transformer, with_all_experts
    from e2v.models.parts import Parts
    from e2v.models.precision import to_inference_dtype

    cfg = _cfg(_two_expert_folder(tmp_path))
    old = to_inference_dtype(load_transformer(cfg, "transformer_2")[0], "cpu", dtype)
    host = load_base_experts(cfg, ["low_noise"], 1280)["low_noise"]
    new = expert_on_device(host, "cpu", dtype)
    want = {**dict(old.named_parameters()), **dict(old.named_buffers())}
    got = {**dict(new.named_parameters()), **dict(new.named_buffers())}
    assert want.keys() == got.keys()
    for k in want:
        assert want[k].dtype == got[k].dtype and torch.equal(want[k], got[k]), k
    g = torch.Generator().manual_seed(0)
    c = old.config
    x = torch.randn(1, c.in_channels, 2, 4, 4, generator=g).to(dtype)
    text = torch.randn(1, 8, c.text_dim, generator=g).to(dtype)
    t = torch.tensor([300.0])
    # The weights above are bit-identical; the forwards may still differ in the last bits: on the CPU
    # in the model's dtype the "copy" is the mapped file's own tensor (no second host copy, the point
    # of the map), which starts off a 64-byte boundary, and MKL's AVX2 kernels sum unaligned rows in
    # another order. So the dtype's rounding over a 4-layer forward: fp32 1e-5, bf16 one ulp (2^-7).
    tol = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2 ** -7, atol=1e-2)}[dtype]
    torch.testing.assert_close(new(x, timestep=t, encoder_hidden_states=text, return_dict=False)[0],
                               old(x, timestep=t, encoder_hidden_states=text, return_dict=False)[0], **tol)

    # Two validations: the host weights are read, never replaced (a device round trip used to
    # leave private copies behind).
    before = {k: v.data_ptr() for k, v in host.state.items()}
    kept = {"experts": {"low_noise": host}}
    for _ in range(2):
        with with_all_experts(torch.nn.Identity(), Parts(transformer=None), cfg, "cpu", dtype, kept) as full:
            assert callable(full)
    assert {k: v.data_ptr() for k, v in host.state.items()} == before


def _anonymous_kb() -> int:
    return int(re.search(r"^Anonymous:\s+(\d+) kB", Path("/proc/self/smaps_rollup").read_text(), re.M)[1])


def _file_kb(folder: Path) -> tuple[int, int]:
    """Rss and Pss of this process's mappings of the expert's files."""
    rss = pss = 0
    mine = False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            mine = len(head) >= 6 and head[5].startswith(str(folder))
        elif mine and head[0] in ("Rss:", "Pss:"):
            rss, pss = (rss + int(head[1]), pss) if head[0] == "Rss:" else (rss, pss + int(head[1]))
    return rss, pss


def _wait_for(path: Path) -> None:
    t0 = time.time()
    while not path.exists():
        if time.time() - t0 > 300:
            raise SystemExit(f"{path} never came")
        time.sleep(0.05)


def _measure_rank(folder: Path, me: Path, other: Path) -> None:
    """One rank (a fork of this process, as the warm launcher's ranks are): take the expert onto the
    host, read every page, and once the other rank holds it too, write what this process maps."""
    from e2v.models.load import host_expert

    torch.set_num_threads(1)  # no OpenMP pool in a fork (the parent's, if it started one, is not here)
    anon0 = _anonymous_kb()
    host = host_expert(folder)
    sum(float(v.sum()) for v in host.state.values())  # every page read
    Path(str(me) + ".ready").touch()
    _wait_for(Path(str(other) + ".ready"))
    rss, pss = _file_kb(folder)
    Path(str(me) + ".json").write_text(json.dumps({"file_rss_kb": rss, "file_pss_kb": pss,
                                                   "anon_growth_kb": _anonymous_kb() - anon0}))
    Path(str(me) + ".done").touch()
    _wait_for(Path(str(other) + ".done"))


def test_two_local_ranks_share_one_host_copy(tmp_path):
    """Two processes (two ranks of a node) each take the frozen expert onto the host and read all
    of it, and both hold it at once: each has the whole file resident (RSS) but half of it counted
    as its own (PSS: the pages are shared), and neither made a private copy (anonymous memory).
    The ranks are forks of this process, so nothing is imported again."""
    import multiprocessing

    folder = _two_expert_folder(tmp_path / "pipe", SHAPE, names=("low_noise",)) / "transformer_2"
    size_kb = sum(f.stat().st_size for f in folder.glob("*.safetensors")) // 1024
    assert size_kb > 20_000
    marks = [tmp_path / "rank0", tmp_path / "rank1"]
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_measure_rank, args=(folder, marks[r], marks[1 - r])) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
    assert [p.exitcode for p in procs] == [0, 0]
    reports = [json.loads(Path(str(m) + ".json").read_text()) for m in marks]
    for r in reports:
        assert r["file_rss_kb"] > 0.95 * size_kb, (r, size_kb)  # all of it resident in each process...
        assert 0.4 * size_kb < r["file_pss_kb"] < 0.6 * size_kb, (r, size_kb)  # ...half of it each one's own
        assert r["anon_growth_kb"] < 0.15 * size_kb, (r, size_kb)  # no private copy
    print(f"expert file {size_kb / 1024:.1f} MiB; per rank: " + "; ".join(
        f"RSS {r['file_rss_kb'] / 1024:.1f} MiB, PSS {r['file_pss_kb'] / 1024:.1f} MiB, "
        f"private growth {r['anon_growth_kb'] / 1024:.1f} MiB" for r in reports))
