"""The frozen base in fp8 (`model.base_dtype: fp8`): each frozen Linear of the transformer blocks
stores its weight as float8 e4m3 with one power-of-two scale per output channel, and computes in the
activations' dtype (bf16 in training) by upcasting that one layer's weight inside its forward. A
14B transformer's blocks then take ~1 byte per weight on the GPU instead of 2 (docs/memory.md).

Shapes: x_BLI input activations (I in_features), w8_OI the stored fp8 weight (O out_features),
scale_O1 the per-channel scale, y_BLO the output.

Why these choices (measured in tests/unit/test_fp8.py, stated in docs/memory.md):
- per output channel, not per tensor: the rows of a Wan weight differ in range, and one scale per
  row keeps each row's largest value at the top of e4m3's range; the error is lower than per tensor.
- power-of-two scales: fp8 x 2^k is exactly a bf16 (and fp32) number, so the weight a layer
  computes with is exactly the dequantised weight, in any dtype a cast gives it; e4m3's relative
  rounding does not depend on the scale, so a power of two costs nothing against amax / 448.
- the fp8 bits live in a uint8 buffer: `module.bfloat16()`, DeepSpeed's bf16 cast and the
  optimizer leave integer tensors alone (a float8 tensor is a floating-point one and would be cast
  to bf16, doubling it). Non-persistent: checkpoints and exports never carry the base (resume
  re-quantises it from the pretrained weights, which gives the same bits).
- backward dequantises again instead of saving the bf16 weight for the input gradient: autograd
  keeps only the input and the 1-byte weight, so no bf16 copy of the base ever accumulates.

peft wraps an Fp8Linear like any nn.Linear (it is one by class); the LoRA adds its own term in the
activations' dtype, so LoRA training against an fp8 base is the ordinary LoRA computation with the
base weight rounded to fp8.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448: e4m3's largest finite value
# The modules an fp8 base stores in fp8: the Linear layers inside the transformer blocks (attention
# projections, image attention, feed-forward), >98% of a Wan transformer's weights. The embeddings,
# the time projection and the output head stay in the training dtype (small, and the first and last
# layers are the most sensitive to rounding).
BLOCK_LINEAR = re.compile(r"(^|\.)blocks\.\d+\.")


def quantize_weight(w_OI: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the fp8 bits as uint8, the fp32 power-of-two scale per output channel) of a weight, such that
    dequantize(bits, scale) = fp8(w / scale) * scale, with each row's largest |w| in (224, 448]."""
    w_OI = w_OI.detach().float()
    amax_O1 = w_OI.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    scale_O1 = torch.exp2(torch.ceil(torch.log2(amax_O1 / FP8_MAX)))
    w8_OI = (w_OI / scale_O1).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return w8_OI.view(torch.uint8), scale_O1


