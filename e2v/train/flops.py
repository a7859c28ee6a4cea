"""The FLOP model of one transformer training step, the one home of "how much arithmetic is a step":
the progress bar's and TensorBoard's MFU (`perf/mfu`), the benchmark's (bench/bench.py) and the
GPU check's speed section (bench/gpulib/speed_section.py) all divide its figure by a time.
docs/speed.md says how to read it.

What is counted: the matrix products of diffusers' WanTransformer3DModel, read from its config
(num_layers, num_attention_heads x attention_head_dim = D, ffn_dim, in_channels, patch_size,
text_dim, image_dim, added_kv_proj_dim, freq_dim), 2 FLOPs per multiply-add. Per sample, with S
video tokens (the clip's latent frames plus the reference frames the clean_prefix / sequence layouts
put in the sequence: e2v/conditioning/layout.py), Ct text tokens (512), Ci image tokens (257 per
CLIP reference), F the FFN width, K layers:

    patch embedding     S x (in_channels x prod(patch)) x D          (a Conv3d with stride = kernel)
    time embedder       1 x (freq_dim x D + D x D + D x 6D)          (S rows with per-token timesteps)
    text embedder       Ct x (text_dim x D + D x D)
    image embedder      Ci x (image_dim x image_dim + image_dim x D)
    per block  self-attention q, k, v, out    S x 4 D^2
               cross-attention q, out          S x 2 D^2
               cross-attention k, v on text    Ct x 2 D^2
               image k, v (add_k/add_v_proj)   Ci x 2 added_kv_proj_dim x D
               FFN                             S x 2 D F
               attention QK^T and AV           2 S^2 D (self) + 2 S (Ct + Ci) D (cross)
    head (proj_out)     S x D x (out_channels x prod(patch))

Norms, rotary embeddings, softmax, modulation and the loss are elementwise: not counted (under 1%
of a real step). Backward: per linear, the input-gradient (as many FLOPs as its forward) wherever the
gradient must flow on (every block layer on the video tokens and the head; the context's k / v only
when the embedder before them trains; an embedder's later layers when an earlier one trains; never
the patch embedding and the embedders' first layers, whose inputs are data), and the
weight-gradient (as many again) only where the weight trains: a LoRA run's frozen base weights cost
their input-gradients, not their weight-gradients. A LoRA of rank r on a linear of k inputs and n
outputs adds r (k + n) per row forward, and in backward both its weight-gradients, B's input-gradient
and A's input-gradient (when the base's is counted). Attention's backward: twice its forward (dQ,
dK, dV), once for a cross-attention whose keys and values need no gradient (neither their
projections nor the embedder before them train: dQ only); a flash kernel's recomputation of the
scores inside its backward, and the dK / dV a fused kernel computes anyway, are not counted.
Gradient checkpointing recomputes every block's forward once more.

Two totals: `model` = forward + backward (the arithmetic the step needs; MFU, comparable with
published MFU figures, which leave recomputation out) and `hardware` = model + the recomputed
forward (what the GPU executed; HFU). Context parallelism (parallel.ulysses_degree x ring_degree = P
ranks per sample) splits the video tokens' linears and all of the attention P ways; the embedders
and the context's k / v run whole on every rank: the figures are per rank.

Peak dense bf16 TFLOPS per GPU (PEAK_BF16_TFLOPS, from the makers' data sheets, not the sparsity
figures) are matched from torch.cuda.get_device_name(); `train.peak_tflops` overrides; an unknown
GPU or a CPU gets no MFU (tokens per second and TFLOPS per GPU are still logged).

Legend: S video tokens, Ct text tokens, Ci image tokens, D width, F FFN width, K layers, P ranks
sharing a sample's tokens, r a LoRA's rank.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

TEXT_TOKENS = 512  # Wan's cross-attention splits image | text at the last 512 context tokens (e2v.config.shapes)

# Dense bf16 tensor-core TFLOPS (FP32 accumulate, no 2:4 sparsity), first match of the pattern in
# torch.cuda.get_device_name() wins (so PCIe / NVL before the plain name). The sources are the
# makers' data sheets; their headline figures are "with sparsity", twice these.
PEAK_BF16_TFLOPS: tuple[tuple[str, str, float, str], ...] = (
    (r"H100.*PCIe", "H100 PCIe", 756.0, "NVIDIA H100 data sheet: BF16 1,513 TFLOPS with sparsity"),
    (r"H100.*NVL", "H100 NVL", 835.0, "NVIDIA H100 data sheet: BF16 1,671 TFLOPS with sparsity"),
    (r"H100", "H100 SXM", 989.0, "NVIDIA H100 data sheet: BF16 1,979 TFLOPS with sparsity"),
    (r"H200.*NVL", "H200 NVL", 835.0, "NVIDIA H200 data sheet: BF16 1,671 TFLOPS with sparsity"),
    (r"H200", "H200 SXM", 989.0, "NVIDIA H200 data sheet: BF16 1,979 TFLOPS with sparsity"),
    (r"(?<!G)B200", "B200", 2250.0, "NVIDIA HGX B200 data sheet: FP16/BF16 4.5 PFLOPS per GPU with sparsity"),
    (r"A100", "A100", 312.0, "NVIDIA A100 data sheet: BF16 312 TFLOPS (624 with sparsity)"),
    (r"L40S", "L40S", 362.05, "NVIDIA L40S data sheet: BF16 362.05 TFLOPS (733 with sparsity)"),
    (r"RTX 6000 Ada", "RTX 6000 Ada", 364.2,
     "NVIDIA Ada Lovelace architecture whitepaper, RTX 6000 Ada: BF16 with FP32 accumulate 364.2 TFLOPS (728.5 with sparsity)"),
    (r"RTX 4090", "GeForce RTX 4090", 165.2,
     "NVIDIA Ada Lovelace architecture whitepaper, RTX 4090: BF16 with FP32 accumulate 165.2 TFLOPS (330.4 with sparsity)"),
)


def peak_tflops(override: float | None, device_name: str | None) -> tuple[float | None, str]:
    """(dense bf16 TFLOPS of one GPU, where the figure comes from): `train.peak_tflops` when set,
    else the table's entry for `device_name` (torch.cuda.get_device_name()), else None (a CPU, or a
    GPU the table lacks: no MFU; set train.peak_tflops to the data sheet's dense figure)."""
    if override is not None:
        return float(override), "train.peak_tflops"
    if device_name:
        for pattern, card, tflops, source in PEAK_BF16_TFLOPS:
            if re.search(pattern, device_name):
                return tflops, f"{card} ({source})"
        return None, f"{device_name} is not in e2v.train.flops.PEAK_BF16_TFLOPS: set train.peak_tflops for an MFU"
    return None, "no GPU"


