"""Score a finished run's held-out videos at several noise seeds: how firm its validation numbers are.

    python bench/seed_fidelity.py --run runs/<run> --seeds 0 1 2

Validation generates each held-out sample's video (and, with `validation.subject_colour`, the
swapped-reference video) from ONE noise seed, `validation.seed`, which also picked the held-out
samples. This re-runs the run's last validation on its trained weights with the same held-out
samples and other noise seeds, and prints per seed and on average: the subject-colour match and
swap (e2v/eval/fidelity.py), and the shuffled-reference gap. Nothing is written to the run folder
(the videos go to a temporary folder, or --out).
"""

from __future__ import annotations

import argparse
import copy
import tempfile
from pathlib import Path

import torch

from e2v.config.load import load_config
from e2v.data.dataset import index_samples
from e2v.eval.sampling import load_trained
from e2v.eval.validation import Validator, split_held_out
from e2v.models.load import load_parts

KEYS = ("val/sample_reference_match", "val/sample_reference_swap", "val/reference_gap_shuffle_rel")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", type=Path, required=True, help="a finished run folder (config.yaml and lora/)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="noise seeds")
    p.add_argument("--out", type=Path, default=None, help="where the videos go (default: a temporary folder)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="score with another sampling setting, e.g. validation.image_guidance_scale=2 (repeatable)")
    args = p.parse_args(argv)
    if not (args.run / "lora").is_dir():  # a run stopped before its last step saved a checkpoint, not lora/
        raise SystemExit(f"{args.run}: no lora/ (the run stopped before its last step, or is not a run folder); "
                         f"export its last checkpoint first: python tools/export_lora.py "
                         f"{args.run}/checkpoints/latest --out {args.run}/lora")
    cfg = load_config(str(args.run / "config.yaml"), args.overrides, check_paths=False)
    if not cfg.validation.every_n_steps or cfg.validation.subject_colour is None:
        raise SystemExit(f"{args.run}: its config validates no held-out videos with validation.subject_colour")
    _, held_out = split_held_out(index_samples(cfg), cfg)  # the run's own held-out samples
    cfg.cache.enabled = False  # validation encodes the held-out samples from their pixels anyway
    parts = load_parts(cfg, device="cpu")
    model = load_trained(parts.transformer, args.run / "lora").float().eval()
    out = args.out or Path(tempfile.mkdtemp(prefix="seed_fidelity_"))
    rows = {}
    for seed in args.seeds:
        c = copy.deepcopy(cfg)
        c.validation.seed = seed  # the noise only: the held-out samples stay the run's
        v = Validator(c, held_out, parts, out / f"seed_{seed}", rank=0, device=torch.device("cpu"), dtype=torch.float32)
        with torch.no_grad():
            scalars = v.maybe_run(model, cfg.train.max_steps)
        rows[seed] = {k: scalars[k] for k in KEYS}
    mean = {k: sum(r[k] for r in rows.values()) / len(rows) for k in KEYS}
    print("seed  match  swap  shuffle gap (rel)")
    for seed, r in rows.items():
        print(f"{seed:>4}  {r[KEYS[0]]:.2f}   {r[KEYS[1]]:.2f}  {r[KEYS[2]]:+.1%}")
    print(f"mean  {mean[KEYS[0]]:.2f}   {mean[KEYS[1]]:.2f}  {mean[KEYS[2]]:+.1%}")
    return {"seeds": rows, "mean": mean}


if __name__ == "__main__":
    main()
