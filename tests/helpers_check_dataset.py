"""The dataset check's test data and its runner (`run_check`: tools/check_dataset.py in this process or
as the command), shared by tests/unit/test_check_dataset.py, test_hostile_data.py, test_fps.py and
test_check_agreement.py."""

import contextlib
import io
import json
import os
import subprocess
import sys
from collections import Counter

import imageio_ffmpeg
import numpy as np
from PIL import Image

from e2v.config.load import load_config

CONFIG = """
e2v_type: dual
model: {preset: tiny}
data:
  datasets: [{data_root: DATA}]
  num_frames: 9
  resolution: [64, 64]
  elements:
    - {name: person, suffixes: [_person.png], required: true, vae: {repeat: 1, position: 0}}
    - {name: object, suffixes: [_object.png], required: false, vae: {repeat: 4, position: 1}}
train: {micro_batch_size: 2, max_steps: 1}
validation: {every_n_steps: 0}
"""


def clip(path, frames=9, h=64, w=64, fps=8, seed=0):
    rng = np.random.default_rng(seed)
    video = np.clip(rng.integers(0, 255, 3) + rng.integers(-30, 30, (frames, h, w, 3)), 0, 255).astype(np.uint8)
    writer = imageio_ffmpeg.write_frames(str(path), (w, h), fps=fps, codec="libx264", pix_fmt_out="yuv444p",
                                         macro_block_size=1, ffmpeg_log_level="error", output_params=["-crf", "12"])
    writer.send(None)
    for f in video:
        writer.send(np.ascontiguousarray(f))
    writer.close()


def sample(root, ident, *, person=True, prompt=None, **video):
    clip(root / f"{ident}.mp4", seed=int(ident), **video)
    (root / f"{ident}.txt").write_text(f"clip {ident} shows its own thing" if prompt is None else prompt)
    if person:
        Image.fromarray(np.full((48, 40, 3), int(ident) % 255, np.uint8)).save(root / f"{ident}_person.png")


def clean_set(root, n=4):
    root.mkdir(parents=True)
    for i in range(n):
        sample(root, f"{i:03d}")
    return root


def unprinted(report, stdout: str) -> list[dict]:
    """The report's problems stdout does not show: each problem on its own line (file: problem ->
    fix), except a warning kind met more than four times, which is one counted line
    (e2v/data/preflight.py's summarize: `WARNING <kind> <n> samples, e.g. ...`)."""
    counts = Counter(p["kind"] for p in report["problems"] if p["severity"] != "error")
    return [p for p in report["problems"]
            if f"{p['file']}: {p['problem']} -> {p['fix']}" not in stdout
            and not (p["severity"] != "error" and counts[p["kind"]] > 4
                     and f"WARNING {p['kind']:<18} {counts[p['kind']]} samples, e.g. " in stdout)]


def run_check(tmp_path, data, *args, config=CONFIG):
    """tools/check_dataset.py's main() on `data` with 2 worker processes, in this process (the workers
    fork from it, no interpreter start-up; tests/launch/test_packaging_install.py runs the installed
    command). Returns (a CompletedProcess with the exit code and output the command gives, the JSON
    report or None)."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(config.replace("DATA", str(data)))
    report = tmp_path / "report.json"
    argv = ["--config", str(cfg), "--json", str(report), "--workers", "2", *args]
    from tools import check_dataset

    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(tmp_path), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = check_dataset.main(argv)
        except SystemExit as e:  # what the command does with it: a message on stderr, exit 1
            code = e.code if isinstance(e.code, int) else 1
            if not isinstance(e.code, int) and e.code is not None:
                print(e.code, file=sys.stderr)
    proc = subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())
    return proc, json.loads(report.read_text()) if report.exists() else None


CSV_CONFIG = CONFIG.replace("datasets: [{data_root: DATA}]",
                            "datasets: [{data_root: DATA, dataset_type: csv, metadata_path: lists/meta.csv}]")


def csv_set(root, rows):
    """clean_set's clips, listed by a CSV in a subfolder (paths relative to the CSV)."""
    clean_set(root)
    (root / "lists").mkdir()
    lines = [f"../{i}.mp4,{prompt},../{i}_person.png" for i, prompt in rows]
    (root / "lists/meta.csv").write_text("video,prompt,person\n" + "\n".join(lines) + "\n")
    return root / "lists/meta.csv"


def _cfg(tmp_path, config, *sets):
    path = tmp_path / "cfg.yaml"
    path.write_text(config.replace("DATA", str(tmp_path / "data")))
    return load_config(path, list(sets))


def vfr_clip(path, frames=24):
    """64x64 clip whose frames are 0.125 s apart for the first half, 0.1875 s after (a phone's VFR)."""
    import imageio_ffmpeg

    subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-loglevel", "error", "-y", "-f", "lavfi", "-i",
                    "testsrc=size=64x64:rate=16", "-frames:v", str(frames), "-vf",
                    "setpts='if(lt(N,12),2*N,24+3*(N-12))/16/TB'", "-fps_mode", "passthrough", "-c:v", "libx264",
                    "-pix_fmt", "yuv444p", str(path)], check=True)


