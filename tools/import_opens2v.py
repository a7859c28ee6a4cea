"""Convert OpenS2V-5M entries to the e2v folder layout, for people who prefer files:

    python tools/import_opens2v.py --metadata Jsons/total_part1.json --media-root Videos/total_part1 \
        --output data/opens2v [--config configs/e2v.yaml] [--set data.datasets.0.opens2v.min_gme=0.3]

Per sample: ID.mp4 (the valid frame range, cut to the crop box, re-encoded H.264 4:4:4 at
--crf), ID.txt (the caption) and ID_<element>.png (the references). The entries are read by the
training source itself (e2v/data/opens2v.py's read_opens2v, with the config's elements and its
`data.datasets.0.opens2v` options), so a converted folder trains as the source would; a glob in
--metadata and `{part}` in --media-root (the JSON file's stem) take several parts at once.

Resumable: a sample whose ID.txt exists is complete (its files are written first, each under a
temporary name and renamed, the prompt last) and is skipped. Entries that cannot be imported are
listed with the fix (as tools/check_dataset.py names them); the exit code is then 1.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:  # started as a file: is the package installed? (tools/_installed.py)
    import _installed  # noqa: F401

from e2v.config.load import load_config
from e2v.config.schema import ConfigError
from e2v.data.sample import MetadataError, Problem, element_paths

# The source and the media readers (torch, decord) are imported where they are used, after the
# config is checked: --help and a config error answer in a second.

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs/e2v.yaml"


def write_clip(s, out: Path, crf: int) -> None:
    """The sample's frames [start, end), cut to its crop box, as an H.264 mp4 at the clip's rate."""
    import decord
    import imageio_ffmpeg

    from e2v.data.media import clip_window, probe_video

    info = probe_video(s.video)
    clip_window(s.video, info.frames, info.height, info.width, s.frame_range, s.crop)
    start, end = s.frame_range or (0, info.frames)
    x1, y1, x2, y2 = s.crop or (0, 0, info.width, info.height)
    vr = decord.VideoReader(str(s.video), ctx=decord.cpu(0), num_threads=1)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp.mp4")
    writer = imageio_ffmpeg.write_frames(str(tmp), (x2 - x1, y2 - y1), fps=info.fps or 16, codec="libx264",
                                         pix_fmt_out="yuv444p", macro_block_size=1, ffmpeg_log_level="error",
                                         output_params=["-crf", str(crf)])
    writer.send(None)
    for a in range(start, end, 32):  # a chunk at a time: a 720p clip whole would be GBs
        for frame_HW3 in vr.get_batch(list(range(a, min(a + 32, end)))).asnumpy():
            writer.send(frame_HW3[y1:y2, x1:x2].copy())
    writer.close()
    os.replace(tmp, out)


def import_sample(s, out_dir: Path, crf: int) -> None:
    for name, src in element_paths(s).items():
        dst = out_dir / f"{s.id}_{name}.png"
        tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    write_clip(s, out_dir / f"{s.id}.mp4", crf)
    tmp = out_dir / f".{s.id}.txt.{os.getpid()}.tmp"
    tmp.write_text(s.prompt + "\n", encoding="utf-8")
    os.replace(tmp, out_dir / f"{s.id}.txt")  # last: its presence marks the sample complete


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--metadata", required=True, help="an OpenS2V JSON part, or a glob of them")
    p.add_argument("--media-root", required=True, help="where its video part was unpacked ({part}: the JSON stem)")
    p.add_argument("--output", required=True, help="the e2v folder to write")
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="the elements and opens2v options (default "
                   "configs/e2v.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="e.g. data.datasets.0.opens2v.min_gme=0.3")
    p.add_argument("--crf", type=int, default=12, help="H.264 quality of the written clips (lower is closer)")
    args = p.parse_args(argv)
    out_dir = Path(args.output)
    ds = {"data_root": str(out_dir), "dataset_type": "opens2v", "metadata_path": str(Path(args.metadata).absolute()),
          "media_root": str(Path(args.media_root).absolute()),
          "opens2v": {"references_dir": str(out_dir / ".e2v_opens2v")}}
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        cfg = load_config(args.config, [f"data.datasets=[{json.dumps(ds)}]", *args.set])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from e2v.data.media import MediaError
    from e2v.data.opens2v import read_opens2v, summary_line

    try:
        index = read_opens2v(cfg.data.datasets[0], cfg.data.elements, cfg.data.allow_outside_root)
    except (ConfigError, MetadataError) as e:  # the source's own checks
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(summary_line(cfg.data.datasets[0], index))
    from tqdm import tqdm

    todo = [s for s in index.samples if not (out_dir / f"{s.id}.txt").exists()]
    print(f"{len(index.samples) - len(todo)} already imported, {len(todo)} to write -> {out_dir}")
    problems: list[Problem] = list(index.problems)
    failed = 0
    for s in tqdm(todo, desc="import opens2v", dynamic_ncols=True, mininterval=1 if sys.stderr.isatty() else 30):
        try:
            import_sample(s, out_dir, args.crf)
        except (MediaError, OSError, ValueError) as e:
            failed += 1
            kind = getattr(e, "kind", "video_unreadable")
            problems.append(Problem(s.id, str(s.video), str(e).replace(f"{s.video}: ", ""),
                                    "fix the entry, or leave it out", kind))
    for q in problems:
        print(f"{q.kind:<22} {q.sample}: {q.file}: {q.problem} -> {q.fix}")
    print(f"imported {len(todo) - failed} samples; {len(problems)} entries not imported")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
