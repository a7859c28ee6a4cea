"""What tests/unit/test_opens2v.py and tests/launch/test_opens2v_runs.py share."""

from __future__ import annotations

import json

import imageio_ffmpeg
import numpy as np
import pytest
from PIL import Image

W, H, FRAMES = 96, 64, 24


CROP = [8, 88, 0, 64]  # the dataset's [s_x, e_x, s_y, e_y]: an 80 x 64 box


CH, CW = CROP[3] - CROP[2], CROP[1] - CROP[0]


CUT, FACE_CUT, ANN_FRAME = [0, 24], [4, 22], 6


def write_clip(path, seed):
    """A 24-frame clip whose brightness climbs with the frame index (a wrong frame shows)."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 160, (H // 8, W // 8, 3)).repeat(8, 0).repeat(8, 1)
    writer = imageio_ffmpeg.write_frames(str(path), (W, H), fps=8, codec="libx264", pix_fmt_out="yuv444p",
                                         macro_block_size=1, ffmpeg_log_level="error",
                                         output_params=["-crf", "12", "-threads", "1"])
    writer.send(None)
    for i in range(FRAMES):
        writer.send(np.ascontiguousarray(np.clip(base + 4 * i, 0, 255).astype(np.uint8)))
    writer.close()


def box_mask(y1, y2, x1, x2, ellipse=False):
    m = np.zeros((CH, CW), np.uint8)
    if ellipse:  # a non-rectangular mask: alpha must follow its outline, not its box
        yy, xx = np.mgrid[:CH, :CW]
        cy, cx, ry, rx = (y1 + y2) / 2, (x1 + x2) / 2, (y2 - y1) / 2, (x2 - x1) / 2
        m[((yy - cy) / ry) ** 2 + ((xx - cx) / rx) ** 2 <= 1] = 1
    else:
        m[y1:y2, x1:x2] = 1
    return m


def rle(mask):
    from pycocotools import mask as mask_util

    r = mask_util.encode(np.asfortranarray(mask))
    return {"size": [int(v) for v in r["size"]], "counts": r["counts"].decode("utf-8"), "score": [0.99]}


def entry(path, masks, *, crop=CROP, ann_frame=ANN_FRAME):
    """One entry as the dataset's JSON parts hold it; masks: (class_name, mask, gme, aes)."""
    return {
        "metadata": {"cut": CUT, "crop": crop, "tech": 2.0, "motion": 0.01, "fps": 8.0, "num_frames": FRAMES,
                     "resolution": {"height": H, "width": W}, "cap": [f"Short caption of {path}."], "path": path,
                     "aesthetic": 5.0, "face_cut": FACE_CUT, "face_cap_qwen": f"The video features the clip {path}."},
        "word_tags": {"background": ["grassy area"], "subject": ["woman"], "object": ["cup"],
                      "pre_define": ["person", "human head"]},
        "annotation": {
            "ann_frame_data": {
                "ann_frame_idx": ann_frame, "box_format": "xyxy", "img_width": crop[1] - crop[0],
                "img_height": crop[3] - crop[2], "foreground_ase_score": 5.0, "background_ase_score": 4.5,
                "annotations": [{"class_name": c, "bbox": [0.0, 0.0, 1.0, 1.0], "gme_score": g, "aes_score": a}
                                for c, _, g, a in masks]},
            "mask_map": {str(i + 1): {"class_name": c} for i, (c, _, _, _) in enumerate(masks)},
            "mask_annotation": {str(ann_frame): {str(i + 1): rle(m) for i, (_, m, _, _) in enumerate(masks)}},
        },
    }


PERSON_A = box_mask(8, 56, 10, 40, ellipse=True)


CUP_A = box_mask(40, 56, 50, 70)


def make_fixture(root):
    """root/Jsons/total_part1.json, its clips in root/Videos/total_part1/, a generated-views folder
    and a cross-video pairs file: two good entries, one with generated views, a bad RLE, a crop box
    outside the clip, a missing clip."""
    videos = root / "Videos" / "total_part1"
    videos.mkdir(parents=True)
    for i, name in enumerate(["a", "b", "c", "d"]):
        write_clip(videos / f"{name}.mp4", seed=i)
    big = box_mask(0, 64, 0, 60)  # 75% of the frame: no background is filled
    entries = {
        "clip_a_part1": entry("a.mp4", [("person", PERSON_A, 0.9, 5.0), ("cup", CUP_A, 0.8, 4.8),
                                        ("glasses", box_mask(10, 14, 20, 30), 0.2, 4.0),  # gme below min_gme
                                        ("grassy area", box_mask(56, 64, 0, 80), 0.9, 4.0),  # a background tag
                                        ("woman", box_mask(9, 50, 12, 38), 0.7, 5.0)]),  # a second subject
        "clip_b_part1": entry("b.mp4", [("woman", big, 0.9, 5.0)]),
        "clip_c_nexus": entry("c.mp4", [("man", box_mask(4, 40, 4, 40), 0.9, 5.0)]),
        "bad_rle": entry("d.mp4", [("person", PERSON_A, 0.9, 5.0)]),
        "crop_outside": entry("d.mp4", [("person", box_mask(8, 56, 10, 40, True), 0.9, 5.0)]),
        "missing_video": entry("gone.mp4", [("person", PERSON_A, 0.9, 5.0)]),
    }
    counts = entries["bad_rle"]["annotation"]["mask_annotation"][str(ANN_FRAME)]["1"]["counts"]
    entries["bad_rle"]["annotation"]["mask_annotation"][str(ANN_FRAME)]["1"]["counts"] = counts[:-3]
    wide = [0, 200, 0, 64]  # 200 px wide on a 96 px clip; the masks match the box, so only the clip shows it
    entries["crop_outside"] = entry("d.mp4", [("person", np.pad(PERSON_A, ((0, 0), (0, 120))), 0.9, 5.0)], crop=wide)
    (root / "Jsons").mkdir()
    (root / "Jsons" / "total_part1.json").write_text(json.dumps(entries, indent=1))
    views = root / "gpt_frames" / "clip_c_nexus"
    views.mkdir(parents=True)
    Image.new("RGB", (30, 40), (200, 10, 10)).save(views / "0_man.png")
    Image.new("RGB", (80, 64), (0, 0, 0)).save(views / "main_image.png")  # the frame they were made from
    pairs = {"clip": [{"cur_id": "total_part1/clip_b_part1", "aft_id": "total_part1/clip_a_part1",
                       "cur_class_id": "1", "aft_class_id": "1", "cur_class_name": "woman",
                       "aft_class_name": "person", "text_similarity": 0.7, "image_similarity": 0.99,
                       "cur_frame_idx": ANN_FRAME, "aft_frame_idx": ANN_FRAME}]}
    (root / "pairs.json").write_text(json.dumps(pairs))
    return root


@pytest.fixture(scope="module")
def fixture_root(tmp_path_factory):
    return make_fixture(tmp_path_factory.mktemp("opens2v"))


def dataset_sets(root, **opts) -> list[str]:
    ds = {"data_root": str(root), "dataset_type": "opens2v", "metadata_path": "Jsons/total_part*.json",
          "media_root": f"{root}/Videos/{{part}}",
          "opens2v": {"min_gme": 0.3, "nexus_images_root": f"{root}/gpt_frames", **opts}}
    return [f"data.datasets=[{json.dumps(ds)}]"]
