"""Tiny random-weight models for the learned data-preparation path, saved as a user's folders
(safetensors + JSON, nothing downloaded): a Sam3Model with a byte-level CLIP tokenizer."""

from __future__ import annotations

import json
from pathlib import Path


def save_tiny_sam3(folder: Path, input_side: int = 112) -> Path:
    import torch
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import (CLIPTokenizer, Sam3Config, Sam3DETRDecoderConfig, Sam3DETREncoderConfig,
                              Sam3GeometryEncoderConfig, Sam3MaskDecoderConfig, Sam3Model, Sam3ViTConfig,
                              Sam3VisionConfig)

    folder.mkdir(parents=True, exist_ok=True)
    chars = sorted(ByteLevel.alphabet())  # every byte a token, no merges: any prompt tokenizes
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({c + "</w>": len(chars) + i for i, c in enumerate(chars)})
    vocab.update({"<|startoftext|>": len(vocab), "<|endoftext|>": len(vocab) + 1})
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt")).save_pretrained(folder)
    small = dict(num_attention_heads=4, intermediate_size=64)
    cfg = Sam3Config(
        vision_config=Sam3VisionConfig(
            backbone_config=Sam3ViTConfig(hidden_size=32, num_hidden_layers=2, image_size=input_side, patch_size=14,
                                          window_size=4, global_attn_indexes=[0, 1], **small),
            fpn_hidden_size=32, scale_factors=[2.0, 1.0]),
        text_config={"vocab_size": len(vocab), "hidden_size": 32, "intermediate_size": 64, "projection_dim": 32,
                     "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 32,
                     "hidden_act": "gelu", "bos_token_id": vocab["<|startoftext|>"],
                     "eos_token_id": vocab["<|endoftext|>"], "pad_token_id": vocab["<|endoftext|>"]},
        geometry_encoder_config=Sam3GeometryEncoderConfig(hidden_size=32, num_layers=1, mask_fuser_hidden_size=32,
                                                          mask_fuser_num_layers=1, **small),
        detr_encoder_config=Sam3DETREncoderConfig(hidden_size=32, num_layers=1, **small),
        detr_decoder_config=Sam3DETRDecoderConfig(hidden_size=32, num_layers=1, num_queries=5, **small),
        mask_decoder_config=Sam3MaskDecoderConfig(hidden_size=32, num_upsampling_stages=2))
    torch.manual_seed(0)
    Sam3Model(cfg).eval().save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(
        {"size": {"height": input_side, "width": input_side}, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}))
    return folder
