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


def save_tiny_captioner(folder: Path) -> Path:
    """A tiny random-weight LLaVA (CLIP vision + Llama text) with its processor, loadable by
    AutoProcessor / AutoModelForImageTextToText like a real captioner folder; the PIL image
    processor keeps torchvision out."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (CLIPImageProcessorPil, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor, PreTrainedTokenizerFast)

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
