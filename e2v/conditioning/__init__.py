"""Pixels and prompts -> the model's inputs, exactly as SkyReels-A2 inference builds them: the VAE
and CLIP pathways and the text (encode), Wan2.2 TI2V's clean reference prefix (ti2v), and the same
conditions read back from the cache (cached). Imports the stages above it."""
