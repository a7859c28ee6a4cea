"""The typed config: the schema's dataclasses (schema), YAML and `--set` into them (load), the
checks that name the key and the fix (checks), the older formats a config may come in
(seed_formats), and what a base model is without loading it (bases: its folder, its VAE; experts:
Wan2.2's two experts and their timesteps). Imports only e2v.runtime, and never torch, DeepSpeed,
diffusers or transformers at load (a check that needs one imports it inside): every command reads
and checks its config, and says what is wrong, before those 15-25 s of imports
(tests/unit/test_firstday_start.py blocks them while the commands answer)."""
