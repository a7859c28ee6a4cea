"""The pieces of bench/smoke_real.py (real Wan2.1 shapes end to end on a CPU), one concern each:

    build.py     random-weight diffusers folders with the released configs, and the small datasets
    measure.py   a launch of `deepspeed train_e2v.py` with its process tree's peak memory sampled
    probe.py     the engine's output on a fixed input, and the export reloaded into plain diffusers
"""
