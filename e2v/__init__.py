"""e2v: fine-tune Wan video transformers to make videos from elements (reference images + a prompt).

The package is the pipeline, one subpackage a stage, each importing only the stages above it:

    runtime/       devices, ranks, host memory, files: what every stage may use
    config/        the typed config: schema, YAML and --set, checks, seed formats, base-model facts
    data/          samples on disk -> batches: media, element discovery, sources, dataset, cache
                   files, and data preparation from raw footage (data/prepare/)
    models/        Wan parts: loading, tiny presets, T2V -> E2V expansion, Wan2.2 experts, the plan
    conditioning/  pixels and prompts -> model inputs (A2's VAE and CLIP pathways, text, the TI2V
                   prefix, conditions read back from the cache)
    train/         flow matching, the step, the DeepSpeed engine, checkpoints and exports
    eval/          validation, sampling, reference-fidelity metrics, visualizations

docs/architecture.md maps every module; tests/unit/test_layout.py holds the tree to these rules.
"""

import logging as _logging

# peft imports bitsandbytes (deepspeed.optimizer: adamw_8bit) whenever it is installed, and
# bitsandbytes then warns on CPUs with AVX512-BF16 that an optional 4-bit matmul kernel is missing:
# nothing here uses 4-bit, and the line would stand in every process's stderr.
_logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(_logging.ERROR)
