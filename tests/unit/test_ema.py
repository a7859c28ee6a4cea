"""The EMA of the trained weights (e2v/train/ema.py, train.ema_weight / train.ema_start_step):
against the closed form of an exponential average written here, validation's swap in and out, the
checkpoint file's round trip, Self-Forcing's keys read from its YAML, and ZeRO-3 refused in one line.
Through the launcher (resume, lora_ema/): tests/launch/test_causal_runs.py."""

import pytest
import torch
from helpers import ROOT
from safetensors.torch import load_file

from e2v.config.load import load_config
from e2v.config.schema import ConfigError
from e2v.train.ema import WeightEMA


def model():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    net[1].bias.requires_grad_(False)  # frozen: not averaged
    return net


def closed_form(history: list[dict], weight: float, start: int) -> dict:
    """ema_n = w^(n-s) W_s + sum_{k=s+1..n} (1-w) w^(n-k) W_k, the weights W_k after step k (1-based)."""
    n = len(history)
    out = {name: weight ** (n - start) * history[start - 1][name].double() for name in history[0]}
    for k in range(start + 1, n + 1):
        for name in out:
            out[name] += (1 - weight) * weight ** (n - k) * history[k - 1][name].double()
    return out


@pytest.mark.parametrize("start", [1, 3])
def test_the_average_is_the_closed_form_from_its_start_step(start):
    net, weight = model(), 0.9
    ema, history = WeightEMA(net, weight, start), []
    assert set(ema.params) == {"0.weight", "0.bias", "1.weight"}
    for step in range(1, 7):
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.randn_like(p))  # an optimizer step
        history.append({n: p.detach().clone() for n, p in net.named_parameters() if p.requires_grad})
        ema.update(step)
        assert bool(ema.shadow) == (step >= start), step
    for name, expected in closed_form(history, weight, start).items():
        torch.testing.assert_close(ema.shadow[name].double(), expected, rtol=1e-6, atol=1e-6)


def test_applied_swaps_the_average_in_and_puts_the_weights_back_exactly():
    net = model()
    ema = WeightEMA(net, 0.5)
    with ema.applied():  # not started: the weights as they are
        assert torch.equal(net[0].weight, model()[0].weight)
    ema.update(1)
    with torch.no_grad():
        net[0].weight.add_(1.0)
    ema.update(2)
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    with ema.applied():
        for n, p in net.named_parameters():
            if n in ema.shadow:
                assert torch.equal(p, ema.shadow[n]), n
        torch.testing.assert_close(net[0].weight, before["0.weight"] - 0.5)  # half way back to the start
    for n, p in net.named_parameters():
        assert torch.equal(p, before[n]), n


def test_the_checkpoint_file_round_trips_and_a_misfit_names_the_file(tmp_path):
    net = model()
    ema = WeightEMA(net, 0.99)
    assert ema.payload() is None  # before the start: no file
    ema.update(1)
    path = tmp_path / "ema.safetensors"
    path.write_bytes(ema.payload())
    again = WeightEMA(model(), 0.99)
    assert again.load(path) and not WeightEMA(model(), 0.99).load(tmp_path / "none.safetensors")
    assert all(torch.equal(again.shadow[n], ema.shadow[n]) for n in ema.shadow)
    other = torch.nn.Sequential(torch.nn.Linear(3, 4))
    with pytest.raises(RuntimeError, match=f"{path} does not fit this run's trained parameters"):
        WeightEMA(other, 0.99).load(path)


def test_self_forcings_keys_load_and_zero3_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "seed.yaml").write_text("dataset_base_path: data\nmetadata_path: data/metadata.csv\n"
                                        "ema_weight: 0.99\nema_start_step: 200\nmodel: {preset: tiny}\n")
    cfg = load_config(tmp_path / "seed.yaml")
    assert (cfg.train.ema_weight, cfg.train.ema_start_step) == (0.99, 200)
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path / "seed.yaml", ["deepspeed.config=ds_configs/zero3.json"])
    assert str(e.value).startswith("train.ema_weight averages whole weights on every rank, but ds_configs/zero3.json")
    assert "use ds_configs/zero2.json" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"train.ema_weight=1.0 must be within \[0, 1\)"):
        load_config(tmp_path / "seed.yaml", ["train.ema_weight=1.0"])


def test_validation_runs_with_the_average_and_gives_the_weights_back(demo_data, tiny_parts, tmp_path):
    """Oracle: the same Validator on a model whose weights were set to the average by hand."""
    import copy

    from e2v.data.dataset import index_samples
    from e2v.eval.validation import Validator, split_held_out

    cfg = load_config(ROOT / "configs/e2v_tiny.yaml", [f"data.datasets.0.data_root={demo_data}", f"output_dir={tmp_path}",
                                                       "validation.every_n_steps=2", "validation.num_samples=2",
                                                       "validation.num_videos=0", "validation.subject_colour=null",
                                                       "cache.enabled=false"])
    _, held = split_held_out(index_samples(cfg, verbose=False), cfg)
    model = copy.deepcopy(tiny_parts.transformer).float()
    for p in model.parameters():
        p.requires_grad_(p.dim() > 1)  # some trained, some frozen
    ema = WeightEMA(model, 0.5)
    ema.update(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    by_hand = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in by_hand.named_parameters():
            if n in ema.shadow:
                p.copy_(ema.shadow[n])

    def validate(m, average=None):
        return Validator(cfg, held, tiny_parts, tmp_path, rank=0, device="cpu", dtype=torch.float32,
                         ema=average).maybe_run(m, 2)

    averaged = validate(model, ema)
    assert averaged and averaged == validate(by_hand) and averaged != validate(model)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_a_lora_runs_average_exports_the_files_of_a_model_holding_it(tmp_path):
    """lora_ema/ of a LoRA run (LoRA plus modules trained in full, e2v_tiny_lora): export_state from
    the average's names gives, file for file, what the end-of-run export writes from a model whose
    trained weights are the average."""
    from e2v.models.tiny import build_tiny_parts
    from e2v.models.trainable import setup_training
    from e2v.train.checkpoint import export_state
    from e2v.train.export import export_lora, export_meta, save_base_modules

    cfg = load_config(ROOT / "configs/e2v_tiny_lora.yaml", check_paths=False)
    model = build_tiny_parts(seed=0, with_encoders=False).transformer
    full_names = setup_training(model, cfg, expanded=False)
    save_base_modules(model, full_names, tmp_path)
    ema = WeightEMA(model, 0.5)
    torch.manual_seed(0)
    for step in (1, 2):
        with torch.no_grad():
            for p in ema.params.values():
                p.add_(0.01 * torch.randn_like(p))
        ema.update(step)
    assert any("lora_" in n for n in ema.shadow) and any("lora_" not in n for n in ema.shadow)
    export_state(ema.shadow, export_meta(model), tmp_path / "lora_ema", tmp_path)
    with ema.applied():
        export_lora(model, tmp_path / "live", full_names)
    written = sorted(f.name for f in (tmp_path / "live").iterdir())
    assert written == sorted(f.name for f in (tmp_path / "lora_ema").iterdir()) and len(written) >= 4, written
    for name in written:
        if name.endswith(".safetensors"):
            a, b = load_file(str(tmp_path / "live" / name)), load_file(str(tmp_path / "lora_ema" / name))
            assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a), name


def test_exporting_the_average_of_a_checkpoint_without_one_names_the_file(tmp_path):
    from e2v.train.checkpoint import ema_state

    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'ema.safetensors'} is missing: the checkpoint holds "
                                                "no EMA weights .*export without --ema"):
        ema_state(tmp_path)
