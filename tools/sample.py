"""Generate videos from elements (+ prompt) with a trained LoRA, the way SkyReels-A2 samples.

    python tools/sample.py --run runs/<run> \
        --element person=a.png --element object=b.png --prompt "a shape moves" --out video.mp4
    python tools/sample.py --config configs/t2v_lora.yaml --lora runs/<run>/lora \
        --prompt-file prompts.txt --num-videos 4 --also-base --out samples/

The options, the output names and the seeds: e2v/eval/sample_cli.py (`--help`).
"""

# read_elements and to_inference_dtype: tests reach them through this file as well as main
if __name__ == "__main__" and not __package__:  # started as a file: is the package installed? (tools/_installed.py)
    import _installed  # noqa: F401

from e2v.eval.sample_cli import main, read_elements  # noqa: F401


def __getattr__(name: str):
    """to_inference_dtype on first use: it imports torch, which --help and a config error never need."""
    if name == "to_inference_dtype":
        from e2v.models.precision import to_inference_dtype

        return to_inference_dtype
    raise AttributeError(name)

if __name__ == "__main__":
    main()
