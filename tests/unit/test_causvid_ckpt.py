"""CausVid's generator checkpoints (e2v/models/causvid_ckpt.py): a file in CausVid's layout, written
here from a tiny diffusers model under names converted by this file's own table (from the Wan
repository's module structure and diffusers' conversion script's renames), loads into a fresh
transformer and gives the source model's output; e2v's export of a transformer reads back to the
same weights under the same names; a missing, unexpected or mis-shaped key is named."""

import pytest
import torch
from diffusers import WanTransformer3DModel

from e2v.models.causvid_ckpt import load_causvid_checkpoint, save_causvid_checkpoint
from e2v.models.tiny import seeded, tiny_transformer_config

# The Wan repository's parameter names (wan/modules/model.py): WanModel's embeddings, its blocks
# (WanAttentionBlock: self_attn, norm3 (affine: the cross-attention norm), cross_attn with the image
# keys of the I2V model, ffn as Linear-GELU-Linear, modulation), its Head and its MLPProj image
# embedding (LayerNorm, Linear, GELU, Linear, LayerNorm).
TOP = ["patch_embedding.weight", "patch_embedding.bias",
       "text_embedding.0.weight", "text_embedding.0.bias", "text_embedding.2.weight", "text_embedding.2.bias",
       "time_embedding.0.weight", "time_embedding.0.bias", "time_embedding.2.weight", "time_embedding.2.bias",
       "time_projection.1.weight", "time_projection.1.bias", "head.head.weight", "head.head.bias", "head.modulation"]
IMAGE = [f"img_emb.proj.{i}.{p}" for i in (0, 1, 3, 4) for p in ("weight", "bias")]
BLOCK = ([f"self_attn.{m}.{p}" for m in "qkvo" for p in ("weight", "bias")]
         + ["self_attn.norm_q.weight", "self_attn.norm_k.weight", "norm3.weight", "norm3.bias"]
         + [f"cross_attn.{m}.{p}" for m in ("q", "k", "v", "o", "k_img", "v_img") for p in ("weight", "bias")]
         + ["cross_attn.norm_q.weight", "cross_attn.norm_k.weight", "cross_attn.norm_k_img.weight"]
         + ["ffn.0.weight", "ffn.0.bias", "ffn.2.weight", "ffn.2.bias", "modulation"])

# original -> diffusers, as substring renames applied in order (diffusers' conversion script's list,
# with the attention names its single-file loader adds; the image names before the plain ones).
RENAMES = [
    ("time_embedding.0", "condition_embedder.time_embedder.linear_1"),
    ("time_embedding.2", "condition_embedder.time_embedder.linear_2"),
    ("text_embedding.0", "condition_embedder.text_embedder.linear_1"),
    ("text_embedding.2", "condition_embedder.text_embedder.linear_2"),
    ("time_projection.1", "condition_embedder.time_proj"),
    ("img_emb.proj.0", "condition_embedder.image_embedder.norm1"),
    ("img_emb.proj.1", "condition_embedder.image_embedder.ff.net.0.proj"),
    ("img_emb.proj.3", "condition_embedder.image_embedder.ff.net.2"),
    ("img_emb.proj.4", "condition_embedder.image_embedder.norm2"),
    ("head.modulation", "scale_shift_table"), ("head.head", "proj_out"), ("modulation", "scale_shift_table"),
    ("ffn.0", "ffn.net.0.proj"), ("ffn.2", "ffn.net.2"),
    ("norm3", "norm2"),  # Wan runs norm1, norm3, norm2; diffusers numbers them in order
    ("cross_attn.k_img", "attn2.add_k_proj"), ("cross_attn.v_img", "attn2.add_v_proj"),
    ("cross_attn.norm_k_img", "attn2.norm_added_k"),
    ("self_attn.norm_", "attn1.norm_"), ("cross_attn.norm_", "attn2.norm_"),
    ("self_attn.o.", "attn1.to_out.0."), ("cross_attn.o.", "attn2.to_out.0."),
    ("self_attn.", "attn1.to_"), ("cross_attn.", "attn2.to_"),
]


def to_diffusers(original: str) -> str:
    for old, new in RENAMES:
        if old in original:
            original = original.replace(old, new)
    return original


def original_keys(num_layers: int) -> list[str]:
    return TOP + IMAGE + [f"blocks.{i}.{k}" for i in range(num_layers) for k in BLOCK]


def tiny(seed: int) -> WanTransformer3DModel:
    with seeded(seed):
        return WanTransformer3DModel(**tiny_transformer_config("i2v")).eval()


def output(model):
    with seeded(7):
        x, text, image = torch.randn(1, 36, 2, 4, 4), torch.randn(1, 8, 32), torch.randn(1, 17, 32)
    with torch.no_grad():
        return model(x, timestep=torch.tensor([500]), encoder_hidden_states=text, encoder_hidden_states_image=image,
                     return_dict=False)[0]


