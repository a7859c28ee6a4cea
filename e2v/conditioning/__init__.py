"""Pixels and prompts -> the model's inputs: the one entry and layout rule for encoded and cached
batches (layout), the encoders as SkyReels-A2 inference runs them (encode), the same latents read
back from the cache (cached), and the layouts with references in the token sequence: Wan2.2 TI2V's
clean prefix (ti2v) and SkyReels-V3 R2V's / Phantom's slots (sequence). Imports the stages above it."""
