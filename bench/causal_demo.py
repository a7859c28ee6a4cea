"""The causal task's demo data and its score (make demo-causal; docs/causal.md, "The demo").

    python bench/causal_demo.py prepare --data demo_causal          # after make_demo_dataset.py --write-meta
    python bench/causal_demo.py score --run runs/causal_tiny-<stamp> --seeds 0 1 2

prepare: the demo's clips (e2v/data/demo.py) with prompts that name the subject's colour, as a CSV
beside them (`causal_metadata.csv`, columns video,prompt): "a red shape moves across the scene". The
name is the hue's nearest of six (red, yellow, green, cyan, blue, magenta, 60 degrees apart; the
tiny tokenizer knows them); the demo draws every hue, so the subjects of one name spread +-30 degrees.

score: for each noise seed, the trained run samples "a <name> shape moves across the scene" for each
colour name, `--per-colour` times (4: 24 videos a seed, so a seed's figure moves in steps of 1/24, not
1/6), block by block in its few steps (e2v.eval.sampling.generate: CausVid's rollout, with the run's
validation.guidance_scale: classifier-free guidance against the empty prompt, which caption dropout
trains; 1 is none, CausVid's own setting; and its causal.renoise between the steps),
the subject's colour is read off the video (e2v.eval.fidelity.subject_colour: the blocks departing most
from each place's median over the frames), and it is a hit when that colour is nearer the mean colour
of the training subjects of the prompted name than of any other name. Chance is 1/6. The same rule on
the training clips themselves (their VAE round trip: what a perfect model could reach) and on the
untrained transformer (the floor) is printed beside it. Nothing is written to the run folder.

Per block: the same hit read on each causal block's frames alone (the background still the whole
video's median), so "first" and "last" say whether the colour is there when the rollout starts and
still there when it ends, and "kept" is the share hit in every block. `--lora` scores another weights
folder of the run (a checkpoint exported by tools/export_lora.py); `--set` changes a sampling key.
"""

from __future__ import annotations

import argparse
import colorsys
import csv
import json
from pathlib import Path

import numpy as np
import torch

from e2v.conditioning.encode import encode_video
from e2v.config.load import load_config
from e2v.data.dataset import E2VDataset, index_samples
from e2v.eval.fidelity import nearest, subject_colour
from e2v.eval.sampling import decode, generate, load_trained
from e2v.models.load import load_parts
from e2v.runtime.device import as_pixels

COLOURS = ("red", "yellow", "green", "cyan", "blue", "magenta")  # hue 0, 60, ... 300 degrees
METADATA = "causal_metadata.csv"
TEMPLATE = "a {} shape moves across the scene"  # every word in the tiny tokenizer's vocabulary


def colour_name(rgb) -> str:
    """The nearest of COLOURS to an RGB colour's hue."""
    hue = colorsys.rgb_to_hsv(*(c / 255 for c in rgb))[0]
    return COLOURS[round(hue * 6) % 6]


def prepare(data: Path) -> dict[str, list]:
    """Write data/causal_metadata.csv from the demo's ID.json files; returns name -> subject colours."""
    metas = sorted(data.glob("*.json"))
    if not metas:
        raise SystemExit(f"{data}: no ID.json (make the demo with --write-meta: python tools/make_demo_dataset.py "
                         f"{data} --frames 21 --write-meta)")
    rows, by_name = [], {n: [] for n in COLOURS}
    for path in metas:
        meta = json.loads(path.read_text())
        name = colour_name(meta["subject"]["colour"])
        by_name[name].append(meta["subject"]["colour"])
        rows.append({"video": f"{meta['id']}.mp4", "prompt": TEMPLATE.format(name)})
    with (data / METADATA).open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["video", "prompt"])
        writer.writeheader()
        writer.writerows(rows)
    print(f"{data / METADATA}: {len(rows)} clips; " + ", ".join(f"{n} {len(c)}" for n, c in by_name.items()))
    return by_name


def class_colours(data: Path) -> list[np.ndarray]:
    """The mean subject colour of each name's training clips (the candidates a measured colour is matched to)."""
    by_name = {n: [] for n in COLOURS}
    for path in sorted(data.glob("*.json")):
        colour = json.loads(path.read_text())["subject"]["colour"]
        by_name[colour_name(colour)].append(colour)
    return [np.mean(by_name[n], axis=0) if by_name[n] else np.full(3, np.nan) for n in COLOURS]


def hits(videos: list[np.ndarray], owners: list[int], candidates: list[np.ndarray]) -> float:
    return float(np.mean([nearest(subject_colour(v), candidates) == o for v, o in zip(videos, owners)]))


