"""What a run shows: validation at fixed sigmas with the reference gaps (validation), the sampler
used by validation and tools/sample.py (sampling), reference-fidelity metrics (fidelity), and the
visualization dumps (viz). Imports the stages above it."""
