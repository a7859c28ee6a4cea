"""What `--resume` means, decided before anything is loaded, in one line each:

- `--resume latest`: the run must have an intact checkpoint (checkpoint.find_resume picks it);
  nothing to resume stops the run with the fix. Without `run_id` the run is the one of this
  config's name that saved a checkpoint last (folders without one, left by a failed start, are
  passed over and named), and the run says which and why.
- `--resume auto`: the same when there is a checkpoint, else a fresh start, said as such (for job
  scripts that requeue themselves).
- `--resume PATH`: that checkpoint folder.

The config the checkpoint was trained with (its run's `config.yaml`, read before the new one is
written) is compared with the one given now, key by key:
- a key that changes the shape or layout of what the checkpoint holds (the model, the LoRA, what
  trains in full, the conditioning type, precision, the DeepSpeed and parallel layout) stops the
  run naming each key, as DeepSpeed would otherwise stop with a shape-mismatch traceback;
- a key stored inside the optimizer state (lr, betas, eps, weight decay) stops it too: DeepSpeed
  restores the saved values, so the new one would be recorded but not trained with;
- the schedule (max_steps, warmup_steps, lr_scheduler) is computed from the config at every step,
  so a change there is applied, and named; so is every other changed key (data, validation,
  logging, checkpointing).
The run's `config.yaml` is then written: it records what actually trains.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from e2v.runtime import distributed
from e2v.runtime.log import get_logger
from e2v.train import checkpoint as ckpt

log = get_logger("e2v")

# keys whose change makes the checkpoint's tensors or their partitioning unusable
STRUCTURAL = ("model.", "lora.", "e2v_type", "train.trainable", "train.mixed_precision", "deepspeed.", "parallel.",
              "conditioning.")
# keys the optimizer state carries (DeepSpeed's load_checkpoint restores them from the file)
IN_OPTIMIZER = ("train.lr", "train.betas", "train.eps", "train.weight_decay")
NOT_COMPARED = ("run_id", "output_dir")
MODES = ("latest", "auto")


class ResumeError(RuntimeError):
    """`--resume` cannot do what it was asked: the message names why and the fix."""


def flatten(d, prefix: str = "") -> dict:
    out = {}
    for k, v in (d or {}).items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _matches(key: str, prefixes: tuple) -> bool:
    """A prefix ending in '.' matches the keys under it; any other matches the key and its sub-keys."""
    return any(key.startswith(p) if p.endswith(".") else key == p or key.startswith(p + ".") for p in prefixes)


def config_changes(saved: dict, now: dict) -> tuple[list[str], list[str], list[str]]:
    """(structural, in-optimizer, applied) changes between the checkpoint's config and this one,
    each as `key: old -> new`."""
    a, b = flatten(saved), flatten(now)
    structural, optimizer, applied = [], [], []
    for key in sorted(set(a) | set(b)):
        if _matches(key, NOT_COMPARED) or a.get(key) == b.get(key):
            continue
        line = f"{key}: {a.get(key, '(unset)')!r} -> {b.get(key, '(unset)')!r}"
        (structural if _matches(key, STRUCTURAL) else optimizer if _matches(key, IN_OPTIMIZER) else applied).append(line)
    return structural, optimizer, applied


def check_config(saved_config: Path, now: dict) -> list[str]:
    """ResumeError naming the keys when the checkpoint cannot be continued with this config; else
    the changed keys that will be applied (empty when none). A missing saved config compares nothing."""
    if not saved_config.is_file():
        return []
    saved = yaml.safe_load(saved_config.read_text()) or {}
    structural, optimizer, applied = config_changes(saved, now)
    if structural:
        raise ResumeError(
            f"cannot resume: the checkpoint was trained with another model layout ({'; '.join(structural)}). "
            f"Resume with the config of {saved_config} (drop those --set), or start a new run (--set run_id=NEW)")
    if optimizer:
        raise ResumeError(
            f"cannot resume with a changed optimizer setting ({'; '.join(optimizer)}): the checkpoint's optimizer "
            "state restores the saved value, so the new one would not be trained with. Drop those --set to "
            "resume as saved, or start a new run (--set run_id=NEW)")
    return applied


def run_to_resume(root: Path, stem: str) -> tuple[Path | None, str]:
    """(run folder, why) for `--resume latest|auto` without `run_id`: of the runs of this config
    (`root/<stem>-*`), the one whose newest complete checkpoint was saved last. A folder with no
    complete checkpoint (a start that stopped before its first save: a config or data error, a
    kill) is passed over and named, so a failed start never hides the run it was meant to continue.
    None when no run holds a checkpoint; `why` then says what was looked at."""
    saved, empty = [], []  # (time of the newest checkpoint, run), runs with none
    for run in sorted(p for p in Path(root).glob(f"{stem}-*") if p.is_dir()):
        found = ckpt.complete_checkpoints(run / "checkpoints")
        if found:
            saved.append((found[-1].stat().st_mtime, run, found[-1].name))
        else:
            empty.append(run)
    skipped = (f"; passed over {len(empty)} folder(s) without a checkpoint: "
               f"{', '.join(str(r) for r in empty[-3:])}{' ...' if len(empty) > 3 else ''}") if empty else ""
    if not saved:
        return None, f"no run of {stem} in {root}/ holds a checkpoint{skipped}"
    _, run, step = max(saved)
    return run, (f"run {run}: of the runs of {stem} in {root}/, the one that saved last ({step}){skipped}. "
                 f"Set run_id to pick another")


def nothing_to_resume(mode: str, run_dir: Path | None, where: str) -> str:
    """The line for a run with no intact checkpoint: ResumeError text for `latest`, a note for `auto`."""
    if mode == "latest":
        raise ResumeError(f"--resume latest: nothing to resume ({where}). Start without --resume, or use "
                          "--resume auto to resume only when there is a checkpoint")
    return f"--resume auto: nothing to resume ({where}): starting at step 0"


def pick_checkpoint(mode: str | None, config: dict, run_dir: Path, rank: int) -> Path | None:
    """The checkpoint `--resume mode` continues from, checked against this config (as a dict), or
    None for a fresh start; every rank gets rank 0's verdict, so all stop together. Call it before
    the run's config.yaml is rewritten: that file is what the checkpoint was trained with."""
    if not mode:
        return None
    try:
        found = ckpt.find_resume("latest" if mode in MODES else mode, run_dir)  # a collective (checksums)
    except FileNotFoundError as e:
        raise SystemExit(f"resume error: {e}")
    verdict = None
    if rank == 0:
        try:
            if found is None:
                verdict = ("note", nothing_to_resume(mode, run_dir, f"no intact checkpoint in {run_dir / 'checkpoints'}"))
            else:
                applied = check_config(found.parent.parent / "config.yaml", config)
                verdict = ("note", f"resume: applying the changed key(s) {'; '.join(applied)}" if applied else "")
        except ResumeError as e:
            verdict = ("error", str(e))
    kind, line = distributed.broadcast(verdict, rank)
    if kind == "error":
        raise SystemExit(f"resume error: {line}")
    if line:
        log.info(line)
    return found
