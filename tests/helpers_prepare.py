"""Tiny random-weight models for the learned data-preparation path, saved as a user's folders
(safetensors + JSON, nothing downloaded): SAM 3 (detector and tracker in one checkpoint) with a
byte-level CLIP tokenizer, a SAM 2.1 video tracker, and a captioner. What the functions need beyond
pytest is imported where they run: tests/conftest.py loads this file as a plugin in every pytest
process, the pytest-xdist controller too, which runs no test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import built_once


def _tiny_sam3_vit(input_side: int):
    from transformers import Sam3ViTConfig

    return Sam3ViTConfig(hidden_size=32, num_hidden_layers=2, image_size=input_side, patch_size=14, window_size=4,
                         global_attn_indexes=[0, 1], num_attention_heads=4, intermediate_size=64)


def save_tiny_sam3(folder: Path, input_side: int = 112) -> Path:
    """Laid out as the released facebook/sam3 checkpoint: one Sam3VideoModel (detector, tracker
    and the tracker's neck over the shared backbone), which Sam3Model and Sam3TrackerVideoModel each
    load their part of. Widths are the smallest the tracker's code allows: its memory attention
    reads 64 memory channels, and object pointers split only when the FPN is wider than that."""
    import torch
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import (
        CLIPTokenizer,
        Sam3Config,
        Sam3DETRDecoderConfig,
        Sam3DETREncoderConfig,
        Sam3GeometryEncoderConfig,
        Sam3MaskDecoderConfig,
        Sam3TrackerVideoConfig,
        Sam3VideoConfig,
        Sam3VideoModel,
        Sam3VisionConfig,
    )

    folder.mkdir(parents=True, exist_ok=True)
    chars = sorted(ByteLevel.alphabet())  # every byte a token, no merges: any prompt tokenizes
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({c + "</w>": len(chars) + i for i, c in enumerate(chars)})
    vocab.update({"<|startoftext|>": len(vocab), "<|endoftext|>": len(vocab) + 1})
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt")).save_pretrained(folder)
    d, grid = 128, input_side // 14
    small = dict(num_attention_heads=4, intermediate_size=64)
    vision = dict(fpn_hidden_size=d, scale_factors=[4.0, 2.0, 1.0, 0.5],
                  backbone_feature_sizes=[[4 * grid, 4 * grid], [2 * grid, 2 * grid], [grid, grid]])
    detector = Sam3Config(
        vision_config=Sam3VisionConfig(backbone_config=_tiny_sam3_vit(input_side), **vision),
        text_config={"vocab_size": len(vocab), "hidden_size": 32, "intermediate_size": 64, "projection_dim": d,
                     "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 32,
                     "hidden_act": "gelu", "bos_token_id": vocab["<|startoftext|>"],
                     "eos_token_id": vocab["<|endoftext|>"], "pad_token_id": vocab["<|endoftext|>"]},
        geometry_encoder_config=Sam3GeometryEncoderConfig(hidden_size=d, num_layers=1, mask_fuser_hidden_size=d,
                                                          mask_fuser_num_layers=1, **small),
        detr_encoder_config=Sam3DETREncoderConfig(hidden_size=d, num_layers=1, **small),
        detr_decoder_config=Sam3DETRDecoderConfig(hidden_size=d, num_layers=1, num_queries=5, **small),
        mask_decoder_config=Sam3MaskDecoderConfig(hidden_size=d, num_upsampling_stages=2))
    tracker = Sam3TrackerVideoConfig(
        vision_config=Sam3VisionConfig(backbone_config=_tiny_sam3_vit(input_side), **vision), image_size=input_side,
        prompt_encoder_config={"hidden_size": d, "image_size": input_side, "patch_size": 14},
        mask_decoder_config={"hidden_size": d, "mlp_dim": 64, "num_attention_heads": 4, "iou_head_hidden_dim": 32},
        **_tiny_memory(d))
    torch.manual_seed(0)
    model = Sam3VideoModel(Sam3VideoConfig(detector_config=detector, tracker_config=tracker)).eval()
    _visible(model.tracker_model)
    model.save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(
        {"size": {"height": input_side, "width": input_side}, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}))
    return folder


def _tiny_memory(d: int) -> dict:
    """The video trackers' memory settings at width d (memory channels stay 64: see save_tiny_sam3)."""
    return dict(memory_attention_hidden_size=d, memory_attention_num_layers=1,
                memory_attention_feed_forward_hidden_size=64, memory_encoder_hidden_size=d, memory_encoder_output_channels=64, mask_downsampler_embed_dim=d,
                memory_fuser_embed_dim=d, memory_fuser_intermediate_dim=64, memory_fuser_num_layers=1,
                max_object_pointers_in_encoder=4)


def _visible(tracker) -> None:
    """Random weights put the tracker's object-score logit near 0, often below, and the tracker
    blanks a frame whose object it scores absent: a positive bias keeps tracked masks non-empty."""
    import torch

    with torch.no_grad():
        tracker.mask_decoder.pred_obj_score_head.proj_out.bias.fill_(2.0)


def save_tiny_sam2_video(folder: Path, input_side: int = 64) -> Path:
    """A tiny Sam2VideoModel (Hiera backbone, strides 4 to 32) saved as a SAM 2.1 folder, without a
    preprocessor_config.json: the tracker falls back to SAM 2's ImageNet mean / std."""
    import torch
    from transformers import Sam2HieraDetConfig, Sam2VideoConfig, Sam2VideoModel, Sam2VisionConfig

    d, grid = 128, input_side // 16
    hiera = Sam2HieraDetConfig(hidden_size=16, image_size=[input_side, input_side], blocks_per_stage=[1, 1, 2, 1],
                               embed_dim_per_stage=[16, 32, 64, 128], num_attention_heads_per_stage=[1, 1, 1, 1],
                               window_size_per_stage=[4, 4, 4, 2], global_attention_blocks=[3],
                               window_positional_embedding_background_size=[2, 2])
    vision = Sam2VisionConfig(backbone_config=hiera, backbone_channel_list=[128, 64, 32, 16], fpn_hidden_size=d,
                              backbone_feature_sizes=[[4 * grid, 4 * grid], [2 * grid, 2 * grid], [grid, grid]])
    cfg = Sam2VideoConfig(vision_config=vision, image_size=input_side, memory_attention_rope_feat_sizes=[grid, grid],
                          prompt_encoder_config={"hidden_size": d, "image_size": input_side, "patch_size": 16},
                          mask_decoder_config={"hidden_size": d, "mlp_dim": 64, "num_attention_heads": 4,
                                               "iou_head_hidden_dim": 32}, **_tiny_memory(d))
    torch.manual_seed(0)
    model = Sam2VideoModel(cfg).eval()
    _visible(model)
    model.save_pretrained(folder)
    return folder


def save_tiny_captioner(folder: Path) -> Path:
    """A tiny random-weight LLaVA (CLIP vision + Llama text) with its processor, loadable by
    AutoProcessor / AutoModelForImageTextToText like a real captioner folder; the PIL image
    processor keeps torchvision out."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        PreTrainedTokenizerFast,
    )

    words = ["<pad>", "<unk>", "<s>", "</s>", "<image>", "USER:", "ASSISTANT:", "a", "person", "object",
             "background", "video", "the", "and"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<s>",
                                        eos_token="</s>", extra_special_tokens={"image_token": "<image>"})
    template = ("{% for m in messages %}{{ m['role'].upper() + ': ' }}{% for c in m['content'] %}"
                "{% if c['type'] == 'image' %}{{ '<image> ' }}{% else %}{{ c['text'] + ' ' }}{% endif %}{% endfor %}"
                "{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")
    LlavaProcessor(image_processor=CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}),
                   tokenizer=tokenizer, patch_size=14, chat_template=template, image_token="<image>",
                   vision_feature_select_strategy="full", num_additional_image_tokens=1).save_pretrained(folder)
    cfg = LlavaConfig(
        vision_config=CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                       image_size=28, patch_size=14, projection_dim=16),
        text_config=LlamaConfig(vocab_size=len(words), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                num_attention_heads=2, num_key_value_heads=2, pad_token_id=0, bos_token_id=2,
                                eos_token_id=3),
        image_token_index=4, vision_feature_select_strategy="full", vision_feature_layer=-1)
    torch.manual_seed(0)
    LlavaForConditionalGeneration(cfg).eval().save_pretrained(folder)
    return folder


def save_tiny_vision_encoder(folder: Path) -> Path:
    """A tiny random-weight CLIP vision tower, loadable by AutoModel like a real image-embedding
    folder (the identity check's learned measure)."""
    import torch
    from transformers import CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(0)
    cfg = CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14)
    CLIPVisionModel(cfg).eval().save_pretrained(folder)
    return folder

ROOT = Path(__file__).resolve().parent.parent


# The tests' clips: 17 frames at 8 fps, checked with the tiny config one sample a batch, the check
# itself off (on where a test is about it: `check.run=true`)
SMALL_SETS = ["clips.num_frames=17", "clips.fps=8", "clips.resolution=[64, 64]", "check.config=configs/e2v_tiny.yaml",
              "check.set=[train.micro_batch_size=1]", "check.run=false"]
# the hard footage at its own size, 96 x 160 (the later override wins): registration works on
# frames this small, not on 48 x 80
SETS = [*SMALL_SETS, "clips.resolution=[96, 160]"]


def _prepare(raw: Path, out: Path, *sets: str) -> dict:
    from e2v.data.prepare.config import load_prepare_config
    from e2v.data.prepare.run import prepare
    from tools.check_dataset import main as check_dataset

    return prepare(load_prepare_config(ROOT / "configs/prepare.yaml", [*SETS, *sets]), raw, out, no_caption=True,
                   check=check_dataset)


@pytest.fixture(scope="session")
def hard_raw(tmp_path_factory) -> Path:
    """The hard footage, written once per session (both halves of the prepare_hard tests read it)."""
    from bench.make_raw_footage import write_hard_footage

    return built_once(tmp_path_factory, "hard_raw", write_hard_footage)


@pytest.fixture(scope="session")
def hard_prepared(hard_raw, tmp_path_factory) -> tuple[Path, dict]:
    """The hard footage prepared once per session: (the dataset folder, the preparation's summary)."""
    def build(folder: Path) -> None:
        (folder / "data").mkdir()
        summary = _prepare(hard_raw, folder / "data", "check.run=true")
        (folder / "summary.json").write_text(json.dumps(summary))

    folder = built_once(tmp_path_factory, "hard_prepared", build)
    return folder / "data", json.loads((folder / "summary.json").read_text())
