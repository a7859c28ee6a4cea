"""The pieces of bench/bench.py, one concern each:

    common.py   paths, presets, the per-configuration config, timing helpers
    step.py     the configuration's parts and engine (e2v.models.load / e2v.train.engine) and the step runner
                (e2v.train.step), as train_e2v.py builds and runs them; the bare PyTorch loop
    steps.py    child processes of sections 1 and 2: the step breakdown and the overhead rounds
    data.py     child process of section 3: the data pipeline at 81 x 480 x 832
    memory.py   section 4: peak memory, read in the step processes, and its table
    report.py   bench/RESULTS.md, regenerated from bench/results/*.json
"""
