"""Write a small synthetic E2V dataset whose clips are only knowable from their references (the
generator, why the data looks like this, and its options: e2v/data/demo.py).

    python tools/make_demo_dataset.py OUT_DIR [--num-samples 64] [--size 64] [--frames 17]
                                              [--seed 0] [--force] [--write-meta] [--verify]
                                              [--real-size] [--video-format mp4|npz] [--dry-run]
"""

if __name__ == "__main__" and not __package__:  # started as a file: is the package installed? (tools/_installed.py)
    import _installed  # noqa: F401

from e2v.data.demo import main

if __name__ == "__main__":
    main()
