"""The tiny preset saved as a sharded diffusers pipeline folder (`pipeline_folder`, a fixture),
for tests/launch/test_pretrained_folder.py and the ZeRO-3 load tests."""

import pytest


@pytest.fixture(scope="module")
def pipeline_folder(tmp_path_factory):
    from diffusers import UniPCMultistepScheduler, WanImageToVideoPipeline

    from e2v.models.tiny import build_tiny_parts

    p = build_tiny_parts(seed=0)
    out = tmp_path_factory.mktemp("pretrained") / "Wan-tiny-I2V-Diffusers"
    WanImageToVideoPipeline(
        tokenizer=p.tokenizer, text_encoder=p.text_encoder, vae=p.vae, image_encoder=p.image_encoder,
        image_processor=p.image_processor, transformer=p.transformer,
        scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True),
    ).save_pretrained(out)
    return out
