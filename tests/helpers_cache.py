"""What tests/unit/test_cache.py and tests/launch/test_cache_runs.py share."""

import os

import numpy as np

# Put on PYTHONPATH, Python imports this as `sitecustomize` in every process (the deepspeed
# launcher and each rank): constructing the VAE, UMT5 or CLIP vision model raises, whether through
# from_pretrained or e2v's tiny builders (both call the class). Each process logs its pid, so the
# test knows the guard was active in the ranks.
ENCODER_GUARD = """
import importlib.abc
import importlib.machinery
import os
import sys

GUARDED = {"diffusers.models.autoencoders.autoencoder_kl_wan": ("AutoencoderKLWan",),
           "transformers.models.umt5.modeling_umt5": ("UMT5EncoderModel",),
           "transformers.models.clip.modeling_clip": ("CLIPVisionModel", "CLIPVisionModelWithProjection")}


def _forbid(cls):
    def __init__(self, *args, **kwargs):
        raise RuntimeError(f"encoder guard: {cls.__name__} constructed")
    cls.__init__ = __init__


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    # patch when the module is first imported, so processes that never import it pay nothing
    def find_spec(self, name, path, target=None):
        if name not in GUARDED:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            for cls in GUARDED[name]:
                _forbid(getattr(module, cls))
        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _PatchAfterImport())
with open(os.environ["E2V_GUARD_LOG"], "a") as f:
    f.write(f"{os.getpid()}\\n")
"""


def encoder_guard_env(tmp) -> dict:
    guard = tmp / "encoder_guard"
    guard.mkdir()
    (guard / "sitecustomize.py").write_text(ENCODER_GUARD)
    path = os.pathsep.join(p for p in (str(guard), os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path, "E2V_GUARD_LOG": str(guard / "pids.txt")}


def make_mixed_dataset(root, n_square=4, n_wide=4, bad_element=False):
    """Square 17-frame clips and wide 9-12-frame clips (two buckets), each with a person image;
    bad_element adds a square sample whose image is unreadable (found at load, not at indexing)
    and one with no person image at all (the required element: left out at indexing)."""
    from PIL import Image

    from e2v.data.demo import write_video

    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    specs = [(17, 64, 64)] * n_square + [(9 + i % 4, 64, 112) for i in range(n_wide)]
    for i, (f, h, w) in enumerate(specs):
        base = rng.integers(0, 255, 3)
        frames = np.clip(base + rng.integers(-40, 40, (f, h, w, 3)), 0, 255).astype(np.uint8)
        write_video(root / f"{i:03d}.mp4", frames)
        (root / f"{i:03d}.txt").write_text(f"clip number {i} of colour {base.tolist()}")
        Image.fromarray(rng.integers(0, 255, (40, 32, 3), dtype=np.uint8)).save(root / f"{i:03d}_person.png")
    if bad_element:
        write_video(root / "bad.mp4", np.zeros((17, 64, 64, 3), np.uint8))
        (root / "bad.txt").write_text("a sample whose reference image is broken")
        (root / "bad_person.png").write_bytes(b"not a png")
        write_video(root / "noref.mp4", np.zeros((17, 64, 64, 3), np.uint8))
        (root / "noref.txt").write_text("a sample without its required person image")
    return root
