"""Generate videos from elements (+ prompt) with a trained LoRA, the way SkyReels-A2 samples.

    python tools/sample.py --run runs/<run> \
        --element person=a.png --element object=b.png --prompt "a shape moves" --out video.mp4
    python tools/sample.py --config configs/t2v_lora.yaml --lora runs/<run>/lora \
        --prompt-file prompts.txt --num-videos 4 --also-base --out samples/

The options, the output names and the seeds: e2v/eval/sample_cli.py (`--help`).
"""

# read_elements and to_inference_dtype: tests reach them through this file as well as main
from e2v.eval.sample_cli import main, read_elements  # noqa: F401
from e2v.models.precision import to_inference_dtype  # noqa: F401

if __name__ == "__main__":
    main()
