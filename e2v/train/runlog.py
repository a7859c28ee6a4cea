"""A run's logged scalars and images: `scalars.jsonl` on rank 0 (the exact values per step, which
resume checks and scripts read), and the boards `train.log_to` names: TensorBoard (<run>/tb),
Weights & Biases (the `wandb:` keys; its files under <run>/wandb), or both. Validation and the
visualizer write their images through `Log.boards` (the validation videos' mp4 too, which only
Weights & Biases shows; TensorBoard gets their frame strips). Used by train_e2v.py's loop and by
bench/bench.py, which measures the loop's logging with it."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

from e2v.runtime.runlock import cut_scalars

WANDB_FIX = "pip install wandb (or set train.log_to: tensorboard)"


def boards_of(cfg) -> tuple[str, ...]:
    """The boards a config logs to (train.log_to); TensorBoard without a config (the benchmark, tests)."""
    to = cfg.train.log_to if cfg is not None else "tensorboard"
    return {"tensorboard": ("tensorboard",), "wandb": ("wandb",), "both": ("tensorboard", "wandb")}[to]


class TensorBoard:
    """<run>/tb. What an earlier run in the folder logged from `first_step` on is purged."""

    def __init__(self, cfg, run_dir: Path, first_step: int):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tb"), purge_step=first_step)

    def scalars(self, step: int, values: dict) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)

    def image(self, tag: str, image_HWC, step: int) -> None:
        self.writer.add_image(tag, image_HWC, step, dataformats="HWC")

    def video_file(self, tag: str, path: Path, step: int) -> None:
        """Nothing: TensorBoard shows a validation video as its frame strip (an image)."""

    def close(self) -> None:
        self.writer.close()


class WandB:
    """A Weights & Biases run in <run>/wandb (the `wandb:` keys), the resolved config attached. Its
    id is kept in <run>/wandb/e2v_run_id, so a resumed run continues the same W&B run (W&B drops a
    step it already has). `mode: offline`, or WANDB_MODE=offline whatever the config says, touches
    no network."""

    def __init__(self, cfg, run_dir: Path, first_step: int):
        try:
            import wandb
        except ImportError as e:  # the start-up check (e2v/eval/preflight_deps.py) says so before any weight loads
            raise SystemExit(f"start-up check: train.log_to: {cfg.train.log_to} needs the wandb package ({e}); "
                             f"fix: {WANDB_FIX}") from None
        from e2v.config.load import to_dict

        folder = run_dir / "wandb"
        folder.mkdir(parents=True, exist_ok=True)
        id_file = folder / "e2v_run_id"
        run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4)  # W&B's id: [a-z0-9]
        id_file.write_text(run_id + "\n")
        w = cfg.wandb
        self.wandb = wandb
        # wandb.init's own argument would win over WANDB_MODE: the variable is read here, so that
        # WANDB_MODE=offline (a test, a machine without network) holds whatever the config says
        mode = os.environ.get("WANDB_MODE") or w.mode
        self.run = wandb.init(project=w.project, entity=w.entity, name=w.run_name or run_dir.name, dir=str(run_dir),
                              mode=mode, id=run_id, resume="allow", config=to_dict(cfg))

    def scalars(self, step: int, values: dict) -> None:
        self.run.log(values, step=step)

    def image(self, tag: str, image_HWC, step: int) -> None:
        self.run.log({tag: self.wandb.Image(image_HWC)}, step=step)

    def video_file(self, tag: str, path: Path, step: int) -> None:
        self.run.log({tag: self.wandb.Video(str(path), format="mp4")}, step=step)

    def close(self) -> None:
        self.run.finish()


BOARDS = {"tensorboard": TensorBoard, "wandb": WandB}


class Boards:
    """The configured boards as one writer: what Validator and Visualizer write images to (their
    `tb` argument; TensorBoard's add_image signature, HWC images only)."""

    def __init__(self, boards: list):
        self.boards = boards

    def add_image(self, tag: str, image_HWC, step: int, dataformats: str = "HWC") -> None:
        assert dataformats == "HWC", dataformats
        for b in self.boards:
            b.image(tag, image_HWC, step)

    def add_video_file(self, tag: str, path: Path, step: int) -> None:
        for b in self.boards:
            b.video_file(tag, path, step)

    def scalars(self, step: int, values: dict) -> None:
        for b in self.boards:
            b.scalars(step, values)

    def close(self) -> None:
        for b in self.boards:
            b.close()


class Log:
    """Rank 0's scalars: scalars.jsonl and the boards of `cfg` (train.log_to; TensorBoard without
    a config). What an earlier run in the folder logged from `first_step` on (past the checkpoint
    this run resumes from; everything for a fresh start) is dropped first (TensorBoard's
    purge_step, scalars.jsonl cut), so each step is logged once. Other ranks log nothing."""

    def __init__(self, run_dir: Path, rank: int, first_step: int = 0, cfg=None):
        self.boards = None
        self.jsonl = None
        if rank == 0:
            self.boards = Boards([BOARDS[name](cfg, Path(run_dir), first_step) for name in boards_of(cfg)])
            cut_scalars(run_dir / "scalars.jsonl", first_step)
            self.jsonl = open(run_dir / "scalars.jsonl", "a")  # exact values per step (resume checks, scripts)
        self.first_losses: list[float] = []
        self.losses: list[float] = []

    def scalars(self, step: int, values: dict) -> None:
        if self.boards is not None and values:
            self.boards.scalars(step, values)
            self.jsonl.write(json.dumps({"step": step, **values}) + "\n")
            self.jsonl.flush()

    def close(self):
        if self.boards is not None:
            self.boards.close()
            self.jsonl.close()