def block_frames(cfg, num_frames: int) -> list[range]:
    """The pixel frames of each causal block (e2v.models.causal.block_spans over the latent frames):
    latent frame 0 is pixel frame 0, latent frame k > 0 the VAE's 4 frames 4k-3..4k."""
    from e2v.models.causal import block_spans

    spans = block_spans((num_frames - 1) // 4 + 1, cfg.causal.frames_per_block, cfg.causal.independent_first_frame)
    return [range(0 if a == 0 else 4 * a - 3, 4 * (z - 1) + 1) for a, z in spans]


def block_hits(videos: list[np.ndarray], owners: list[int], candidates: list[np.ndarray], cfg) -> np.ndarray:
    """[video, block] booleans: the subject of that block's frames in the owner's colour."""
    rows = []
    for video, owner in zip(videos, owners):
        background = np.median(video, axis=0).astype(np.uint8)
        rows.append([nearest(subject_colour(video[list(frames)], background), candidates) == owner
                     for frames in block_frames(cfg, len(video))])
    return np.asarray(rows)


@torch.no_grad()
def tint_hits(videos: list[np.ndarray], owners: list[int], tints: list[np.ndarray]) -> float:
    """The share of videos whose mean colour (every pixel of every frame) is nearest the mean colour of
    the prompted name's training clips: what a regression's optimum, the mean clip given the prompt,
    shows of the name even where no subject stands out."""
    return float(np.mean([nearest(v.reshape(-1, 3).mean(0), tints) == o for v, o in zip(videos, owners)]))


def name_tints(clips: list[np.ndarray], owners: list[int]) -> list[np.ndarray]:
    """Each name's mean colour over its clips' every pixel."""
    return [np.mean([c.reshape(-1, 3).mean(0) for c, o in zip(clips, owners) if o == k], axis=0)
            for k in range(len(COLOURS))]


def sampled(model, parts, cfg, seed: int, per_colour: int) -> list[np.ndarray]:
    """`per_colour` videos of each colour name (COLOURS in turn, repeated) from noise seed `seed`:
    one batch, each video its own noise from the seed's generator; uint8 [F,H,W,3]."""
    latents = generate(model, parts, cfg, [TEMPLATE.format(n) for n in COLOURS] * per_colour, seed=seed,
                       guidance_scale=cfg.validation.guidance_scale)
    return list(decode(latents, parts.vae))


@torch.no_grad()
def round_trips(parts, cfg, limit: int = 64) -> tuple[list[np.ndarray], list[int]]:
    """The training clips through the VAE (encode, decode) with their names' indexes."""
    samples = index_samples(cfg, verbose=False)[:limit]
    data = E2VDataset(cfg, samples)
    videos, owners = [], []
    for i in range(len(samples)):
        item = data[i]
        videos.append(decode(encode_video(as_pixels(item["video"][None]), parts.vae), parts.vae)[0])
        owners.append(COLOURS.index(item["prompt"].split()[1]))
    return videos, owners


def score(run: Path, seeds: list[int], lora: Path | None = None, overrides: list[str] = (),
          per_colour: int = 4) -> dict:
    cfg = load_config(str(run / "config.yaml"), overrides=list(overrides), check_paths=False)
    cfg.cache.enabled = False
    data = Path(cfg.data.datasets[0].data_root)
    candidates = class_colours(data)
    parts = load_parts(cfg, device="cpu")
    untrained = parts.transformer.float().eval()
    trained = load_trained(load_parts(cfg, device="cpu", with_encoders=False).transformer,
                           lora or run / "lora").float().eval()
    owners = list(range(len(COLOURS))) * per_colour
    clips, clip_owners = round_trips(parts, cfg)
    tints = name_tints(clips, clip_owners)
    rows = {}
    for seed in seeds:
        videos, floor = sampled(trained, parts, cfg, seed, per_colour), sampled(untrained, parts, cfg, seed, per_colour)
        blocks = block_hits(videos, owners, candidates, cfg)
        rows[seed] = (hits(videos, owners, candidates), hits(floor, owners, candidates), blocks[:, 0].mean(),
                      blocks[:, -1].mean(), blocks.all(axis=1).mean(), tint_hits(videos, owners, tints),
                      tint_hits(floor, owners, tints))
    ceiling = hits(clips, clip_owners, candidates)
    clip_blocks = block_hits(clips, clip_owners, candidates, cfg)
    print(f"guidance {cfg.validation.guidance_scale:g}, renoise {cfg.causal.renoise}, listed timesteps "
          f"{cfg.flow.denoising_step_list}, "
          f"{per_colour} video(s) of each of the {len(COLOURS)} names per seed")
    print("      the subject in the prompted colour (chance 1/6 = 0.17)       the mean colour nearest the name's clips'")
    print("seed  trained  untrained  first block  last block  kept          trained  untrained")
    for seed, r in rows.items():
        print(f"{seed:>4}  {r[0]:7.2f}  {r[1]:9.2f}  {r[2]:11.2f}  {r[3]:10.2f}  {r[4]:4.2f}          {r[5]:7.2f}  {r[6]:9.2f}")
    m = np.mean(list(rows.values()), axis=0)
    print(f"mean  {m[0]:7.2f}  {m[1]:9.2f}  {m[2]:11.2f}  {m[3]:10.2f}  {m[4]:4.2f}          {m[5]:7.2f}  {m[6]:9.2f}")
    print(f"the training clips' VAE round trip ({len(clips)}): subject {ceiling:.2f} (first block "
          f"{clip_blocks[:, 0].mean():.2f}, last {clip_blocks[:, -1].mean():.2f}, kept {clip_blocks.all(1).mean():.2f}), "
          f"mean colour {tint_hits(clips, clip_owners, tints):.2f}")
    return {"seeds": rows, "mean": float(m[0]), "first": float(m[2]), "last": float(m[3]), "kept": float(m[4]),
            "tint": float(m[5]), "ceiling": ceiling, "ceiling_blocks": clip_blocks.mean(0).tolist()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="write the colour-naming CSV beside the demo's clips")
    prep.add_argument("--data", type=Path, required=True)
    sc = sub.add_parser("score", help="the subject-colour hit rate of a trained causal run's samples")
    sc.add_argument("--run", type=Path, required=True)
    sc.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    sc.add_argument("--per-colour", type=int, default=4, help="videos of each colour name per seed (default 4)")
    sc.add_argument("--lora", type=Path, help="the weights to score (default: the run's lora/ folder)")
    sc.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override for sampling")
    args = p.parse_args(argv)
    if args.command == "prepare":
        prepare(args.data)
    else:
        score(args.run, args.seeds, args.lora, args.set, args.per_colour)


if __name__ == "__main__":
    main()