def device_peak_tflops(override: float | None) -> tuple[float | None, str]:
    """peak_tflops for this process's CUDA device (none without CUDA)."""
    import torch

    return peak_tflops(override, torch.cuda.get_device_name() if torch.cuda.is_available() else None)


@dataclass(frozen=True)
class Tokens:
    """One sample's sequence lengths as the transformer sees them."""
    video: int  # S: patches of the clip's latent frames and of the reference frames in the sequence
    text: int = TEXT_TOKENS
    image: int = 0  # CLIP tokens (257 per reference) read by add_k_proj / add_v_proj
    per_token_time: bool = False  # the clean_prefix layout: one timestep per token


@dataclass(frozen=True)
class Linear:
    """One matrix product of the forward: `rows` x `k` by `k` x `n` per sample, on the video tokens
    (`split`: divided among the context-parallel ranks) or on the context / once per sample."""
    name: str  # the module's name in the transformer ("blocks.3.attn1.to_q"), what trains is read by it
    rows: int
    k: int
    n: int
    split: bool
    grad_in: str = "always"  # whether its input-gradient is computed: always | never | <module prefix that must train>


@dataclass(frozen=True)
class StepFlops:
    """FLOPs on one rank: forward, backward and the forward that gradient checkpointing recomputes;
    `video_tokens`: the video tokens of the samples they cover (all ranks of a context-parallel group
    count the whole sample's)."""
    forward: float = 0.0
    backward: float = 0.0
    recompute: float = 0.0
    video_tokens: int = 0

    @property
    def model(self) -> float:
        """The step's own arithmetic (forward + backward): what MFU divides."""
        return self.forward + self.backward

    @property
    def hardware(self) -> float:
        """What the GPU executes, the recomputed forward included (HFU)."""
        return self.model + self.recompute

    def __add__(self, other: "StepFlops") -> "StepFlops":
        return StepFlops(self.forward + other.forward, self.backward + other.backward,
                         self.recompute + other.recompute, self.video_tokens + other.video_tokens)

    def times(self, n: int) -> "StepFlops":
        return StepFlops(n * self.forward, n * self.backward, n * self.recompute, n * self.video_tokens)