def causvid_file(model) -> dict:
    """The model's weights as CausVid saves its generator: `model.<original name>`."""
    state = model.state_dict()
    return {f"model.{k}": state[to_diffusers(k)].clone() for k in original_keys(model.config.num_layers)}


def test_the_tables_name_every_tensor():
    """This file's table covers the tiny model exactly, and diffusers' own single-file conversion
    of the original names agrees with it (the oracle checked against a second one)."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    model = tiny(0)
    keys = original_keys(model.config.num_layers)
    assert sorted(map(to_diffusers, keys)) == sorted(model.state_dict())
    converted = convert_wan_transformer_to_diffusers({k: torch.zeros(1) for k in keys})
    assert sorted(converted) == sorted(model.state_dict())


def test_a_causvid_file_loads_and_gives_the_source_output(tmp_path):
    source, other = tiny(0), tiny(1)
    path = tmp_path / "causvid.pt"
    torch.save({"generator": causvid_file(other), "generator_ema": causvid_file(source)}, path)

    fresh = tiny(2)
    assert not torch.equal(output(fresh), output(source))
    load_causvid_checkpoint(fresh, path, which="generator_ema")
    assert torch.equal(output(fresh), output(source))
    load_causvid_checkpoint(fresh, path)  # "generator" by default
    assert torch.equal(output(fresh), output(other))


def test_the_export_reads_back_to_the_same_weights(tmp_path):
    source = tiny(0)
    path = save_causvid_checkpoint(source.state_dict(), tmp_path / "out" / "e2v_causvid.pt")
    saved = torch.load(path, map_location="cpu", weights_only=True)
    assert list(saved) == ["generator"]
    expected = causvid_file(source)
    assert sorted(saved["generator"]) == sorted(expected)
    assert all(torch.equal(saved["generator"][k], v) for k, v in expected.items())

    fresh = tiny(3)
    load_causvid_checkpoint(fresh, path)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), source.state_dict().values()))


def test_missing_unexpected_and_misshaped_keys_are_named(tmp_path):
    model = tiny(0)
    state = causvid_file(model)
    del state["model.blocks.1.norm3.weight"]
    state["model.blocks.0.self_attn.extra.weight"] = torch.zeros(2)
    state["model.head.modulation"] = torch.zeros(1, 3, 24)
    torch.save({"generator": state}, tmp_path / "bad.pt")
    with pytest.raises(ValueError) as e:
        load_causvid_checkpoint(tiny(1), tmp_path / "bad.pt")
    message = str(e.value)
    for part in ("1 missing: model.blocks.1.norm3.weight", "1 unexpected: model.blocks.0.self_attn.extra.weight",
                 "1 of another shape: model.head.modulation (1, 3, 24)", "model.generator_ckpt"):
        assert part in message

    torch.save({"model": state}, tmp_path / "no_generator.pt")
    with pytest.raises(ValueError, match=r"no 'generator' entry \(it has \['model'\]\)"):
        load_causvid_checkpoint(tiny(1), tmp_path / "no_generator.pt")


@pytest.mark.parametrize("training", ["full", "lora"])
def test_a_runs_causvid_export_is_the_trained_transformer(tmp_path, training):
    """e2v/train/export.py's export_causvid: a full fine-tune's weights, or the base with the LoRA fused
    (W + alpha / r * B A, computed here), in export dtypes, under CausVid's keys."""
    from peft import LoraConfig

    from e2v.train.export import CAUSVID_FILE, export_causvid, export_dtype

    model = tiny(0)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    if training == "lora":
        model.requires_grad_(False)
        with seeded(4):
            model.add_adapter(LoraConfig(r=2, lora_alpha=4, init_lora_weights=False, target_modules=["to_q", "to_v"]))
        for name, module in model.named_modules():
            if hasattr(module, "lora_A") and "default" in module.lora_A:
                delta = module.lora_B["default"].weight @ module.lora_A["default"].weight
                expected[f"{name}.weight"] = expected[f"{name}.weight"] + 2.0 * delta  # alpha / r = 2
    path = export_causvid(model, tmp_path, full_names=[])
    assert path == tmp_path / CAUSVID_FILE
    saved = torch.load(path, map_location="cpu", weights_only=True)["generator"]
    assert sorted(saved) == sorted(f"model.{k}" for k in original_keys(2))
    fresh = tiny(5)
    load_causvid_checkpoint(fresh, path)
    for name, value in fresh.state_dict().items():
        want = expected[name].to(export_dtype(name)).float()
        # the fused sum is rounded to bf16 once, by peft's order of fp32 additions or ours: one bf16 step apart at most
        torch.testing.assert_close(value.float(), want, atol=1e-6, rtol=0 if training == "full" else 2 ** -7, msg=name)
