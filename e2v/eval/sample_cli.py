"""tools/sample.py (e2v-sample): generate videos from elements (+ prompt) with a trained LoRA, the way
SkyReels-A2 samples.

    python tools/sample.py --run runs/<run> \
        --element person=a.png --element object=b.png --prompt "a shape moves" --out video.mp4

`--run` takes a run folder: its `config.yaml` (what trained) and its `lora/`, so the model built
for sampling is the one trained. `--lora DIR` alone reads the config of the run it belongs to
(DIR/../config.yaml); `--config` overrides either (a base model without a LoRA needs it).

    # T2V LoRA evaluation: N videos per prompt from a prompt file, base and LoRA side by side
    python tools/sample.py --config configs/t2v_lora.yaml --lora runs/<run>/lora \
        --prompt-file prompts.txt --num-videos 4 --also-base --out samples/

Conditions come from the training code (e2v.conditioning.encode via e2v.eval.sampling), so the layout a
LoRA was trained on is the layout it is sampled with. `--out` ending in .mp4 with one prompt and one
video writes that file; otherwise `--out` is a folder: `<out>/lora/<prompt#>_<slug>_<k>.mp4`
(and `<out>/base/...` with --also-base, same seeds), plus `prompts.txt`. Video k of every prompt
uses seed `--seed + k`. A2's script drops the first frames (the references and a transition):
`--drop-frames ref` drops the F_ref reference frames, `--drop-frames 12` drops 12.

Every reference given is used or refused: one image per element (a second `--element NAME=...`
is an error: several references are several elements, each its own slot in the sequence layout),
a name the run did not train is refused with how to train one, and a guidance option that
cannot act (`--image-guidance` at text guidance 1) is an error. References are read as training
read them (data.reference_read); `--generator-device device` draws on the sampling device as
SkyReels-V3's pipeline does (validation.generator_device).

A causal run (`task: causal`) samples block by block at its few-step list (e2v/eval/sampling.py:
`causal_rollout`; `--steps` and `--shift` are refused there), from its base with
`model.generator_ckpt` loaded when the run names one.
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

# torch, diffusers and the data stage are imported where they are used, after the command line and
# the config are checked: --help and a config error answer in a second (bench/RESULTS.md, section 9)
from e2v.config.load import load_config
from e2v.config.schema import ConfigError
from e2v.models.weights import require_weights
from e2v.runtime.hostmem import return_freed_memory
from e2v.runtime.log import get_logger

log = get_logger("e2v.sample")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", type=Path, help="a run folder: its config.yaml and lora/ (what `train_e2v.py` wrote)")
    p.add_argument("--config", help="the training YAML; default: the run's config.yaml (--run, or --lora's run)")
    p.add_argument("--lora", help="a run's lora/ folder (default with --run: RUN/lora); without any, the base model")
    p.add_argument("--element", action="append", default=[], metavar="NAME=IMAGE",
                   help="an element image by its config name, e.g. person=a.png (repeatable)")
    p.add_argument("--prompt", action="append", default=[], help="prompt (repeatable)")
    p.add_argument("--prompt-file", type=Path, help="one prompt per line (blank lines and # comments skipped)")
    p.add_argument("--negative-prompt", default=None, help="default: validation.negative_prompt")
    p.add_argument("--out", required=True, type=Path, help="video.mp4, or a folder")
    p.add_argument("--num-videos", type=int, default=1, help="videos per prompt (seeds --seed, --seed+1, ...)")
    p.add_argument("--also-base", action="store_true", help="also sample the base model, same seeds, into <out>/base")
    p.add_argument("--steps", type=int, default=None, help="default: validation.num_inference_steps")
    p.add_argument("--guidance", type=float, default=None, help="text CFG scale; default validation.guidance_scale")
    p.add_argument("--shift", type=float, default=None, help="UniPC flow shift; default validation.sample_shift (A2: 8)")
    p.add_argument("--image-guidance", type=float, default=None,
                   help="Phantom's dual guidance image scale (with --guidance > 1); default validation.image_guidance_scale")
    p.add_argument("--frames", type=int, default=None, help="4k+1 frames; default data.num_frames")
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--generator-device", choices=["cpu", "device"], default=None,
                   help="where the seeded generator lives: cpu (the same video on every machine) or device (the "
                        "sampling device: on CUDA, SkyReels-V3's draws for a seed); default validation.generator_device")
    p.add_argument("--fps", type=int, default=16)
    p.add_argument("--drop-frames", default="0", help="frames dropped from the start: a number, or 'ref' (F_ref)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    p.add_argument("--device", default=None, help="default: cuda when there is a GPU, else cpu")
    p.add_argument("--dtype", choices=["bf16", "fp32"], help="transformer dtype; default bf16 on CUDA (A2), fp32 on CPU")
    return p.parse_args(argv)


def slug(text: str, n: int = 40) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")[:n] or "empty"


def read_prompts(args) -> list[str]:
    prompts = list(args.prompt)
    if args.prompt_file:
        lines = args.prompt_file.read_text().splitlines()
        prompts += [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]
    if not prompts:
        raise SystemExit("give --prompt TEXT or --prompt-file FILE")
    return prompts


def more_references(cfg) -> str:
    """How a run gets room for another reference: the words of the refusals below."""
    names = [e.name for e in cfg.ordered_elements]
    room = ("" if cfg.conditioning.target_layout != "sequence" else
            f"; each element takes a slot, so conditioning.sequence.slots (now {cfg.conditioning.sequence.slots}; "
            "null: one per reference) must hold them all")
    return (f"the run trained {len(names)} element(s) ({', '.join(names) or 'none'}) and a reference needs an "
            f"element of its own: to sample with one more, add it to data.elements and train with it{room}")


def read_elements(args, cfg) -> dict:
    """--element NAME=IMAGE -> {name: RGB image}, each read by the config's rule and brought to the
    video size now (a reference the loader refuses stops here, before any weight loads)."""
    from e2v.data.dataset import element_inputs
    from e2v.data.media import MediaError, load_image

    images, given = {}, {}
    names = {e.name for e in cfg.data.elements}
    h, w = cfg.data.resolution
    for spec in args.element:
        name, sep, path = spec.partition("=")
        if not sep:
            raise SystemExit(f"--element {spec!r}: expected NAME=IMAGE, e.g. person=a.png")
        if name in given:
            raise SystemExit(f"--element {name} given twice ({given[name]}, {path}): an element takes one image "
                             f"(several images for one element are not supported); {more_references(cfg)}")
        if name not in names:
            raise SystemExit(f"--element {name}: not an element of {args.config}; {more_references(cfg)}")
        given[name] = path
        try:
            images[name] = load_image(path, cfg.data.max_image_pixels, cfg.reference_reading)
            element_inputs(cfg, {name: images[name]}, h, w)  # the loader's preprocessing: a 0-px fit stops here
        except MediaError as e:
            raise SystemExit(f"--element {name}={path}: {str(e).replace(f'{path}: ', '').replace(f' {path}', '')}") from None
    if images and cfg.e2v_type == "none":
        raise SystemExit(f"{args.config} trains plain T2V (e2v_type: none): it takes no --element")
    missing = [e.name for e in cfg.data.elements if e.required and e.name not in images]
    if missing and cfg.conditioning.target_layout == "sequence":
        # the slots follow data.elements' order, absent ones compacted: without a required element the
        # others move into its slot, a layout training never showed
        raise SystemExit(f"--element {missing[0]}=IMAGE is missing: {args.config} trained every sample with its "
                         f"required element(s) {missing} in the first reference slots; give them")
    if cfg.e2v_type != "none" and missing:
        log.info(f"note: required element(s) {missing} not given; sampling without them")
    return images


def resolve_run(args) -> None:
    """Fill --config and --lora from --run (or --config from --lora's run folder), stopping in
    one line when the folder is not a finished run."""
    if args.run is not None:
        if not (args.run / "config.yaml").is_file():
            raise SystemExit(f"--run {args.run}: no config.yaml there; give the run folder train_e2v.py printed "
                             "(runs/<run_id>)")
        if args.lora is None:
            if not (args.run / "lora").is_dir():
                raise SystemExit(f"--run {args.run}: no lora/ yet (the run has not finished); export a checkpoint "
                                 f"with tools/export_lora.py {args.run}/checkpoints/step_N --out DIR, then --lora DIR")
            args.lora = str(args.run / "lora")
    if args.config is None:
        run = args.run or (Path(args.lora).resolve().parent if args.lora else None)
        while run is not None and run.name in ("high_noise", "low_noise", "lora"):  # an expert's folder: lora/<expert>
            run = run.parent
        if run is None or not (run / "config.yaml").is_file():
            raise SystemExit("give --run RUN_FOLDER (a trained run) or --config CONFIG.yaml")
        args.config = str(run / "config.yaml")
        log.info(f"config: {args.config}")


def main(argv=None):
    """The command: argv -> videos written, each named in a log line."""
    args = parse_args(argv)
    resolve_run(args)
    return_freed_memory()
    sets = list(args.set)
    sets += [f"data.num_frames={args.frames}"] if args.frames else []
    if args.height or args.width:
        h, w = args.height or args.width, args.width or args.height
        sets.append(f"data.resolution=[{h},{w}]")
    try:
        cfg = load_config(args.config, sets, check_paths=False)
    except ConfigError as e:
        raise SystemExit(f"config error: {e}")
    require_weights(cfg)
    import torch

    from e2v.eval.sampling import decode, generate, load_trained
    from e2v.eval.viz import write_mp4
    from e2v.models.load import for_sampling, load_parts
    from e2v.models.speed import sampling_problem

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    problem = sampling_problem(cfg, args.device.startswith("cuda"))  # the attention kernel, before any weight loads
    if problem:
        raise SystemExit(f"config error: {problem}")
    v = cfg.validation
    guidance = v.guidance_scale if args.guidance is None else args.guidance
    if args.image_guidance is not None and guidance <= 1:
        raise SystemExit(f"--image-guidance {args.image_guidance:g} cannot act at text guidance {guidance:g}: Phantom's "
                         "dual guidance runs its three passes only when guidance is above 1 (one pass otherwise); "
                         "give --guidance G > 1 too, or drop --image-guidance")
    if args.image_guidance is None and v.image_guidance_scale is not None and guidance <= 1:
        log.info(f"note: validation.image_guidance_scale {v.image_guidance_scale:g} is not used at --guidance "
                 f"{guidance:g} (one pass, no dual guidance)")
    if cfg.task == "causal" and (args.steps or args.shift is not None):
        raise SystemExit("--steps / --shift set the UniPC loop; a causal run samples block by block at its few-step "
                         "list: give --set flow.denoising_step_list=[...] instead (sampling.causal_rollout)")
    prompts = read_prompts(args)
    images = read_elements(args, cfg)
    drop = cfg.reference_frames(list(images)) if args.drop_frames == "ref" else int(args.drop_frames)
    single = args.out.suffix == ".mp4"
    if single and (len(prompts) > 1 or args.num_videos > 1 or args.also_base):
        raise SystemExit("--out FILE.mp4 takes one prompt and one video; give a folder for more")

    # The encoders on the device; the transformer moves in run(). Wan2.2: both experts, whichever the run trained.
    parts = load_parts(cfg, device=args.device, all_experts=True)
    if cfg.model.generator_ckpt:  # the run's base (CausVid's generator weights), before a LoRA attaches to it
        from e2v.models.causvid_ckpt import load_causvid_checkpoint

        load_causvid_checkpoint(parts.transformer, cfg.model.generator_ckpt, cfg.model.generator_ckpt_dict)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")]
    options = dict(num_steps=args.steps or v.num_inference_steps,
                   guidance_scale=guidance,
                   shift=v.sample_shift if args.shift is None else args.shift,
                   image_guidance_scale=v.image_guidance_scale if args.image_guidance is None else args.image_guidance,
                   negative_prompt=v.negative_prompt if args.negative_prompt is None else args.negative_prompt,
                   generator_device=v.generator_device if args.generator_device is None else args.generator_device,
                   device=args.device, dtype=dtype)

    def run(model, tag: str) -> list[Path]:
        written = []
        model = for_sampling(model, args.device, dtype)  # Wan2.2's experts take turns on the device
        for i, prompt in enumerate(prompts):  # one video at a time: a 14B model has no room for batches
            for k in range(args.num_videos):
                t0 = time.perf_counter()
                latents = generate(model, parts, cfg, [prompt], [images], seed=args.seed + k, **options)
                video = decode(latents, parts.vae)[0, drop:]
                path = args.out if single else args.out / tag / f"{i:03d}_{slug(prompt)}_{k}.mp4"
                path.parent.mkdir(parents=True, exist_ok=True)
                write_mp4(path, video, fps=args.fps)
                written.append(path)
                log.info(f"{tag} {path.name}: seed {args.seed + k}, {len(video)} frames, "
                         f"{time.perf_counter() - t0:.1f}s")
        return written

    if not single:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "prompts.txt").write_text("\n".join(prompts) + "\n")
    out = []
    if args.also_base or not args.lora:  # the base first: loading the LoRA changes the model in place
        out += run(parts.transformer, "base")
    if args.lora:
        # Back to the CPU first: a full fine-tune's load_trained returns a second transformer, and
        # two 14B transformers do not fit on one GPU together.
        parts.transformer.to("cpu")
        out += run(load_trained(parts.transformer, args.lora), "lora")
    log.info(f"wrote {len(out)} video(s): {out[0] if single else args.out}")