@dataclass(frozen=True)
class Training:
    """How each linear trains: `weights` holds the names whose weight trains in full, `lora` the
    LoRA rank by name (0 or absent: none). `trained_prefixes` holds the module prefixes with any
    trained parameter (what decides the input-gradients of `Linear.grad_in`)."""
    weights: frozenset = frozenset()
    lora: Mapping[str, int] = field(default_factory=dict)
    trained_prefixes: frozenset = frozenset()
    everything: bool = False  # a full fine-tune: every weight trains

    def trains(self, name: str) -> bool:
        return self.everything or name in self.weights

    def rank(self, name: str) -> int:
        return self.lora.get(name, 0)

    def any_trained(self, prefix: str) -> bool:
        return self.everything or any(p == prefix or p.startswith(prefix + ".") for p in self.trained_prefixes)


FULL = Training(everything=True)


def linears(config: Mapping, tok: Tokens) -> list[Linear]:
    """Every matrix product of one forward of one sample but attention's (module docstring's table)."""
    c = dict(config)
    d = c["num_attention_heads"] * c["attention_head_dim"]
    patch = math.prod(c["patch_size"])
    out_channels = c.get("out_channels") or c["in_channels"]
    s, ct, ci = tok.video, tok.text, tok.image if c.get("added_kv_proj_dim") else 0
    time_rows = s if tok.per_token_time else 1
    time, text, image = (f"condition_embedder.{e}" for e in ("time_embedder", "text_embedder", "image_embedder"))
    # An embedder's first layer reads data (no input-gradient); the next ones need theirs when a layer before trains.
    out = [Linear("patch_embedding", s, c["in_channels"] * patch, d, True, "never"),
           Linear(f"{time}.linear_1", time_rows, c["freq_dim"], d, tok.per_token_time, "never"),
           Linear(f"{time}.linear_2", time_rows, d, d, tok.per_token_time, f"{time}.linear_1"),
           Linear("condition_embedder.time_proj", time_rows, d, 6 * d, tok.per_token_time, time),
           Linear(f"{text}.linear_1", ct, c["text_dim"], d, False, "never"),
           Linear(f"{text}.linear_2", ct, d, d, False, f"{text}.linear_1")]
    if c.get("image_dim") and ci:
        # the image tokens pass a LayerNorm with learnable scale and shift (norm1) before the first layer
        out += [Linear(f"{image}.ff.net.0.proj", ci, c["image_dim"], c["image_dim"], False, f"{image}.norm1"),
                Linear(f"{image}.ff.net.2", ci, c["image_dim"], d, False, f"{image}.ff.net.0.proj")]
    for i in range(c["num_layers"]):
        b = f"blocks.{i}"
        out += [Linear(f"{b}.attn1.{p}", s, d, d, True) for p in ("to_q", "to_k", "to_v", "to_out.0")]
        out += [Linear(f"{b}.attn2.{p}", s, d, d, True) for p in ("to_q", "to_out.0")]
        out += [Linear(f"{b}.attn2.{p}", ct, d, d, False, text) for p in ("to_k", "to_v")]
        if ci:
            out += [Linear(f"{b}.attn2.{p}", ci, c["added_kv_proj_dim"], d, False, image)
                    for p in ("add_k_proj", "add_v_proj")]
        out += [Linear(f"{b}.ffn.net.0.proj", s, d, c["ffn_dim"], True), Linear(f"{b}.ffn.net.2", s, c["ffn_dim"], d, True)]
    out.append(Linear("proj_out", s, d, out_channels * patch, True))
    return out


