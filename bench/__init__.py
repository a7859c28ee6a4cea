"""The maintainers' harness: benchmarks, the real-shape smoke, the GPU check, footage generators,
with their results next to them (RESULTS.md, results/). Not installed with the e2v package."""
