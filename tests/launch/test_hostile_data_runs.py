"""The CLIP image processor in a fresh interpreter that can import a torchvision: transformers 5
decides which processor class to give when it first looks for torchvision, so the check needs an
interpreter of its own. The other hostile-data tests are in tests/unit/test_hostile_data.py."""

import os
import subprocess
import sys

from helpers import ROOT

# --- the CLIP image processor ------------------------------------------------------------------

STUB_CHECK = """
import sys
sys.path.insert(0, {root!r})
from transformers.utils import is_torchvision_available
from transformers.image_processing_backends import PilBackend
from e2v.models.parts import clip_image_processor

assert is_torchvision_available(), "the stub must make transformers see torchvision"
from transformers import CLIPImageProcessor
assert not issubclass(CLIPImageProcessor, PilBackend), "transformers' default is then the torchvision one"
built = clip_image_processor(size={{"shortest_edge": 32}}, crop_size={{"height": 32, "width": 32}})
built.save_pretrained({folder!r})
loaded = clip_image_processor({folder!r})
print(type(built).__name__, type(loaded).__name__, isinstance(built, PilBackend), isinstance(loaded, PilBackend))
"""


def test_clip_processor_is_the_pil_one_even_when_torchvision_is_importable(tmp_path):
    """transformers 5 picks the torchvision-backed CLIPImageProcessor whenever torchvision can be
    found; a stub package on the path is enough for it to look. Ours stays the PIL one."""
    tv = tmp_path / "stub/torchvision"
    (tv / "transforms/v2").mkdir(parents=True)
    (tv / "__init__.py").write_text("__version__ = '0.99.0'\n")
    (tv / "transforms/__init__.py").write_text(
        "import enum\nInterpolationMode = enum.Enum('InterpolationMode', "
        "'NEAREST NEAREST_EXACT BOX BILINEAR HAMMING BICUBIC LANCZOS')\n")
    (tv / "transforms/functional.py").write_text("def pil_to_tensor(img):\n    raise RuntimeError('stub')\n")
    (tv / "io.py").write_text("")
    (tv / "transforms/v2/__init__.py").write_text("")
    (tv / "transforms/v2/functional.py").write_text("")
    code = STUB_CHECK.format(root=str(ROOT), folder=str(tmp_path / "proc"))
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "stub")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-2:] == ["True", "True"], proc.stdout