@dataclass(frozen=True)
class Attention:
    """One attention of one block: its products QK^T and AV (2 x queries x keys x D multiply-adds
    forward), and which linears make its keys and values (their gradients are needed when one of
    them, or the embedder before them, trains)."""
    layer: int
    macs: float
    kv: tuple[str, ...] = ()  # () : self-attention, whose keys come from the video tokens
    embedder: str = ""


def attentions(config: Mapping, tok: Tokens) -> list[Attention]:
    """Every attention of one forward of one sample: self, text cross, image cross per block."""
    c = dict(config)
    d = c["num_attention_heads"] * c["attention_head_dim"]
    s = tok.video
    out = []
    for i in range(c["num_layers"]):
        b = f"blocks.{i}.attn2"
        out += [Attention(i, 2 * s * s * d),
                Attention(i, 2 * s * tok.text * d, (f"{b}.to_k", f"{b}.to_v"), "condition_embedder.text_embedder")]
        if tok.image and c.get("added_kv_proj_dim"):
            out.append(Attention(i, 2 * s * tok.image * d, (f"{b}.add_k_proj", f"{b}.add_v_proj"),
                                 "condition_embedder.image_embedder"))
    return out



def sample_flops(config: Mapping, tok: Tokens, training: Training = FULL, *, checkpointing: bool = False,
                 cp: int = 1) -> StepFlops:
    """One sample's forward, backward and recomputed forward on one of the `cp` ranks that share its
    tokens (module docstring)."""
    fwd = bwd = block_fwd = 0.0
    for lin in linears(config, tok):
        share = 1 / cp if lin.split else 1.0
        base = lin.rows * lin.k * lin.n * share
        r = training.rank(lin.name)
        lora = lin.rows * r * (lin.k + lin.n) * share
        flows = lin.grad_in == "always" or (lin.grad_in != "never" and training.any_trained(lin.grad_in))
        fwd += base + lora
        bwd += (base if flows else 0) + (base if training.trains(lin.name) else 0)
        if r:  # both LoRA weight-gradients, B's input-gradient, A's when the gradient flows on
            bwd += lin.rows * r * (lin.k + 2 * lin.n + (lin.k if flows else 0)) * share
        if lin.name.startswith("blocks."):
            block_fwd += base + lora
    for a in attentions(config, tok):
        # backward: dQ (dO V^T, then dS K) always; dK and dV (dS^T Q, P^T dO) when the keys and values
        # carry a gradient: self-attention's always, the context's when their projections train
        kv_grad = not a.kv or training.any_trained(a.embedder) or any(
            training.trains(n) or training.rank(n) for n in a.kv)
        fwd, block_fwd = fwd + a.macs / cp, block_fwd + a.macs / cp
        bwd += (2 if kv_grad else 1) * a.macs / cp
    return StepFlops(2 * fwd, 2 * bwd, 2 * block_fwd if checkpointing else 0.0, tok.video)


def training_of(model) -> Training:
    """What trains in a transformer as built for training (e2v.models.trainable.setup_training: the
    LoRA adapters injected, train.trainable unfrozen): read from its modules, so the count follows
    whatever the config made of it. A Wan2.2 pair (TwoExperts): the first expert's (one runs per step)."""
    model = next(iter(model.experts.values())) if hasattr(model, "experts") else model
    weights, lora, prefixes = set(), {}, set()
    for name, p in model.named_parameters():
        if p.requires_grad:
            prefixes.add(_plain(name).rsplit(".", 1)[0])
    for name, module in model.named_modules():
        name = _plain(name)
        base = getattr(module, "base_layer", None)
        if base is not None and hasattr(module, "r"):  # a peft LoRA layer: its rank, and its base's weight
            lora[name] = sum(module.r.get(a, 0) for a in module.active_adapters)
            module = base
        weight = getattr(module, "weight", None)
        if weight is not None and weight.requires_grad and ".base_layer" not in name and ".lora_" not in name:
            weights.add(name)
    return Training(frozenset(weights), lora, frozenset(_strip_lora(p) for p in prefixes))


def _plain(name: str) -> str:
    """A module's name as the config's layout gives it: without the `_orig_mod` a compiled wrapper adds."""
    return name.replace("._orig_mod", "").removeprefix("_orig_mod.")


