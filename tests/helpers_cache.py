"""What tests/unit/test_cache.py and tests/launch/test_cache_runs.py share."""

import os

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