def hostile_set(root):
    """clean_set plus one hostile input per sample -> {(sample, kind)} the validator must report."""
    clean_set(root)
    Image.fromarray(np.full((48, 40), 40000, np.uint16)).save(root / "000_person.png")  # 16-bit: loads fine
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.new("RGB", (40, 48), (9, 9, 9)).save(root / "001_person.png", exif=exif)  # rotated: loads fine
    expected = set()
    sample(root, "030")
    (root / "030.txt").write_bytes(b"caf\xe9 au lait")
    expected.add(("030", "not_utf8"))
    sample(root, "031")
    Image.new("RGB", (400, 300)).save(root / "031_person.png")
    expected.add(("031", "element_too_large"))
    sample(root, "032")
    (root.parent / "elsewhere.png").write_bytes((root / "032_person.png").read_bytes())
    (root / "032_person.png").unlink()
    (root / "032_person.png").symlink_to(root.parent / "elsewhere.png")
    expected.add(("032", "outside_root"))
    sample(root, "033")
    vfr_clip(root / "033.mp4")
    expected.add(("033", "variable_fps"))
    sample(root, "034", prompt=" ".join(f"word{i % 7}" for i in range(600)))
    expected.add(("034", "prompt_too_long"))
    sample(root, "035")
    Image.fromarray(np.full((48, 40), -5.0, np.float32)).save(root / "035_person.tiff")
    (root / "035_person.tiff").rename(root / "035_person.png")  # a float image with no 8-bit scale
    expected.add(("035", "element_unreadable"))
    sample(root, "036")
    for f in ("036.mp4", "036.txt", "036_person.png"):  # a name that is not UTF-8
        os.rename(root / f, os.fsencode(root) + b"/036\xff" + f[3:].encode())
    expected.add(("036\udcff", "video_unreadable"))
    # no sample has the optional object: a warning for each one discovery keeps (030 and 032 it refuses)
    expected |= {(ident, "element_absent") for ident in ("000", "001", "002", "003", "031", "033", "034", "035",
                                                          "036\udcff")}
    return root, expected


def defect_set(root):
    """Four clean samples, then one defect each; returns {(sample, kind)} the validator must report."""
    clean_set(root)
    expected = set()

    def expect(sample_id, kind):
        expected.add((sample_id, kind))

    (root / "010.mp4").write_bytes(b"\x00not a video" * 100)  # corrupt video
    (root / "010.txt").write_text("clip 010 corrupt")
    Image.new("RGB", (40, 48)).save(root / "010_person.png")
    expect("010", "video_unreadable")
    sample(root, "011", w=48)  # decord 0.6.0 cannot decode 48-px-wide videos
    expect("011", "video_unreadable")
    sample(root, "012", frames=5)  # too short for 9 frames
    expect("012", "too_short")
    sample(root, "013")
    (root / "013_object.png").write_bytes(b"garbage, not a png")  # unreadable element image
    expect("013", "element_unreadable")
    sample(root, "014", person=False)  # required element missing
    expect("014", "element_missing")
    sample(root, "015", prompt="   ")  # empty caption
    expect("015", "empty_caption")
    sample(root, "016", prompt="clip 000 shows its own thing")  # duplicate of 000's caption
    expect("016", "duplicate_caption")
    Image.new("RGB", (40, 48)).save(root / "099_person.png")  # no 099 video: orphan
    Image.new("RGB", (40, 48)).save(root / "001_persn.png")  # typo'd suffix: orphan
    expect("-", "orphan_file")
    sample(root, "017")
    clip(root / "017.mov", seed=17)  # two videos with id 017
    expect("017", "duplicate_id")
    sample(root, "018")
    Image.new("F", (40, 48), 0.5).save(root / "018_object.tiff")
    (root / "018_object.tiff").rename(root / "018_object.png")  # PIL reads by content: a float image (scale guessed)
    expect("018", "element_mode")
    sample(root, "019")
    Image.new("RGB", (8, 8)).save(root / "019_object.png")  # tiny reference
    expect("019", "element_small")
    sample(root, "020", fps=30)  # the others are 8 fps
    expect("020", "fps_outlier")
    sample(root, "021", w=160)  # 64x160 into 64x64: center_crop cuts 60%
    expect("021", "aspect")
    sample(root, "022", h=32, w=32)  # upscaled to 64x64
    expect("022", "upscaled")
    for ident in ("000", "001", "002", "003", "010", "011", "012", "015", "016", "020", "021", "022"):
        expect(ident, "element_absent")  # no optional object (014 and 017 never become samples): a warning
    return root, expected
