"""Will it fit? Per-GPU memory under DDP and under FSDP2 sharding, from exact sizes and no allocation.

Used by `pretrain_main.py --dry-run` and callable by the supervisor (`estimate` + `format_estimate`, no torch import
for a model described by the config's fields). `--dry-run` sizes the model built on the meta device, so an
8B-parameter preset costs nothing to inspect. The figures are estimates:
weights, gradients and optimizer state are exact byte counts for this code's choices (fp32 master weights, AdamW's two
fp32 moments, DDP gradients living in its buckets); activations follow what autograd saves per decoder layer for the
Llama block with SDPA attention (no score matrix), eager or compiled, under the activation-checkpointing policy, plus
the loss's logits (all of them for the full loss, one chunk for the chunked and fused ones), and the overhead is a flat
allowance. The precision and the fast-path choices are resolved as the rank resolves them on its device
(trainer.config.choices): on GPUs the fast path, on CPU ranks fp32, eager layers and the full loss, whose figures are
host memory, compared with what the machine has (`HostMemory`: the supervisor and a rank by hand refuse CPU ranks that
clearly do not fit, trainer.preflight).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import psutil

from trainer.config import Config, checkpointing_policy
from trainer.config.choices import CHUNK_ELEMENTS, auto_loss, compile_enabled, half_precision
from trainer.config.sizes import flops_per_token, human, model_vocab_size, parameter_count, tokens_per_step

GiB = 1024**3
FP32 = 4
OVERHEAD_BYTES = 2 * GiB  # CUDA context, NCCL buffers, allocator slack: a rough flat allowance
CPU_OVERHEAD_BYTES = 512 * 1024**2  # a CPU rank's own: Python, torch's libraries, the tokenizer (measured: ~0.5 GiB)
# The estimate is approximate: CPU ranks are refused only when they need this many times the memory the machine has.
HOST_MEMORY_MARGIN = 1.5
STRATEGIES = ("ddp", "fsdp")


@dataclass(frozen=True)
class ModelShape:
    """What sizes and memory arithmetic need to know about a model, whichever way it was specified."""

    parameters: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool


def config_shape(cfg: Config) -> ModelShape:
    """The shape of the Llama the config's fields describe, by arithmetic (no torch: the supervisor can afford it).
    `trainer.model.build.model_shape` gives the same from a meta-device build, and also covers model.name_or_path."""
    m = cfg.model
    return ModelShape(parameters=parameter_count(cfg), hidden_size=m.hidden_size, num_layers=m.num_layers,
                      num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, ffn_hidden_size=m.ffn_hidden_size,
                      vocab_size=model_vocab_size(cfg), tie_word_embeddings=m.tie_word_embeddings)


@dataclass(frozen=True)
class StrategyEstimate:
    """One strategy's per-GPU bytes."""

    strategy: str  # "ddp" | "fsdp"
    weights: int
    gradients: int
    optimizer: int
    activations: int
    overhead: int
    gpu_memory_bytes: int | None

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations + self.overhead

    @property
    def fits(self) -> bool | None:
        """None when there is no GPU to compare with."""
        return None if self.gpu_memory_bytes is None else self.total <= self.gpu_memory_bytes


@dataclass(frozen=True)
class MemoryEstimate:
    world_size: int
    gpu_memory_bytes: int | None
    shape: ModelShape
    cuda: bool  # GPU ranks; False: CPU ranks, whose figures are host memory
    compute_bytes: int  # 2 for bf16/fp16 autocast, 4 for fp32
    micro_batch_tokens: int
    gradient_checkpointing: str  # none | selective | full
    compiled: bool  # torch.compile on the decoder layers (as a rank on this device resolves system.compile)
    loss: str  # full | chunked | liger (as a rank on this device resolves training.loss)
    chosen: str  # training.strategy
    tokens_per_step: int
    flops_per_token: int
    strategies: dict[str, StrategyEstimate] = field(default_factory=dict)

    @property
    def selected(self) -> StrategyEstimate:
        return self.strategies[self.chosen]


def compute_bytes(cfg: Config, cuda: bool = True) -> int:
    """Bytes per activation element: 16 bits where the rank autocasts, else fp32."""
    return 2 if half_precision(cfg, cuda) else FP32