def _strip_lora(prefix: str) -> str:
    """blocks.0.attn1.to_q.lora_A.default -> blocks.0.attn1.to_q (the trained module's own name)."""
    return re.sub(r"\.(lora_[AB]|base_layer)(\.\w+)?$", "", prefix)


def config_tokens(cfg) -> Tokens:
    """One sample's tokens at the config's data.num_frames x data.resolution (e2v.models.plan.tokens:
    the reference frames in the sequence included)."""
    from e2v.models.plan import per_token_time, tokens

    s, context = tokens(cfg)
    return Tokens(video=s, text=TEXT_TOKENS, image=context - TEXT_TOKENS, per_token_time=per_token_time(cfg))


@dataclass(frozen=True)
class MicroBatch:
    """What the FLOP count needs of one micro-batch's conditions (e2v.conditioning.encode.Conditions):
    its size and the shape of the model input, the reference frames in the sequence included."""
    batch: int
    frames: int  # latent frames: the clip's plus the references' (clean_prefix, sequence layouts)
    height: int  # latent height and width
    width: int
    text: int
    image: int
    per_token_time: bool

    @classmethod
    def of(cls, c) -> "MicroBatch":
        b, _, t, h, w = c.latents_BCTHW.shape
        refs = 0 if c.ref_latents_BCNhw is None else c.ref_latents_BCNhw.shape[2]
        return cls(b, t + refs, h, w, c.text_BLD.shape[1], 0 if c.clip_BLD is None else c.clip_BLD.shape[1],
                   c.ref_layout == "clean_prefix")

    def tokens(self, patch_size) -> Tokens:
        pt, ph, pw = patch_size
        return Tokens(video=(self.frames // pt) * (self.height // ph) * (self.width // pw), text=self.text,
                      image=self.image, per_token_time=self.per_token_time)


class FlopCounter:
    """A step's FLOPs on this rank from what it ran: each micro-batch's shapes (the loop's
    StepRecord.micro_batches), the transformer's config and what trains in it (read once, at start)."""

    def __init__(self, model, cfg):
        self.config = dict(model.config)
        self.training = training_of(model)
        self.checkpointing = cfg.train.gradient_checkpointing
        self.cp = cfg.parallel.ulysses_degree * cfg.parallel.ring_degree
        self._per_sample: dict[Tokens, StepFlops] = {}

    def step(self, micro_batches: list[MicroBatch]) -> StepFlops:
        total = StepFlops()
        for m in micro_batches:
            tok = m.tokens(self.config["patch_size"])
            if tok not in self._per_sample:
                self._per_sample[tok] = sample_flops(self.config, tok, self.training, checkpointing=self.checkpointing,
                                                     cp=self.cp)
            total = total + self._per_sample[tok].times(m.batch)
        return total


def perf_scalars(flops: StepFlops | None, step_time: float, data_parallel: int, peak: float | None) -> dict:
    """The speed scalars of a step from its FLOPs on one rank (every rank's step is the same work):
    video tokens per second over the whole run (every data-parallel group), TFLOPS per GPU (model
    FLOPs), MFU and HFU against the GPU's dense bf16 peak (when known)."""
    if flops is None or not flops.video_tokens:
        return {}
    out = {"perf/tokens_per_s": flops.video_tokens * data_parallel / step_time,
           "perf/tflops_per_gpu": flops.model / step_time / 1e12}
    if peak:
        out["perf/mfu"] = out["perf/tflops_per_gpu"] / peak
        out["perf/hfu"] = flops.hardware / step_time / 1e12 / peak
    return out


def config_flops(cfg, model=None) -> StepFlops:
    """One optimizer step's FLOPs on one rank at the config's data.num_frames x data.resolution
    (micro_batch_size x gradient_accumulation_steps samples), for `model` as built for training, or
    the config's own built on the meta device (e2v.models.plan.preflight: nothing loaded)."""
    if model is None:
        from e2v.models.plan import preflight

        model = preflight(cfg)[0]
    per_sample = sample_flops(dict(model.config), config_tokens(cfg), training_of(model),
                              checkpointing=cfg.train.gradient_checkpointing,
                              cp=cfg.parallel.ulysses_degree * cfg.parallel.ring_degree)
    return per_sample.times(cfg.train.micro_batch_size * cfg.train.gradient_accumulation_steps)
