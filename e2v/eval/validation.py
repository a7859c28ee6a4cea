"""Validation during training: a loss at fixed sigmas, the reference-use metric, and generated videos.

Held-out split: with `validation.every_n_steps > 0`, `validation.num_samples` sample ids (a seeded
choice, all repeats of an id) are removed from training and only validated on.

Loss at fixed sigmas: every held-out sample at every `validation.sigmas` value, with noise from a
generator seeded by `validation.seed` alone, conditions encoded once (frozen encoders, no dropout,
all elements kept). Nothing touches the training RNGs, so the curve is comparable between runs and
two validations of the same weights give identical numbers.

Reference use (README, "Look at what it learns"): at the same sigmas and
noise, the loss with the references dropped (zero condition, zero mask, zero CLIP tokens, zero
reference frames in the clean_prefix layout: the reference-dropout layout) and with the
references shuffled across samples (sample i gets the references of its partner: the next held-out
sample of its shape, i.e. of its frame and resolution bucket, cyclic within that shape, since a
condition of another latent shape does not fit its latents; with one bucket, sample i+1).
Logged as the plain difference and relative to the true-reference loss:
    val/reference_gap_shuffle     = loss_shuffled - loss_true           (likewise _drop)
    val/reference_gap_shuffle_rel = (loss_shuffled - loss_true) / loss_true
The shuffle gap is taken over the samples that have a partner (loss_true too, for that gap alone;
val/loss and the drop gap cover every sample): a sample alone in its shape is left out of it, and
with no two samples of one shape the shuffle scalars are not logged; either is said once in the log.
positive = the model uses its references (the bar the demo is held to: shuffle gap above 10% of the
true-reference loss, i.e. _rel > 0.1). The shuffle gap is the honest one: a zeroed condition
is out of distribution unless reference dropout was on in training. References matter most at
high noise (at low sigma the noisy input already shows the scene), so the per-sigma gaps are
logged too (`val/reference_gap_shuffle_at_sigma_0.9`, `val/reference_gap_shuffle_rel_at_sigma_0.9`).

Generated videos come from `validation.sets` (prompt + element images), else from the first
`validation.num_videos` held-out samples. `validation.sets` alone (num_samples 0) validates too:
videos only, no losses. Held-out videos are also measured against their references
(e2v/eval/fidelity.py): the CLIP element similarity and its gap to another held-out sample's references,
and with `validation.subject_colour` whether the subject's colour follows its own references
(val/sample_reference_match) and another sample's when given those (val/sample_reference_swap);
`samples/step_N/sheet.png` (TensorBoard `val/generated_sheet`) shows references | frames per video,
each row under a label band: whose references, and each tile's element name or generated frame.

Where the frozen parts are while it runs (what the memory estimate's validation peak models): a
run from the cache (`reads_cache`) takes the held-out samples' text, reference and CLIP conditions
from the cache, so no text encoder is loaded and nothing is encoded; the VAE and the CLIP are kept
on rank 0's host (the only rank that decodes) and visit the device one at a time, each for its
part: the VAE for the decode, then the CLIP for the element similarity of the videos. Other runs
encode with the encoders they hold (an online run keeps them on the device for training anyway; a
cached run with `validation.sets` or a non-empty negative prompt brings them for validation:
models.load.with_encoders; the one-at-a-time visits: models.load.visiting). The decode is tiled
(diffusers' AutoencoderKLWan tiling: frames larger than a 256 px tile go in overlapping tiles, so
its workspace is a tile's, not the frame's);
docs/hardware_load.md.

Wan2.2's two experts (e2v/config/experts.py): each sigma is scored by its expert; a run that trains one
expert scores only that expert's sigmas, and its videos take the other expert's base weights for
the other timesteps, switched at the boundary as diffusers' pipeline switches.

Length (about 570 lines): one Validator whose parts share the held-out conditions, the noise and
the generated videos of one validation (losses, reference gaps and their pairing rule, videos, their
sheet and fidelity); the pieces other modules can own already live there (sampling.py, fidelity.py,
viz.py, models.load's visits). Next to split when it grows: the video half.

Legend: B batch, C channels, T latent frames, h/w latent size, L tokens, D width.
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from e2v.conditioning.cached import CachedReferences
from e2v.conditioning.encode import Conditions
from e2v.conditioning.layout import stack_conditions, with_references
from e2v.config.experts import trains_sigma
from e2v.config.schema import ConfigError
from e2v.config.shapes import vae_space_stride
from e2v.data.dataset import E2VDataset, collate, element_inputs
from e2v.data.media import frames_to_video, load_image
from e2v.data.sample import element_paths, sample_bucket
from e2v.data.store import CacheStore
from e2v.eval.fidelity import element_colour, element_similarity, hit_rate, subject_colour
from e2v.eval.sampling import causal_rollout, decode, denoise, encode_conditions, generate, noise_generator
from e2v.eval.viz import GAP, frame_strip, hstack, label_rows, strip_frames, tile_spans, to_uint8, write_mp4, write_png
from e2v.models.load import load_clip, load_vae, visiting, with_all_experts, with_encoders
from e2v.runtime.device import randn, to_device
from e2v.runtime.log import get_logger
from e2v.train.flow import add_noise, per_sample_mse
from e2v.train.step import predict, prediction_and_target

log = get_logger("e2v")


def shape_groups(shapes: list) -> list[list[int]]:
    """The indices of `shapes` grouped by equal shape, each group in index order, the groups in
    the order of their first index: the samples that may stack into one batch
    (conditioning.layout.stack_conditions concatenates, so one batch holds one latent shape)."""
    groups: dict = {}
    for i, shape in enumerate(shapes):
        groups.setdefault(shape, []).append(i)
    return list(groups.values())


def hold_out_problem(cfg, num_usable: int) -> tuple[str, str] | None:
    """(what is wrong, the fix) when the configured hold-out leaves nothing to train on (every
    usable sample held out for validation), naming the key; None when some sample trains. The one
    rule of split_held_out, asked also by the dry run and tools/check_dataset.py, so a small
    dataset is refused before any weight loads rather than by a traceback at the first step."""
    v = cfg.validation
    if v.every_n_steps <= 0 or v.num_samples < num_usable:
        return None
    fewer = max(1, num_usable // 5) if num_usable > 1 else 0  # about a fifth held out, at least one trains
    return (f"validation.num_samples: {v.num_samples} samples held out for validation, but the dataset has "
            f"{num_usable} usable, so none is left to train on",
            f"hold out fewer (--set validation.num_samples={fewer}), or none (--set validation.every_n_steps=0: "
            "no validation)")


def split_held_out(samples: list, cfg) -> tuple[list, list]:
    """(training samples, held-out validation samples). Off (every_n_steps 0): nothing held out.
    ConfigError (hold_out_problem) when nothing would be left to train."""
    v = cfg.validation
    if v.every_n_steps <= 0:
        return samples, []
    keys = sorted({(s.dataset, s.id) for s in samples})
    problem = hold_out_problem(cfg, len(keys))
    if problem:
        raise ConfigError("; ".join(problem))
    held = set(random.Random(v.seed).sample(keys, v.num_samples))
    train = [s for s in samples if (s.dataset, s.id) not in held]
    seen, val = set(), []
    for s in samples:  # one copy of each held-out id, in index order
        if (s.dataset, s.id) in held and (s.dataset, s.id) not in seen:
            seen.add((s.dataset, s.id))
            val.append(s)
    return train, val


def reads_cache(cfg) -> bool:
    """Whether validation takes every condition from the cache and loads no text or image encoder:
    a run from the cache whose videos are held-out samples' (no `validation.sets`, whose prompts
    and images the cache does not hold) and whose negative prompt, under CFG, is the empty one
    the cache holds (its caption-dropout embedding)."""
    v = cfg.validation
    return cfg.cache.enabled and not v.sets and not (v.guidance_scale > 1 and v.negative_prompt)


@contextlib.contextmanager
def tiled(vae):
    """diffusers' AutoencoderKLWan tiling on while the context is open: a frame larger than a tile
    (256 px by default) is decoded in overlapping tiles blended at the seams, so the decode's
    workspace is a tile's (81 x 480 x 832: ~6 tiles); smaller frames decode whole, as before.
    tests/unit/test_hw_validation.py measures the seams against an untiled decode."""
    if not hasattr(vae, "enable_tiling"):
        yield vae
        return
    was = vae.use_tiling
    vae.use_tiling = True  # enable_tiling() would also reset tile sizes set on the VAE
    try:
        yield vae
    finally:
        vae.use_tiling = was


class Validator:
    """Holds the encoded held-out samples; `maybe_run` validates at step 0, every n steps and at
    the last step. Every rank runs the same work (ZeRO-3 forwards are collectives); rank 0 writes.
    `ema` (e2v/train/ema.py): validation runs with its averaged weights once it has started."""

    def __init__(self, cfg, samples: list, parts, run_dir: Path, *, rank: int, device, dtype, tb=None, ema=None):
        self.cfg, self.samples, self.parts, self.ema = cfg, samples, parts, ema
        self.rank, self.device, self.dtype, self.tb = rank, device, dtype, tb
        self.out = Path(run_dir) / "samples"
        self.conds: list[Conditions] | None = None
        self.images: list[dict] | None = None  # held-out element images, loaded at the first validation
        self.refs: list[dict] | None = None  # the same, preprocessed as conditioning takes them
        self.host: dict = {}  # what validation reuses, read from disk once and kept on the host (models.load)
        self.empty_text_BLD: torch.Tensor | None = None  # the cache's empty-prompt embedding (reads_cache)
        self.said_unpaired = False  # say_unpaired's once
        # Held-out samples give losses, `validation.sets` give videos: either one is work to do.
        self.enabled = cfg.validation.every_n_steps > 0 and bool(samples or cfg.validation.sets)

    def due(self, step: int) -> bool:
        n = self.cfg.validation.every_n_steps
        return self.enabled and (step % n == 0 or step == self.cfg.train.max_steps)

    def maybe_run(self, model, step: int) -> dict:
        if not self.due(step):
            return {}
        was_training = model.training
        model.eval()
        try:  # with the EMA weights once the average has started (train.ema_weight: what lora_ema/ exports)
            with self.frozen_parts() as parts, self.ema.applied() if self.ema else contextlib.nullcontext():
                scalars = self.losses(model, parts) if self.samples else {}
                written, video_scalars = self.videos(model, step, parts)
                scalars.update(video_scalars)
        finally:
            model.train(was_training)
        log.info(f"\nvalidation step {step}: {summary(scalars, written)}")
        return scalars

    @contextlib.contextmanager
    def frozen_parts(self):
        """The parts validation runs with: from the cache (reads_cache), the run's parts with the
        VAE kept on the host (read once, by rank 0 alone: the only rank that decodes); else
        with_encoders' (an online run's own encoders)."""
        if not reads_cache(self.cfg):
            with with_encoders(self.parts, self.cfg, self.device, self.host) as parts:  # a cached run: from the host
                yield parts
            return
        if "vae" not in self.host and self.rank == 0:
            self.host["vae"] = load_vae(self.cfg, "cpu")
        yield replace(self.parts, vae=self.host.get("vae"), text_encoder=None, image_encoder=None)

    # -- loss and reference gaps ------------------------------------------------------------------

    def encode(self, parts=None) -> list[Conditions]:
        """Each held-out sample's conditions alone (B=1), once: no padding depends on batching.
        Encoded by the frozen encoders, or (reads_cache) assembled from its cache entry as a
        training step assembles it, without dropout or a random element choice."""
        if self.conds is None:
            parts, cfg = parts or self.parts, self.cfg
            gen = torch.Generator().manual_seed(cfg.validation.seed)
            cache = CacheStore(cfg) if reads_cache(cfg) else None
            if cache is not None:
                cache.verify_all(self.samples)  # a held-out sample precompute did not cover: named here
            ds = E2VDataset(cfg, self.samples, cache)
            self.conds = []
            with torch.no_grad():
                for i in range(len(ds)):
                    batch = to_device(collate([ds[i]]), self.device)
                    self.conds.append(encode_conditions(parts, cfg, batch, gen))  # encoded, or the cache's entries
                    if cache is not None and self.empty_text_BLD is None:  # the cache's "", padded as a dropped caption
                        self.empty_text_BLD = CachedReferences(batch, parts).text([True])
        return self.conds

    @torch.no_grad()
    def losses(self, model, parts=None) -> dict:
        """Mean MSE per sigma for true / dropped / shuffled references, same noise for all three."""
        v = self.cfg.validation
        conds = self.encode(parts)
        n = len(conds)
        with_refs = self.cfg.e2v_type != "none" and n > 1
        variants = {"true": list(range(n))}
        paired: list[int] = []  # the samples the shuffle gap is taken over: those with a partner
        if with_refs:
            partners = [self.partner(i) for i in range(n)]
            paired = [i for i, p in enumerate(partners) if p is not None]
            self.say_unpaired(n - len(paired))
            if paired:  # a sample alone in its shape keeps its own references there: scored, then left out
                variants["shuffled"] = [i if p is None else p for i, p in enumerate(partners)]
            variants["dropped"] = [None] * n
        totals = {k: [] for k in variants}  # variant -> per-sigma mean loss (shuffled: over `paired`)
        paired_true = []  # per sigma, the true-reference loss over `paired`: the shuffle gap's baseline
        # A run that trains one Wan2.2 expert scores only that expert's sigmas (experts.trains_sigma);
        # each keeps its noise seed, so its numbers match a run that scores them all.
        sigmas = [(si, float(s)) for si, s in enumerate(v.sigmas) if trains_sigma(self.cfg, s)]
        for si, sigma in sigmas:
            per_variant = self.per_sample_losses(model, conds, variants, sigma, seed=v.seed * 1000 + si)
            per_host = {name: per_sample.tolist() for name, per_sample in per_variant.items()}  # once per sigma
            for name, values in per_host.items():
                over = paired if name == "shuffled" else range(n)
                totals[name].append(sum(values[i] for i in over) / len(over))
            if "shuffled" in per_host:
                paired_true.append(sum(per_host["true"][i] for i in paired) / len(paired))
        scored = [s for _, s in sigmas]
        true = totals["true"]
        out = {"val/loss": sum(true) / len(true)}
        out.update({f"val/loss_at_sigma_{s:g}": l for s, l in zip(scored, true)})
        if with_refs:
            for name, tag in (("shuffled", "shuffle"), ("dropped", "drop")):
                if name not in totals:
                    continue
                base = paired_true if name == "shuffled" else true  # the true loss over the same samples
                base_mean = sum(base) / len(base)
                mean = sum(totals[name]) / len(true)
                out[f"val/loss_{name}_refs"] = mean
                out[f"val/reference_gap_{tag}"] = mean - base_mean
                out[f"val/reference_gap_{tag}_rel"] = (mean - base_mean) / base_mean
                for s, l, t in zip(scored, totals[name], base):
                    out[f"val/reference_gap_{tag}_at_sigma_{s:g}"] = l - t
                    out[f"val/reference_gap_{tag}_rel_at_sigma_{s:g}"] = (l - t) / t
        return out

    def per_sample_losses(self, model, conds: list[Conditions], variants: dict[str, list], sigma: float, *,
                          seed: int) -> dict[str, torch.Tensor]:
        """Per variant, the loss of every held-out sample at one sigma (a tensor [n] on the device,
        in the order of `conds`), in micro-batches of one latent shape (shape_groups); the noise
        comes from a generator seeded by `seed` alone, drawn in sample order. A variant names, per
        sample, the sample whose references it gets (None: dropped); that sample has its shape."""
        fl, mb = self.cfg.flow, max(1, self.cfg.train.micro_batch_size)
        gen = torch.Generator().manual_seed(seed)
        noise = [randn(c.latents_BCTHW.shape, gen, c.latents_BCTHW.device) for c in conds]
        shapes = [tuple(c.latents_BCTHW.shape) for c in conds]
        for name, src in variants.items():
            wrong = [(i, j) for i, j in enumerate(src) if j is not None and shapes[j] != shapes[i]]
            if wrong:
                i, j = wrong[0]
                raise ValueError(f"validation variant {name!r}: sample {i} (latents {shapes[i]}) takes the "
                                 f"references of sample {j} (latents {shapes[j]}); a condition must have its shape")
        batches = [g[start:start + mb] for g in shape_groups(shapes) for start in range(0, len(g), mb)]
        per_variant = {k: [] for k in variants}
        for idx in batches:
            target_c = stack_conditions([conds[i] for i in idx])
            latents = target_c.latents_BCTHW
            noise_B = torch.cat([noise[i] for i in idx])
            sigma_B = torch.full((len(idx),), sigma, device=latents.device)
            noisy = add_noise(latents, noise_B, sigma_B)
            for name, src in variants.items():
                refs = None if src[0] is None else stack_conditions([conds[src[i]] for i in idx])
                c = with_references(target_c, refs)
                pred = predict(model, noisy, 1000 * sigma_B, c, c.text_BLD, self.dtype)
                pred, target = prediction_and_target(fl, pred, noisy, sigma_B, latents, noise_B)
                per_variant[name].append(per_sample_mse(pred, target))
        back = torch.tensor([i for idx in batches for i in idx]).argsort()  # batch order -> sample order
        return {k: torch.cat(v)[back.to(v[0].device)] for k, v in per_variant.items()}

    def say_unpaired(self, alone: int) -> None:
        """Log once that `alone` held-out samples have no partner of their shape (none: silent)."""
        if alone and not self.said_unpaired:
            self.said_unpaired = True
            n = len(self.samples)
            what = ("no two share a frame/resolution bucket, so the shuffle gap is not logged" if alone == n else
                    f"{alone} of {n} are alone in their frame/resolution bucket, so the shuffle gap is taken "
                    f"over the other {n - alone}")
            log.warning(f"validation: the references are shuffled only between held-out samples of one latent "
                        f"shape; {what} (hold out more samples, validation.num_samples, to give each a partner)")

    # -- generated videos -------------------------------------------------------------------------

    def video_inputs(self) -> list[tuple[str, dict]]:
        """(prompt, element images) to generate from: `validation.sets`, else the first
        `validation.num_videos` held-out samples with their own references."""
        v, limit = self.cfg.validation, self.cfg.data.max_image_pixels
        chosen = v.sets or self.samples[: v.num_videos]
        read = self.cfg.reference_reading
        return [(s.prompt, {k: load_image(p, limit, read) for k, p in element_paths(s).items()}) for s in chosen]

    def generate(self, model, parts, inputs: list[tuple[str, dict]]) -> torch.Tensor:
        """Latents of (prompt, element images) pairs, with the noise of `validation.seed`: row k
        gets the same noise in every call with as many rows."""
        v = self.cfg.validation
        return generate(model, parts, self.cfg, [p for p, _ in inputs], [e for _, e in inputs], seed=v.seed,
                        num_steps=v.num_inference_steps, guidance_scale=v.guidance_scale, shift=v.sample_shift,
                        image_guidance_scale=v.image_guidance_scale, generator_device=v.generator_device,
                        negative_prompt=v.negative_prompt, device=self.device, dtype=self.dtype)

    def cached_video_groups(self) -> list[list[int]]:
        """The first `validation.num_videos` held-out samples by bucket (shape_groups): generated
        from the cache, each video has its sample's latent shape, and one batch holds one shape."""
        k = min(self.cfg.validation.num_videos, len(self.samples))
        return shape_groups([sample_bucket(s, self.cfg) for s in self.samples[:k]])

    def swap_source(self, k: int) -> int:
        """Whose references the swapped video k is made with: its partner's, or (alone in its bucket)
        its own, a row that keeps the batch's noise rows in step and that the sheet and the swap
        scalar leave out."""
        p = self.partner(k)
        return k if p is None else p

    def generate_from_cache(self, model, parts, partners: bool) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """What `generate` makes for the first `validation.num_videos` held-out samples, from their
        cached conditions (reads_cache), one batch per bucket (cached_video_groups): the noise of
        `validation.seed` drawn first, as generate draws it (groups in turn from the one generator);
        the negative prompt is the empty one. With `partners`, also each sample with its partner's
        references (same prompt, same noise). Returns (latents, swapped or None), a tensor per group."""
        v = self.cfg.validation
        conds = self.encode(parts)
        generator = noise_generator(v.seed, v.generator_device, self.device)
        negative = self.empty_text_BLD if v.guidance_scale > 1 else None
        run = dict(num_steps=v.num_inference_steps, guidance_scale=v.guidance_scale, shift=v.sample_shift,
                   dtype=self.dtype, rollout=causal_rollout(self.cfg))
        latents, swapped = [], [] if partners else None
        for group in self.cached_video_groups():
            c = stack_conditions([conds[i] for i in group])
            noise = randn(c.latents_BCTHW.shape, generator, c.latents_BCTHW.device)
            latents.append(denoise(model, c, negative, noise, **run))
            if partners:
                others = stack_conditions([conds[self.swap_source(i)] for i in group])
                swapped.append(denoise(model, with_references(c, others), negative, noise, **run))
        return latents, swapped

    def decode(self, groups: list[list[int]], latents: list[torch.Tensor], vae) -> list[np.ndarray]:
        """uint8 videos [F,H,W,3] of the latents (one tensor per group of video indices), in video
        order, tiled; a VAE kept on the host (reads_cache) visits the device for it."""
        videos = [None] * sum(map(len, groups))
        with visiting(vae, self.device) if reads_cache(self.cfg) else contextlib.nullcontext(), tiled(vae):
            for group, latents_BCTHW in zip(groups, latents):
                for k, video in zip(group, decode(latents_BCTHW, vae)):
                    videos[k] = video
        return videos

    def videos(self, model, step: int, parts=None) -> tuple[int, dict]:
        """Generate, and on rank 0 write mp4 + prompt + TensorBoard strip; for held-out videos
        also the sheet (references | frames, and the swapped generation beside it) and the
        fidelity scalars. Returns (videos generated, scalars)."""
        v, parts = self.cfg.validation, parts or self.parts
        inputs = self.video_inputs()
        if not inputs:
            return 0, {}
        with with_all_experts(model, parts, self.cfg, self.device, self.dtype, self.host) as full:  # Wan2.2
            if reads_cache(self.cfg):
                groups = self.cached_video_groups()
                latents, swapped = self.generate_from_cache(full, parts, partners=v.subject_colour is not None)
            else:  # every video at the config's size (element_item): one batch
                groups = [list(range(len(inputs)))]
                latents, swapped = [self.generate(full, parts, inputs)], None
                if v.subject_colour is not None:  # sample k with its partner's references: same prompt, same noise
                    images = self.held_out_images()
                    swapped = [self.generate(full, parts,
                                             [(p, images[self.swap_source(k)]) for k, (p, _) in enumerate(inputs)])]
        if self.rank != 0:
            return len(inputs), {}
        videos = self.decode(groups, latents, parts.vae)
        folder = self.out / f"step_{step:06d}"
        folder.mkdir(parents=True, exist_ok=True)
        for k, ((prompt, images), video) in enumerate(zip(inputs, videos)):
            write_mp4(folder / f"{k:02d}.mp4", video)
            (folder / f"{k:02d}.txt").write_text(prompt + "\n")
            refs = [np.asarray(img.resize(video.shape[2:0:-1])) for img in images.values()]
            strip = frame_strip(refs, video)
            if self.tb is not None:  # e2v.train.runlog.Boards: the strip, and the mp4 where a board shows videos
                self.tb.add_image(f"val/video_{k:02d}", strip, step, dataformats="HWC")
                self.tb.add_video_file(f"val/video_{k:02d}_mp4", folder / f"{k:02d}.mp4", step)
        if v.sets:  # prompts and images without held-out peers: nothing to compare with
            return len(inputs), {}
        swapped = None if swapped is None else self.decode(groups, swapped, parts.vae)
        sheet = self.generated_sheet(videos, swapped)
        write_png(folder / "sheet.png", sheet)
        if self.tb is not None:
            self.tb.add_image("val/generated_sheet", sheet, step, dataformats="HWC")
        if reads_cache(self.cfg) and self.cfg.uses_clip:  # the CLIP alone, on the host; it visits for the metric
            if "clip" not in self.host:
                self.host["clip"] = load_clip(self.cfg, "cpu")
            encoder, processor = self.host["clip"]
            with visiting(encoder, self.device):
                return len(inputs), self.fidelity(videos, swapped, replace(parts, image_encoder=encoder,
                                                                           image_processor=processor))
        return len(inputs), self.fidelity(videos, swapped, parts)

    # -- do the held-out videos follow their references (e2v/eval/fidelity.py) -------------------------

    def held_out_images(self) -> list[dict]:
        """Every held-out sample's element images (PIL), loaded once."""
        if self.images is None:
            limit = self.cfg.data.max_image_pixels
            read = self.cfg.reference_reading
            self.images = [{k: load_image(p, limit, read) for k, p in element_paths(s).items()} for s in self.samples]
        return self.images

    def plate(self, background) -> np.ndarray | None:
        """A background reference (PIL) where the clip shows it: through the clip's own resize
        (data.video_resize, data.reshape_mode), not the condition's preprocessing. The two agree for
        A2's `center_crop` background; a letterboxed one (`fit_pad_white`: SkyReels-V3's loader) is
        shrunk between white bands, and the subject colour read against it would be read off the bands."""
        if background is None:
            return None
        d = self.cfg.data
        frames = frames_to_video(np.asarray(background)[None], *d.resolution, d.video_resize, d.reshape_mode)
        return frames[:, 0].permute(1, 2, 0).numpy()

    def partner(self, k: int) -> int | None:
        """The held-out sample whose references sample k is shuffled with (the loss), and video k
        compared with (and, swapped, made with): the next held-out sample of its bucket (which fixes
        its latent shape), cyclic within the bucket; None when k is alone in its bucket."""
        group = next(g for g in shape_groups([sample_bucket(s, self.cfg) for s in self.samples]) if k in g)
        return None if len(group) == 1 else group[(group.index(k) + 1) % len(group)]

    def element_inputs(self) -> list[dict]:
        """Per held-out sample, its references as conditioning takes them (data.element_inputs):
        uint8 HWC at the video's size (`vae`) and at the CLIP resolution (`clip`); made once."""
        if self.refs is None:
            h, w = self.cfg.data.resolution
            self.refs = []
            for images in self.held_out_images():
                inputs = element_inputs(self.cfg, images, h, w)
                self.refs.append({"vae": {k: to_uint8(t) for k, t in inputs["vae_refs"].items()},
                                  "clip": inputs["clip_refs"]})
        return self.refs

    def generated_sheet(self, videos: np.ndarray, swapped: np.ndarray | None) -> np.ndarray:
        """One row per held-out video: its references (as the VAE condition takes them) | every 4th
        frame; with the swap, then the partner's references | the frames made with them (none for a
        sample alone in its bucket: no partner). Above
        each row, what it is (the sample, whose references) and each tile's role (the element
        name, `gen fN` the generated frame N, `swap fN` the frame made with the partner's)."""
        refs = [r["vae"] for r in self.element_inputs()]
        rows, lines = [], []
        for k, video in enumerate(videos):
            frames = strip_frames(len(video))
            halves = [(refs[k], video, "gen", f"{self.samples[k].id}: its references -> generated")]
            p = self.partner(k)
            if swapped is not None and p is not None:  # alone in its bucket: no partner to swap with
                halves.append((refs[p], swapped[k], "swap", f"references of {self.samples[p].id}, same prompt+noise"))
            tiles, heads, names, x = [], [], [], 0
            for i, (own, frames_of, tag, head) in enumerate(halves):
                strip = frame_strip(list(own.values()), frames_of)
                if i:  # a wider gap between the halves: GAP | spacer | GAP
                    tiles.append(np.full((video.shape[1], 3 * GAP, 3), 255, np.uint8))
                    x += 5 * GAP
                widths = [t.shape[1] for t in own.values()] + [video.shape[2]] * len(frames)
                heads.append((x, strip.shape[1], head))
                names += tile_spans(widths, [*own, *(f"{tag} f{f}" for f in frames)], x)
                tiles.append(strip)
                x += strip.shape[1]
            rows.append(hstack(tiles))
            lines.append([heads, names])
        return label_rows(rows, lines)

    def fidelity(self, videos: np.ndarray, swapped: np.ndarray | None, parts) -> dict:
        """val/element_similarity[_gap][_<element>] with the CLIP at hand (none: skipped), and with
        `validation.subject_colour` val/sample_reference_match and (given the swapped videos)
        val/sample_reference_swap."""
        refs, sc, out = self.element_inputs(), self.cfg.validation.subject_colour, {}
        partners = [self.partner(k) for k in range(len(videos))]
        if parts.image_encoder is not None and any(r["clip"] for r in refs[: len(videos)]):
            sims = element_similarity(list(videos), [r["clip"] for r in refs], partners, parts.image_encoder,
                                      parts.image_processor)
            values = torch.stack([x for own, other in sims.values() for x in (own.mean(), (own - other).nanmean())])
            values = values.tolist()  # the one copy to the host
            compared = any(p is not None for p in partners)  # no video with a partner: no gap to log
            for i, name in enumerate(sims):
                out[f"val/element_similarity_{name}"] = values[2 * i]
                if compared:
                    out[f"val/element_similarity_gap_{name}"] = values[2 * i + 1]
            out["val/element_similarity"] = float(np.mean(values[0::2]))
            if compared:
                out["val/element_similarity_gap"] = float(np.nanmean(values[1::2]))
        if sc is not None:
            images, block = self.held_out_images(), vae_space_stride(parts.vae.config)
            candidates = [element_colour(np.asarray(im[sc.subject])) for im in images]
            plates = [self.plate(im.get(sc.background)) for im in images]  # one per sample, read by its two videos
            distractors = [[element_colour(np.asarray(im[d])) for d in sc.distractors if d in im] for im in images]

            def measured(video, j):  # video made with the references of held-out sample j
                return subject_colour(video, plates[j], distractors[j], block)

            out["val/sample_reference_match"] = hit_rate([measured(x, k) for k, x in enumerate(videos)], candidates,
                                                         list(range(len(videos))))
            paired = [k for k, p in enumerate(partners) if p is not None]
            if swapped is not None and paired:  # the videos with a partner (swap_source)
                out["val/sample_reference_swap"] = hit_rate([measured(swapped[k], partners[k]) for k in paired],
                                                            candidates, [partners[k] for k in paired])
        return out


def summary(scalars: dict, videos: int) -> str:
    """The console line: loss, the gaps as difference and percent of the true loss, what the
    generated videos took from their references, videos."""
    parts = [f"loss {scalars['val/loss']:.4f}"] if "val/loss" in scalars else []
    for tag in ("shuffle", "drop"):
        if f"val/reference_gap_{tag}" in scalars:
            parts.append(f"{tag} gap {scalars[f'val/reference_gap_{tag}']:+.3f} "
                         f"({100 * scalars[f'val/reference_gap_{tag}_rel']:+.1f}%)")
    if "val/sample_reference_match" in scalars:
        swap = scalars.get("val/sample_reference_swap")
        parts.append(f"subject colour follows the references: match {scalars['val/sample_reference_match']:.2f}"
                     + ("" if swap is None else f", swap {swap:.2f}"))
    if "val/element_similarity" in scalars:
        gap = scalars.get("val/element_similarity_gap")
        parts.append(f"CLIP element similarity {scalars['val/element_similarity']:.3f}"
                     + ("" if gap is None else f" (gap {gap:+.3f})"))
    if videos:
        parts.append(f"{videos} video(s)")
    return ", ".join(parts)