def dequantize(w8_OI: torch.Tensor, scale_O1: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight a layer computes with, in `dtype` (exact: fp8 x 2^k is representable in bf16)."""
    return w8_OI.view(FP8).to(dtype) * scale_O1.to(dtype)


class _Fp8Linear(torch.autograd.Function):
    """y = x W^T + b with W dequantised in the forward and again in the backward (only the input
    gradient is computed: the base is frozen)."""

    @staticmethod
    def forward(ctx, x_BLI, w8_OI, scale_O1, bias_O):
        ctx.save_for_backward(w8_OI, scale_O1)
        return F.linear(x_BLI, dequantize(w8_OI, scale_O1, x_BLI.dtype), bias_O)

    @staticmethod
    def backward(ctx, grad_BLO):
        w8_OI, scale_O1 = ctx.saved_tensors
        return grad_BLO @ dequantize(w8_OI, scale_O1, grad_BLO.dtype), None, None, None


class Fp8Linear(torch.nn.Linear):
    """A frozen nn.Linear whose weight is stored in fp8 (module docstring). It has no `weight`
    parameter; `bias` stays a frozen parameter in the training dtype."""

    def __init__(self, w8_OI: torch.Tensor, scale_O1: torch.Tensor, bias_O: torch.Tensor | None):
        torch.nn.Module.__init__(self)  # not nn.Linear's: it would allocate a full-precision weight
        self.out_features, self.in_features = w8_OI.shape
        self.register_buffer("weight_fp8", w8_OI, persistent=False)
        self.register_buffer("weight_scale", scale_O1, persistent=False)
        self.bias = None if bias_O is None else torch.nn.Parameter(bias_O, requires_grad=False)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear) -> "Fp8Linear":
        if linear.weight.is_meta:  # a plan on the meta device: shapes only
            w8, scale = (torch.empty(linear.weight.shape, dtype=torch.uint8, device="meta"),
                         torch.empty(linear.out_features, 1, device="meta"))
        else:
            w8, scale = quantize_weight(linear.weight)
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(w8, scale, bias)

    @property
    def weight(self) -> torch.Tensor:
        """The stored fp8 bits (uint8). peft reads `.weight` for the device and dtype of the layer it
        wraps: an integer dtype tells it to leave its adapter's dtype alone; code that would write a
        merged weight into it fails instead of changing a temporary."""
        return self.weight_fp8

    def dequantized(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return dequantize(self.weight_fp8, self.weight_scale, dtype)

    def forward(self, x_BLI: torch.Tensor) -> torch.Tensor:
        return _Fp8Linear.apply(x_BLI, self.weight_fp8, self.weight_scale, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3, per-channel scale"


def fp8_targets(transformer: torch.nn.Module, full_patterns: list[str]) -> list[str]:
    """Names of the Linear modules an fp8 base stores in fp8: inside the blocks, and not trained in
    full (a weight that a `train.trainable` pattern or an expansion module matches keeps its dtype)."""
    regexes = [re.compile(p) for p in full_patterns]
    return [name for name, m in transformer.named_modules()
            if type(m) is torch.nn.Linear and BLOCK_LINEAR.search(name)
            and not any(r.search(f"{name}.{leaf}") for r in regexes for leaf in ("weight", "bias"))]


def quantize_base(transformer: torch.nn.Module, full_patterns: list[str]) -> int:
    """Replace the fp8 targets of `transformer` by Fp8Linear, one layer at a time: each layer's
    full-precision weight is freed as soon as its fp8 copy exists, so the peak is the loaded model
    plus one layer. Before the LoRA is attached (peft then wraps the Fp8Linear). Returns the number
    of weights now in fp8."""
    n = 0
    for name in fp8_targets(transformer, full_patterns):
        parent_name, _, leaf = name.rpartition(".")
        parent = transformer.get_submodule(parent_name)
        linear = getattr(parent, leaf)
        setattr(parent, leaf, Fp8Linear.from_linear(linear))
        n += linear.weight.numel()
        del linear
    return n


def fp8_bytes(transformer: torch.nn.Module) -> int:
    """Bytes the fp8 weights and their scales take (1 per weight + 4 per output channel)."""
    return sum(m.weight_fp8.numel() + 4 * m.weight_scale.numel() for m in transformer.modules() if isinstance(m, Fp8Linear))


def swap_blocks(transformer: torch.nn.Module, n: int, device: torch.device) -> int:
    """Keep the fp8 weights of the last `n` transformer blocks in host RAM (pinned where CUDA is)
    and copy them to `device` for each call of their block: the forward and, under gradient
    checkpointing, its recompute in the backward. The GPU then holds the other blocks' fp8 weights
    plus the one block that runs (its copy is freed once autograd no longer needs it). Costs
    2 x n blocks' fp8 bytes of host-to-device copies per step with checkpointing (docs/memory.md).
    Called after DeepSpeed has placed the model. Returns the bytes left on the host."""
    on_host = 0
    blocks = list(transformer.blocks)[len(transformer.blocks) - n:] if n else []
    for block in blocks:
        layers = [m for m in block.modules() if isinstance(m, Fp8Linear)]
        host = {}
        for m in layers:
            w8 = m.weight_fp8.to("cpu")
            host[m] = w8.pin_memory() if device.type == "cuda" else w8
            m.weight_fp8 = host[m]  # the device copy DeepSpeed made is freed here
            on_host += w8.numel()

        def bring(module, args, layers=layers, host=host):
            for m in layers:
                m.weight_fp8 = host[m].to(device, non_blocking=True)

        def release(module, args, output, layers=layers, host=host):
            for m in layers:
                m.weight_fp8 = host[m]

        block.register_forward_pre_hook(bring)
        block.register_forward_hook(release)
    return on_host
