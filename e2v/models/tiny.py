"""The tiny preset: every Wan part (transformer, VAE, UMT5 + a tokenizer made in code, CLIP vision
+ its processor) built in code with random weights, nothing downloaded. It is the real code path
with small configs (docs/architecture.md, "Tensor contracts"), so the tests and the CPU demo run
exactly what a 14B run does: 2 heads x 12, 2 layers, ~30k transformer parameters by default
(`model.tiny` sizes the transformer: the demo's is 4 layers of width 128, 1.4 M). The tiny_ti2v
preset is Wan2.2 TI2V-5B's layout at that size: 48 channels, no image attention or CLIP, the tiny
Wan2.2 VAE (e2v/models/tiny_vae22.py)."""

from __future__ import annotations

import contextlib

import torch
from diffusers import WanTransformer3DModel

from e2v.config.schema import TinyShape
from e2v.models.parts import Parts, clip_image_processor

TINY_CLIP_WIDTH = 32  # hidden size of the tiny CLIP vision model (the image tokens' width)
TINY_CLIP_SIZE, TINY_CLIP_PATCH = 32, 8  # its input size and patch: 4 x 4 patches
TINY_CLIP_TOKENS = (TINY_CLIP_SIZE // TINY_CLIP_PATCH) ** 2 + 1  # + CLS: 17 tokens per reference


# Words the tiny tokenizer knows (demo prompts and test sentences); anything else is <unk>.
_TINY_VOCAB_TEXT = """
a an the shape object subject person dog toy moves glides drifts slides across over through along
around patterned textured striped plain background scene simple small large moving slowly quickly
clapping sitting walking hands their video shows in this of with and on to is are into near
""".split()
# Colour names (the causal demo's prompts name the subject's colour: bench/causal_demo.py). Their ids
# follow every word above and their embedding rows are drawn after every part is built, from a seed of
# their own (build_tiny_parts), so what the words above encode to, and every other tiny weight, is as
# it was without them.
_TINY_COLOUR_WORDS = "red yellow green cyan blue magenta".split()


@contextlib.contextmanager
def seeded(seed: int):
    """Build under a private RNG seeded with `seed`, so building parts never moves the caller's RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def tiny_transformer_config(base: str = "i2v", shape: TinyShape | None = None) -> dict:
    """By default (`model.tiny` unset) 2 heads x 12, 2 layers: ~30k parameters, milliseconds a step
    on a 2-core CPU (bench/RESULTS.md, section 7: `tiny_step`); `shape` (the config's `model.tiny`) sizes it, as the demo does. ti2v is
    Wan2.2 TI2V-5B's layout: 48 latent channels in and out, no image attention."""
    shape = shape or TinyShape()
    cfg = dict(
        patch_size=(1, 2, 2), num_attention_heads=shape.heads, attention_head_dim=shape.head_dim, in_channels=16,
        out_channels=16, text_dim=32, freq_dim=32, ffn_dim=shape.ffn_dim, num_layers=shape.layers,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=32,
    )
    if base == "i2v":  # the image projections take the image embedder's output, the model's width
        cfg.update(in_channels=36, image_dim=TINY_CLIP_WIDTH, added_kv_proj_dim=shape.heads * shape.head_dim)
    elif base == "ti2v":
        cfg.update(in_channels=48, out_channels=48)
    elif base == "i2v_a14b":  # a Wan2.2 I2V-A14B expert: the I2V input channels, no image attention
        cfg.update(in_channels=36)
    return cfg


def build_tiny_experts(seed: int, names, shape: TinyShape | None = None,
                       base: str = "i2v_a14b") -> dict[str, WanTransformer3DModel]:
    """The tiny two-expert preset's experts (e2v/config/experts.py), each from its own seed, so either one
    is the same whether it is built alone or with the other; `base` (config.bases.tiny_expert_base):
    i2v_a14b, or t2v for Wan2.2-T2V-A14B's shape."""
    experts = {}
    for k, name in enumerate(("high_noise", "low_noise")):
        if name in names:
            with seeded(seed + 1000 * (k + 1)):
                experts[name] = WanTransformer3DModel(**tiny_transformer_config(base, shape))
    return experts


def build_tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    for w in _TINY_VOCAB_TEXT + _TINY_COLOUR_WORDS:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    # UMT5 appends </s>; an empty prompt is then the single token </s>, as with the real tokenizer.
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                                   unk_token="<unk>", model_max_length=512)


def build_tiny_parts(seed: int = 0, base: str = "i2v", informative_vae: bool = True,
                     with_encoders: bool = True, shape: TinyShape | None = None) -> Parts:
    from transformers import CLIPVisionConfig, CLIPVisionModel, UMT5Config, UMT5EncoderModel

    from e2v.models.tiny_vae import build_tiny_vae
    from e2v.models.tiny_vae22 import build_tiny_vae22

    with seeded(seed):
        transformer = WanTransformer3DModel(**tiny_transformer_config(base, shape))
        if not with_encoders:
            return Parts(transformer)
        vae = (build_tiny_vae22 if base == "ti2v" else build_tiny_vae)(seed, informative=informative_vae)
        tokenizer = build_tiny_tokenizer()
        text_encoder = UMT5EncoderModel(UMT5Config(
            vocab_size=len(tokenizer) - len(_TINY_COLOUR_WORDS), d_model=32, d_kv=8, d_ff=64, num_layers=2,
            num_heads=4, relative_attention_num_buckets=8, dropout_rate=0.0,
        ))
        image_encoder = image_processor = None  # TI2V-5B ships none: no image attention to feed
        if base != "ti2v":
            image_encoder = CLIPVisionModel(CLIPVisionConfig(
                hidden_size=TINY_CLIP_WIDTH, projection_dim=TINY_CLIP_WIDTH, num_hidden_layers=2,
                num_attention_heads=2, intermediate_size=64, image_size=TINY_CLIP_SIZE, patch_size=TINY_CLIP_PATCH,
            )).eval()
            image_processor = clip_image_processor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    with seeded(seed + 1):  # the colour words' rows (_TINY_COLOUR_WORDS), after every other draw
        text_encoder.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    text_encoder.eval(), vae.eval()
    return Parts(transformer, vae, text_encoder, tokenizer, image_encoder, image_processor)
