"""The optimizer configs/e2v.yaml, configs/e2v_24gb.yaml and Wan2.2 A14B default to, torch's AdamW
fused on the CPU copy of ZeRO's optimizer offload, run as training builds it: the tiny preset's
transformer and LoRA (e2v.models.trainable), ds_configs/zero2_offload.json filled by
e2v.train.ds_config, deepspeed.initialize, three steps with a warmed-up lr. Each step the gradients
the optimizer is handed are copied to torch's reference AdamW (the unfused for-loop, `foreach=False`)
stepping its own copy of the partition at the same lr; the two partitions are compared after every
step. Prints one JSON line: which optimizer stepped (class, fused, its partition's device, pinned),
the losses, and the largest difference from the reference. A process of its own (it makes a
process group): bench/gpulib/sections.py runs it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# The GPU check runs with the machine's own interpreter, e2v not installed in it (`make gpu-check`
# installs no package: docs/gpu.md): e2v and bench are found from the checkout's root.
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
STEPS = 3
ATOL = 1e-6  # fp32 partitions of values ~1e-2..1: the two implementations differ in rounding only


def main() -> int:
    import deepspeed
    import torch

    from e2v.config.load import load_config
    from e2v.models.tiny import build_tiny_parts
    from e2v.models.trainable import setup_training
    from e2v.runtime.distributed import init_distributed
    from e2v.train.ds_config import resolve_deepspeed_config

    cuda = torch.cuda.is_available()
    init_distributed()
    sets = ["deepspeed.config=ds_configs/zero2_offload.json", "deepspeed.optimizer=torch_adamw", "train.lr=1e-3",
            f"train.mixed_precision={'bf16' if cuda else 'no'}"]
    cfg = load_config(str(ROOT / "configs/e2v_tiny_lora.yaml"), sets, check_paths=False)
    model = build_tiny_parts(seed=0, with_encoders=False).transformer
    torch.manual_seed(1)
    setup_training(model, cfg, expanded=False)
    ds = resolve_deepspeed_config(cfg, 1, cuda)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=ds)
    opt = engine.optimizer.optimizer  # ZeRO's wrapped optimizer: the one that steps the fp32 partition
    parts = [p for g in opt.param_groups for p in g["params"]]
    reference = [p.detach().clone() for p in parts]
    ref_opt = torch.optim.AdamW([{"params": [r]} for r in reference], lr=cfg.train.lr, betas=tuple(cfg.train.betas),
                                eps=cfg.train.eps, weight_decay=cfg.train.weight_decay, foreach=False, fused=False)
    diffs, real_step = [], opt.step

    def step_both(*a, **k):
        for g, rg in zip(opt.param_groups, ref_opt.param_groups):
            rg["lr"] = g["lr"]
        for p, r in zip(parts, reference):
            r.grad = p.grad.detach().clone()
        out = real_step(*a, **k)
        ref_opt.step()
        diffs.append(max(float((p.detach() - r).abs().max()) for p, r in zip(parts, reference)))
        return out

    opt.step = step_both
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    g = torch.Generator().manual_seed(0)
    probe = dict(hidden_states=torch.randn(1, 36, 5, 8, 8, generator=g), timestep=torch.tensor([700.0]),
                 encoder_hidden_states=torch.randn(1, 512, 32, generator=g),
                 encoder_hidden_states_image=torch.randn(1, 17 * 3, 32, generator=g))
    probe = {k: v.to(device, dtype if v.is_floating_point() and k != "timestep" else v.dtype) for k, v in probe.items()}
    losses = []
    for _ in range(STEPS):
        loss = engine(**probe, return_dict=False)[0].float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    out = {"optimizer": f"{type(opt).__module__}.{type(opt).__qualname__}", "fused": bool(opt.defaults.get("fused")),
           "partition_device": str(parts[0].device), "pinned": bool(parts[0].is_pinned()) if cuda else False,
           "partition_numel": sum(p.numel() for p in parts), "losses": losses, "max_abs_diff": diffs, "atol": ATOL}
    print("OFFLOAD_ADAM " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
