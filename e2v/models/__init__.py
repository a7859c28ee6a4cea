"""The Wan parts and their shapes: loading (load, parts, zero3_load), the tiny presets (tiny,
tiny_vae, tiny_vae22), a T2V base widened for elements (expand), the module that holds Wan2.2's
two experts (experts), what trains (trainable), fp32-kept parameters (precision), context
parallelism (context_parallel), how the transformer runs (speed: attention backend, compiled
blocks, TF32), and the plan of shapes and memory built on the meta device (plan).
Imports e2v.runtime, e2v.config.load and e2v.data.dataset."""