def activation_bytes_per_token_layer(s: ModelShape, c: int, compiled: bool = False) -> int:
    """What autograd keeps per token for one Llama decoder layer (c = bytes per compute element).

    Eager: two RMSNorms in fp32 (input + normalised, 8h each); q/k/v/o projection inputs and SDPA's q, k, v and
    output (6·c·h + 2·c·kv_dim); the SwiGLU MLP's two input casts, gate, SiLU, up and product (2·c·h + 4·c·ffn).
    Compiled: inductor's partitioner recomputes the element-wise ops in backward instead of saving their outputs, so
    a layer keeps the two fp32 norm inputs (8h), the attention input, q, SDPA's output and the MLP input in the compute
    dtype (4·c·h), k and v (2·c·kv_dim), and the gate and up projections (2·c·ffn)."""
    head_dim = s.hidden_size // s.num_heads
    kv_dim = s.num_kv_heads * head_dim
    if compiled:
        return 8 * s.hidden_size + 4 * c * s.hidden_size + 2 * c * kv_dim + 2 * c * s.ffn_hidden_size
    return 16 * s.hidden_size + 8 * c * s.hidden_size + 2 * c * kv_dim + 4 * c * s.ffn_hidden_size


def checkpointed_layers(num_layers: int, policy: str) -> int:
    """Decoder layers recomputed in backward: all (full), the even-numbered ones (selective), none."""
    return {"none": 0, "selective": (num_layers + 1) // 2, "full": num_layers}[policy]


def logits_bytes(s: ModelShape, c: int, tokens: int, loss: str) -> int:
    """The loss's share: full logits keep a 16-bit copy, the fp32 upcast and the fp32 log-softmax for every token;
    the chunked and fused losses keep the final hidden states and one chunk's worth of those three."""
    per_token = (c + 2 * FP32) * s.vocab_size
    if loss == "full":
        return tokens * per_token
    return tokens * c * s.hidden_size + min(tokens, max(1, CHUNK_ELEMENTS // s.vocab_size)) * per_token


def activation_bytes(s: ModelShape, c: int, tokens: int, checkpointing: str, compiled: bool = False,
                     loss: str = "full") -> int:
    """One micro-batch's activations at the peak (end of forward), plus the loss's logits. A checkpointed layer keeps
    only its fp32 input, and one layer is recomputed at a time."""
    per_layer = activation_bytes_per_token_layer(s, c, compiled)
    recomputed = checkpointed_layers(s.num_layers, checkpointing)
    layers = (recomputed * FP32 * s.hidden_size + (s.num_layers - recomputed) * per_layer
              + (per_layer if recomputed else 0))
    return tokens * layers + logits_bytes(s, c, tokens, loss)


def layer_parameters(s: ModelShape) -> int:
    embeddings = s.vocab_size * s.hidden_size * (1 if s.tie_word_embeddings else 2)
    return (s.parameters - embeddings - s.hidden_size) // max(1, s.num_layers)


def estimate(cfg: Config, world_size: int, gpu_memory_bytes: int | None,
             shape: ModelShape | None = None, cuda: bool = True) -> MemoryEstimate:
    """Per-GPU memory for this config on `world_size` GPUs of `gpu_memory_bytes` each (None: no GPU to compare), or
    with `cuda` False the host memory of each of `world_size` CPU ranks, as they run it.

    `shape` defaults to the config's arithmetic, which needs no torch; a model from `model.name_or_path` is sized on
    the meta device instead (that imports torch and transformers).
    """
    if shape is None and cfg.model.name_or_path:
        shape = model_shape(cfg)
    s = shape or config_shape(cfg)
    n = max(1, world_size)
    c = compute_bytes(cfg, cuda)
    p = s.parameters
    tokens = cfg.training.batch_size * cfg.data.context_length
    compiled = compile_enabled(cfg, cuda)
    loss = cfg.training.loss if cfg.training.loss != "auto" else auto_loss(cfg, cuda, liger_installed=False)
    overhead = OVERHEAD_BYTES if cuda else CPU_OVERHEAD_BYTES
    checkpointing = checkpointing_policy(cfg.model.gradient_checkpointing)
    acts = activation_bytes(s, c, tokens, checkpointing, compiled, loss)
    embeddings = s.vocab_size * s.hidden_size * (1 if s.tie_word_embeddings else 2)
    layer = layer_parameters(s)
    # DDP: fp32 weights, fp32 gradients (the buckets are the gradients), two fp32 AdamW moments, and autocast's
    # 16-bit copy of every weight, cached from its first use in forward until backward has used it.
    ddp = StrategyEstimate("ddp", weights=FP32 * p + (c * p if c < FP32 else 0), gradients=FP32 * p,
                           optimizer=2 * FP32 * p, activations=acts, overhead=overhead,
                           gpu_memory_bytes=gpu_memory_bytes)
    # FSDP2: 1/n of everything fp32; gathered 16-bit weights of two layers (current + prefetched) and of the root
    # (embeddings, kept gathered between forward and backward); one layer's unsharded gradients before reduce-scatter.
    fsdp = StrategyEstimate("fsdp", weights=FP32 * p // n + c * (2 * layer + embeddings),
                            gradients=FP32 * p // n + c * 2 * layer, optimizer=2 * FP32 * p // n, activations=acts,
                            overhead=overhead, gpu_memory_bytes=gpu_memory_bytes)
    return MemoryEstimate(world_size=n, gpu_memory_bytes=gpu_memory_bytes, shape=s, cuda=cuda, compute_bytes=c,
                          micro_batch_tokens=tokens, gradient_checkpointing=checkpointing,
                          compiled=compiled, loss=loss,
                          chosen=cfg.training.strategy, tokens_per_step=tokens_per_step(cfg, n),
                          flops_per_token=flops_per_token(cfg) if not cfg.model.name_or_path else 0,
                          strategies={"ddp": ddp, "fsdp": fsdp})


def size(n: int) -> str:
    """Bytes in the unit that keeps a few digits (tiny models are MiB, large ones GiB, runs that fit nowhere TiB)."""
    for unit, scale in (("TiB", 1024 * GiB), ("GiB", GiB), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


@dataclass(frozen=True)
class HostMemory:
    """The host memory CPU ranks need by the estimate, against what the machine can give them now."""

    ranks: int  # CPU ranks on this machine
    per_rank: int  # bytes, the chosen strategy's total
    available: int  # bytes: RAM available and free swap, what the ranks can take before the kernel's OOM killer acts
    checked: bool = True  # system.host_memory_check: false starts the ranks whatever the estimate says

    @property
    def needed(self) -> int:
        return self.ranks * self.per_rank

    @property
    def fits(self) -> bool:
        return self.needed <= self.available

    @property
    def refused(self) -> bool:
        """Clearly beyond the machine: the estimate is approximate, so only a wide excess stops a run."""
        return self.checked and self.needed > HOST_MEMORY_MARGIN * self.available


# How to shrink a run that does not fit, in the dry run's verdict and in the refusal (trainer.preflight).
SHRINK_ADVICE = ("lower training.batch_size (raise training.grad_accum_nums to keep the tokens per step), run fewer "
                 "ranks (--nproc N), or set model.gradient_checkpointing=full")


def host_memory(est: MemoryEstimate, local_ranks: int, checked: bool = True) -> HostMemory:
    """`local_ranks` CPU ranks of the estimated run on this machine, each taking the chosen strategy's total."""
    return HostMemory(local_ranks, est.selected.total, psutil.virtual_memory().available + psutil.swap_memory().free,
                      checked)


def format_estimate(est: MemoryEstimate, host: HostMemory | None = None) -> str:
    """A table of per-rank memory for both strategies and a verdict for the chosen one: against the GPUs' memory, or
    for CPU ranks against the host's (`host`)."""
    rows = [("weights", "weights"), ("gradients", "gradients"), ("optimizer state", "optimizer"),
            ("activations", "activations"), ("overhead", "overhead")]
    per = "per-GPU memory" if est.cuda else "per-rank memory"
    lines = [f"  {per:<20}{'DDP':>14}{f'FSDP ({est.world_size} ranks)':>20}"]
    for title, attr in rows:
        values = [size(getattr(est.strategies[k], attr)) for k in STRATEGIES]
        lines.append(f"  {title:<20}{values[0]:>14}{values[1]:>20}")
    lines.append(f"  {'total':<20}{size(est.strategies['ddp'].total):>14}{size(est.strategies['fsdp'].total):>20}")
    if est.gpu_memory_bytes is not None:
        fits = ["yes" if est.strategies[k].fits else "NO" for k in STRATEGIES]
        lines.append(f"  {f'fits in {size(est.gpu_memory_bytes)}?':<20}{fits[0]:>14}{fits[1]:>20}")
    overhead = "the CUDA context and communication buffers" if est.cuda else "the rank's process: Python, torch"
    lines.append(f"  (activations: {est.micro_batch_tokens:,} tokens per micro-batch, "
                 f"{'16-bit' if est.compute_bytes == 2 else 'fp32'} compute, activation checkpointing "
                 f"{est.gradient_checkpointing}, {'compiled' if est.compiled else 'eager'} layers, {est.loss} loss; "
                 f"overhead: a flat allowance for {overhead})")
    chosen = est.selected
    if host is not None:
        if host.fits:
            verdict = "fits"
        elif host.refused:
            verdict = f"does NOT fit: the run would be refused; {SHRINK_ADVICE}"
        elif host.checked:
            verdict = "may NOT fit (the estimate is approximate: the run would start)"
        else:
            verdict = "may NOT fit (the run would start: system.host_memory_check=false)"
        lines.append(f"  host memory ({est.chosen.upper()}, training.strategy): {host.ranks} CPU "
                     f"rank{'s' * (host.ranks > 1)} × {size(host.per_rank)} = {size(host.needed)}, this machine has "
                     f"{size(host.available)} available (RAM and swap): {verdict}")
    elif chosen.fits:
        lines.append(f"  {est.chosen.upper()} (training.strategy) fits: {size(chosen.total)} of "
                     f"{size(est.gpu_memory_bytes or 0)} per GPU")
    elif chosen.fits is False:
        other = next(k for k in STRATEGIES if k != est.chosen)
        hint = (f"; --set training.strategy={other} would fit" if est.strategies[other].fits else
                "; lower training.batch_size, set model.gradient_checkpointing=selective or full, or use more GPUs")
        lines.append(f"  WARNING: {est.chosen.upper()} (training.strategy) will NOT fit: {size(chosen.total)} needed "
                     f"per GPU, {size(est.gpu_memory_bytes or 0)} available{hint}")
    return "\n".join(lines)


@dataclass(frozen=True)
class DetectedGpus:
    """The GPUs a run would use, as `--dry-run` reports them: how many, the smallest one's memory, its name."""

    count: int = 0
    memory: int | None = None  # bytes
    name: str | None = None


def torch_gpus() -> DetectedGpus:
    """What torch sees (`CUDA_VISIBLE_DEVICES` honoured): a rank's own view, with no NVML needed."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return DetectedGpus()
    properties = torch.cuda.get_device_properties(0)
    return DetectedGpus(torch.cuda.device_count(), int(properties.total_memory), properties.name)


def dry_run_report(cfg: Config, gpus: DetectedGpus, world_size: int, local_ranks: int,
                   gpus_needed: str | None = None) -> str:
    """What `--dry-run` prints for the run that would start here, on `world_size` ranks, `local_ranks` of them on this
    machine: sizes, throughput arithmetic and the memory estimate. On `gpus` (the caller's choice: the supervisor's
    or the rank's) as a GPU rank runs it; with none, as CPU ranks run it, against the host's memory, unless CPU ranks
    would refuse the config (`gpus_needed` says why, `trainer.preflight.dry_run`): it is then sized for the GPUs it
    needs."""
    cuda = gpus.count > 0 or gpus_needed is not None
    est = estimate(cfg, world_size, gpus.memory, shape=model_shape(cfg), cuda=cuda)  # exact sizes, meta device
    s, t, d = est.shape, cfg.training, cfg.data
    source = cfg.model.name_or_path or cfg.model.architecture
    flops = f"{human(est.flops_per_token)} (6N + attention)" if est.flops_per_token else "n/a for a model from a folder"
    micro_steps = f"{t.grad_accum_nums} micro-step{'s' * (t.grad_accum_nums > 1)}"
    ranks = f"{est.world_size} {'GPU' if cuda else 'CPU rank'}{'s' * (est.world_size > 1)}"
    if gpus.count:
        devices = f"{gpus.count} × {gpus.name}, {size(gpus.memory or 0)} each; estimate for {est.world_size} rank(s)"
    elif cuda:
        devices = f"none detected; estimate for {est.world_size} rank(s) on GPUs"
    else:
        here = f" ({local_ranks} on this machine)" if local_ranks != est.world_size else ""
        devices = f"none detected; estimate for {est.world_size} rank(s) on CPUs{here}"
    lines = [
        f"dry run: preset {cfg.preset} — nothing trained, the model was built on the meta device (no weights "
        f"allocated)",
        f"  model: {source}, {s.num_layers} layers, hidden {s.hidden_size}, {s.num_heads} heads ({s.num_kv_heads} KV), "
        f"FFN {s.ffn_hidden_size}, vocabulary {s.vocab_size:,}",
        f"  parameters: {human(s.parameters)} ({s.parameters:,})",
        f"  tokens per step: {est.tokens_per_step:,} ({t.batch_size} sequences × {d.context_length} tokens × "
        f"{micro_steps} × {ranks})",
        f"  FLOPs per token: {flops}",
        f"  GPUs: {devices}, strategy {t.strategy}",
        *([f"  {gpus_needed}: sized for GPUs (CPU ranks here would refuse it)"] if gpus_needed else []),
        format_estimate(est, None if cuda else host_memory(est, local_ranks, cfg.system.host_memory_check)),
    ]
    return "\n".join(lines)


def model_shape(cfg: Config, vocab_size: int | None = None) -> ModelShape:
    """Exact sizes from a model built on the meta device: no memory is allocated, even for billions of parameters.
    Imports torch and transformers, so only when called: the rest of this module is the supervisor's too."""
    import torch
    from transformers import AutoModelForCausalLM

    from trainer.model.build import ATTENTION, count_parameters, model_config

    config = model_config(cfg, vocab_size)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=ATTENTION)
    heads = config.num_attention_heads
    return ModelShape(
        parameters=count_parameters(model),
        hidden_size=config.hidden_size,
        num_layers=config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        ffn_hidden_size=getattr(config, "intermediate_size", 4 * config.hidden_size),
        vocab_size=config.vocab_size,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
    )
