"""A one-process DeepSpeed engine of the tiny preset under ZeRO stage N and one step of it
(`_engine`, `_step`), shared by tests/launch/test_resume_lean.py and tests/unit/test_hw_ops_checkpoint.py."""

import torch


def _probe() -> dict:
    g = torch.Generator().manual_seed(0)
    return dict(hidden_states=torch.randn(1, 36, 5, 8, 8, generator=g), timestep=torch.tensor([700.0]),
                encoder_hidden_states=torch.randn(1, 512, 32, generator=g),
                encoder_hidden_states_image=torch.randn(1, 17 * 3, 32, generator=g), return_dict=False)


def _engine(stage: int):
    import deepspeed
    from helpers import ROOT

    from e2v.config.load import load_config
    from e2v.models.tiny import build_tiny_parts
    from e2v.models.trainable import setup_training

    model = build_tiny_parts(seed=0, with_encoders=False).transformer
    cfg = load_config(str(ROOT / "configs/e2v_tiny_lora.yaml"), [], check_paths=False)
    torch.manual_seed(1)  # the LoRA's initial values: the same in every engine built here
    setup_training(model, cfg, expanded=False)
    zero = {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}
    ds = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=ds)
    return engine


def _step(engine) -> float:
    loss = engine(**_probe())[0].float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    return loss.item()
