"""The typed config: the schema's dataclasses (schema), YAML and `--set` into them (load), the
checks that name the key and the fix (checks), the older formats a config may come in
(seed_formats), and what a base model is without loading it (bases: its folder, its VAE; experts:
Wan2.2's two experts and their timesteps). Imports only e2v.runtime."""
