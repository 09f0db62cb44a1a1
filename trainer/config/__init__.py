"""The run's configuration: typed sections, layers applied onto them, validation.

The description of a run that the supervisor and every rank share. The supervisor resolves it once and writes the
result to the run folder; ranks read that file and never re-resolve. This package holds:

* here — the dataclasses (`Config` and its sections), applying a layer onto them, the cross-key rules;
* `bounds` — the values every numeric key accepts, and the names that may not be empty;
* `json_text` — config files read defensively, JSON values quoted in one-line errors;
* `resolve` — where the layers come from: presets, `--config` files, the flags every entry point shares;
* `choices` — what the `auto` settings resolve to on a device type;
* `sizes` — parameters, tokens per step and FLOPs per token from a config alone.

Imports only `trainer.errors` and `trainer.progress`. No torch: the supervisor and `prepare_dataset.py` must start
fast.

Length: every key's field with its one-line reason, and the cross-key rules that read several sections at once; the
rules split off would import every dataclass back.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.config.bounds import check_bounds, value_of
from trainer.config.json_text import read_json, shown
from trainer.errors import UserError
from trainer.progress import restart_count

PROJECT_ROOT = Path(__file__).resolve().parents[2]
RUNS_DIR = Path("logs")  # where run folders go, under the working directory: the supervisor's and by hand
DEFAULT_PRESET = "production"


@dataclass
class SystemConfig:
    device: str = "auto"  # auto | cuda | cpu
    device_id: int | None = None  # a physical GPU id for a run started by hand
    seed: int = 1337
    backend: str = "auto"  # auto (nccl on GPUs, gloo on CPUs) | nccl | gloo
    dist_timeout_s: float = 600.0
    compile: bool | str = "auto"  # auto (each decoder layer on CUDA, never on CPUs) | true | false
    host_memory_check: bool = True  # refuse CPU ranks whose estimate is well beyond the host's memory (false: start)


@dataclass
class ModelConfig:
    name_or_path: str | None = None  # a hub name or local folder; None builds `architecture` from the fields below
    architecture: str = "llama"
    hidden_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 4
    ffn_hidden_size: int = 688
    max_position_embeddings: int = 2048
    vocab_size: int | None = None  # None: the tokenizer's vocabulary size
    init_std: float = 0.02
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    gradient_checkpointing: bool | str = "none"  # none | selective (every other layer) | full; true = full
    attention_backend: str = "auto"  # auto (PyTorch picks) | flash | efficient | cudnn | math; CUDA only


@dataclass
class DataConfig:
    source: str = "stdlib"  # "stdlib" | a local file, folder or glob | a hub dataset name
    mixture: dict[str, float] | None = None  # sources (anything data.source takes) → weights; instead of data.source
    text_field: str = "text"
    sample_by: str = "document"  # how a .txt file becomes documents: document | paragraph | line | a separator string
    hub_config: str | None = None
    split: str = "train"
    revision: str | None = None
    streaming: bool = False
    tokenizer: str = "bpe"  # "bpe": train a byte-level BPE on the source; else an AutoTokenizer name or path
    vocab_size: int = 8192  # for the trained BPE
    context_length: int = 256
    max_samples: int | None = None  # documents; accepts "500k", "5M" in JSON and on the command line
    val_fraction: float = 0.01
    cache_dir: str = "cache/datasets"


@dataclass
class TrainingConfig:
    max_steps: int = 1000
    batch_size: int = 8  # sequences per GPU per micro-step
    grad_accum_nums: int = 1
    num_workers: int = 0
    learning_rate: float = 3e-4
    min_lr_ratio: float = 0.1  # the cosine decays to learning_rate * min_lr_ratio
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    max_grad_norm: float = 1.0
    use_amp: bool = True  # mixed precision on GPUs; always fp32 on CPUs
    precision: str = "auto"  # auto (bf16 where supported, else fp16) | bf16 | fp16 | fp32
    strategy: str = "ddp"  # ddp | fsdp
    loss: str = "auto"  # auto | chunked | liger | full: how the lm_head and the cross-entropy are computed
    eval_interval: int = 0  # 0: no validation
    eval_steps: int = 10
    # a non-finite step recomputed once from a copy of the parameters kept before it (one more copy of the weights in
    # device memory): the same result is the model's numerics, a finite one the GPU's (trainer.diagnosis.recompute)
    nan_recompute: bool = False
    spike_threshold: float = 0.0  # a loss spike: above mean + threshold × std of the last spike_window steps; 0: off
    spike_window: int = 50
    spike_policy: str = "log"  # log | rollback (to the last checkpoint before the spike, skipping spike_skip batches)
    spike_skip: int = 10
    # batches skipped: from loop step (a string key, as JSON has them) on, that many batches later (rollbacks record
    # theirs here; the batch order is a function of the config and these alone)
    skip_batches: dict[str, int] | None = None
    replay_step: int | None = None  # set by --replay: train up to this step, run it with the NaN diagnostics, stop


@dataclass
class CheckpointConfig:
    dir: str = ".checkpoints"
    interval: int = 0  # 0: only at the end
    keep: int = 2
    resume: str | None = None  # None | "auto" | a checkpoint path
    save_final: bool = True
    async_save: bool | str = "auto"  # auto (in the background where the staged copy fits in host memory) | true | false
    # a snapshot of the latest state in the node's shared memory every N steps (0: none), which a restart on the node
    # loads first; auto: every step where it costs under 2 % of the step time (trainer.checkpoint.memory)
    memory_interval: int | str = "auto"


@dataclass
class LoggingConfig:
    level: str = "INFO"  # DEBUG | INFO | WARNING
    log_interval: int = 10
    tensorboard: bool = False
    plot: bool = True  # training_history.png beside the JSON (matplotlib: about a second at the end of a run)
    run_dir: str | None = None  # set by the supervisor; a run by hand uses logs/<run-id>/
    wandb: bool = False  # Weights & Biases from rank 0: the TensorBoard scalars and the resolved config
    wandb_project: str = "gpu-pretrain"
    wandb_run_name: str | None = None  # None: the run folder's name


@dataclass
class DebugConfig:
    nan_localize: bool = False  # forward hooks + per-parameter gradient scan, checked every step
    nan_dump: bool = False  # write nan_grad_step_<n>.pt and debug/nan_debug_step_<n>.pkl
    max_nonfinite_steps: int = 3
    inject_nan_step: int | None = None
    inject_nan_rank: int = 0
    inject_nan_module: str | None = None
    inject_fault: str | None = None  # raise | exit | sigkill | segv | hang | slow | oom | gpu_lost | corrupt
    inject_fault_step: int | None = None
    inject_fault_rank: int = 0
    inject_fault_restart: int | None = None  # fire only in this group (0: the first, n: the n-th restart); None: all
    inject_fault_code: int = 1
    # step (at its start) | staging | checkpoint | publishing (a phase of the save that follows it)
    inject_fault_during: str = "step"
    inject_fault_delay_s: float = 0.2  # slow: the sleep before every step from inject_fault_step on
    # the checkpoint after this step, written in the background on inject_fault_rank, begins only once training waits
    # for it (the next save, a stop, the end of the run, a failure): a write still in flight then, whatever the timing
    inject_write_stall_step: int | None = None
    inject_spike_step: int | None = None  # the batch of this step (as the run first meets it) has its loss scaled
    inject_spike_scale: float = 10.0


@dataclass
class Config:
    preset: str = DEFAULT_PRESET
    description: str = ""
    notes: list[str] = field(default_factory=list)  # what resolving changed (a shrunk warm-up), said in the banners
    system: SystemConfig = field(default_factory=SystemConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], origin: str = "config") -> "Config":
        """Build and validate from a complete or partial dict (missing keys keep their defaults)."""
        cfg = cls()
        apply_layer(cfg, raw, origin)
        validate(cfg)
        return cfg

    @classmethod
    def load(cls, path: str | Path) -> "Config":
        """Read a resolved config written by `save` (what every rank does)."""
        return cls.from_dict(read_config_file(Path(path)), origin=str(path))

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        tmp.replace(path)


SECTIONS = [f.name for f in dataclasses.fields(Config) if dataclasses.is_dataclass(f.default_factory)]  # type: ignore[arg-type]
TOP_LEVEL_SCALARS = ("preset", "description")
TOP_LEVEL_LISTS = ("notes",)
CHOICES: dict[str, tuple[str, ...]] = {
    "system.device": ("auto", "cuda", "cpu"),
    "system.backend": ("auto", "nccl", "gloo"),
    "model.architecture": ("llama",),
    "training.precision": ("auto", "bf16", "fp16", "fp32"),
    "training.strategy": ("ddp", "fsdp"),
    "training.loss": ("auto", "chunked", "liger", "full"),
    "model.gradient_checkpointing": ("none", "selective", "full"),
    "model.attention_backend": ("auto", "flash", "efficient", "cudnn", "math"),
    "logging.level": ("DEBUG", "INFO", "WARNING"),
    "training.spike_policy": ("log", "rollback"),
    "debug.inject_fault": ("raise", "exit", "sigkill", "segv", "hang", "slow", "oom", "gpu_lost", "corrupt"),
    "debug.inject_fault_during": ("step", "staging", "checkpoint", "publishing"),
}



def read_config_file(path: Path) -> dict[str, Any]:
    """One config layer from a file: JSON as `json_text.read_json` reads it, an object of sections at the top."""
    raw = read_json(path)
    if not isinstance(raw, dict):
        raise UserError(f"{path}: the top level must be a JSON object with sections {', '.join(SECTIONS)}")
    return raw

# ---------------------------------------------------------------------------------------------------------------------
# Layers and types


def parse_count(value: Any, key: str) -> int:
    """'500k' → 500_000, '5M' → 5_000_000, 12 → 12."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMbB]?)\s*", value)
        if m:
            scale = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9}[m.group(2).lower()]
            count = float(m.group(1)) * scale
            if math.isfinite(count):  # too large is said by the key's bound; too large for a float, here
                return int(count)
    raise UserError(f"{key}: expected a count such as 500, 500k, 5M or 50M, got {shown(value)}")


COUNT_KEYS = {"data.max_samples"}


def field_types(section_cls: type) -> dict[str, Any]:
    return typing.get_type_hints(section_cls)


def type_name(tp: Any) -> str:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    names = [getattr(a, "__name__", str(a)) for a in (args or [tp])]
    return " or ".join(names) + (" or null" if type(None) in typing.get_args(tp) else "")


def coerce(value: Any, tp: Any, key: str, origin: str) -> Any:
    """Check `value` against the annotation `tp`; ints are accepted where floats are expected."""
    if key in COUNT_KEYS and value is not None:
        return parse_count(value, key)
    optional = isinstance(tp, types.UnionType) and type(None) in typing.get_args(tp)
    base = next((a for a in typing.get_args(tp) if a is not type(None)), tp) if optional else tp
    if value is None:
        if optional:
            return None
    elif base is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    elif base is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    elif base in (str, bool) and type(value) is base:
        return value
    elif isinstance(tp, types.UnionType) and type(value) in typing.get_args(tp):  # bool | str: a switch or a choice
        return value
    elif typing.get_origin(base) is dict and isinstance(value, dict):  # data.mixture: name → weight
        key_type, value_type = typing.get_args(base)
        return {coerce(k, key_type, key, origin): coerce(v, value_type, f"{key}[{k!r}]", origin)
                for k, v in value.items()}
    given = "null" if value is None else type(value).__name__
    raise UserError(f"{origin}: {key} expects {type_name(tp)}, got {given} ({shown(value)})")


def closest(name: str, candidates: list[str], what: str = "keys") -> str:
    match = difflib.get_close_matches(name, candidates, n=1, cutoff=0.5)
    return f"; did you mean '{match[0]}'?" if match else f"; valid {what}: {', '.join(candidates)}"


def apply_layer(cfg: Config, raw: dict[str, Any], origin: str) -> None:
    """Overlay one layer (a preset, a config file, the flags) onto `cfg`, checking every key and type."""
    for section, values in raw.items():
        if section in TOP_LEVEL_SCALARS:
            setattr(cfg, section, coerce(values, str, section, origin))
            continue
        if section in TOP_LEVEL_LISTS:
            if not isinstance(values, list):
                raise UserError(f"{origin}: {section} expects a list of strings, got {shown(values)}")
            setattr(cfg, section, [coerce(item, str, section, origin) for item in values])
            continue
        if section not in SECTIONS:
            raise UserError(f"{origin}: unknown section '{section}'{closest(section, SECTIONS, 'sections')}")
        if not isinstance(values, dict):
            raise UserError(f"{origin}: section '{section}' must be an object, got {shown(values)}")
        target = getattr(cfg, section)
        types_ = field_types(type(target))
        for key, value in values.items():
            if key not in types_:
                raise UserError(
                    f"{origin}: unknown key '{key}' in section '{section}'{closest(key, list(types_))}"
                )
            setattr(target, key, coerce(value, types_[key], f"{section}.{key}", origin))


def checkpointing_policy(value: bool | str) -> str:
    """`model.gradient_checkpointing` as a policy: the boolean of older configs meant full (true) or none (false)."""
    if isinstance(value, bool):
        return "full" if value else "none"
    return value


def normalise_switches(cfg: Config) -> None:
    """`model.gradient_checkpointing` was a boolean: true/false become the policy they always meant (full/none).
    `system.compile` and `checkpoint.async_save` stay a boolean or "auto", `checkpoint.memory_interval` a step count
    or "auto"."""
    cfg.model.gradient_checkpointing = checkpointing_policy(cfg.model.gradient_checkpointing)
    for key, value in (("system.compile", cfg.system.compile), ("checkpoint.async_save", cfg.checkpoint.async_save)):
        if not isinstance(value, bool) and value != "auto":
            raise UserError(f"{key} must be auto, true or false, got '{value}'")
    if isinstance(interval := cfg.checkpoint.memory_interval, str) and interval != "auto":
        raise UserError(f"checkpoint.memory_interval must be auto or a number of steps (0: no memory snapshots), got "
                        f"'{interval}'")


def validate(cfg: Config) -> None:
    """Cross-field rules: what no single key's type can say."""
    normalise_switches(cfg)
    for dotted, allowed in CHOICES.items():
        value = value_of(cfg, dotted)
        if value is not None and value not in allowed:
            raise UserError(f"{dotted} must be one of {', '.join(allowed)}, got '{value}'")
    check_bounds(cfg)
    m, d, t = cfg.model, cfg.data, cfg.training
    rules = [
        (m.num_heads > 0 and m.hidden_size % m.num_heads == 0,
         f"model.num_heads ({m.num_heads}) must divide model.hidden_size ({m.hidden_size})"),
        (m.num_kv_heads > 0 and m.num_heads % m.num_kv_heads == 0,
         f"model.num_kv_heads ({m.num_kv_heads}) must divide model.num_heads ({m.num_heads})"),
        (0 < d.context_length <= m.max_position_embeddings,
         f"data.context_length ({d.context_length}) must be between 1 and model.max_position_embeddings "
         f"({m.max_position_embeddings})"),
        (0 <= t.warmup_steps < t.max_steps,
         f"training.warmup_steps ({t.warmup_steps}) must be shorter than the run (training.max_steps = {t.max_steps})"),
        (bool(d.sample_by), "data.sample_by is empty; use document, paragraph, line or a separator string such as "
                            "'<|endoftext|>'"),
        (m.attention_backend != "efficient" or m.num_kv_heads == m.num_heads,
         f"model.attention_backend efficient has no grouped-query attention (num_kv_heads {m.num_kv_heads} < "
         f"num_heads {m.num_heads}); use auto, flash or cudnn"),
        (m.attention_backend not in ("flash", "cudnn") or (t.use_amp and t.precision != "fp32"),
         f"model.attention_backend {m.attention_backend} needs bf16 or fp16 compute; set training.use_amp=true with "
         f"training.precision auto, bf16 or fp16, or use attention_backend auto"),
    ]
    for ok, message in rules:
        if not ok:
            raise UserError(message)
    check_mixture(d)
    check_root_hunting(cfg)
    check_injection(cfg.debug, t.max_steps, cfg.checkpoint.interval)


def check_mixture(d: DataConfig) -> None:
    """data.mixture: instead of data.source, at least one non-empty source, every weight finite and positive, and
    their sum finite."""
    if d.mixture is None:
        return
    example = """e.g. --set data.mixture='{"web/*.parquet": 0.7, "code.jsonl.zst": 0.3}'"""
    if d.source != DataConfig.source:
        raise UserError(f"data.mixture and data.source ({d.source}) are exclusive: list every source in data.mixture "
                        f"and leave data.source out")
    if not d.mixture:
        raise UserError(f"data.mixture is empty; give sources and their weights, {example}")
    for source, weight in d.mixture.items():
        if not source.strip() or source.strip() != source:
            raise UserError(f"data.mixture names the source {source!r}; give a path, glob, 'stdlib' or hub name "
                            f"without surrounding spaces")
        if not (math.isfinite(weight) and weight > 0):
            raise UserError(f"data.mixture weight of {source} must be a finite number above 0, got {weight:g}")
    if not math.isfinite(sum(d.mixture.values())):  # the shares divide by the sum
        raise UserError(f"data.mixture weights add up to more than the largest number ({sys.float_info.max:g}); only "
                        f"their ratios matter: scale them down, e.g. to shares that sum to 1")


def check_root_hunting(cfg: Config) -> None:
    """The keys that hunt a NaN or a loss spike to its root: a replayed step inside the run, a recompute on a
    strategy whose step one rank can redo alone, a rollback that has checkpoints to go back to, skips that name
    steps."""
    t = cfg.training
    if t.replay_step is not None and t.replay_step >= t.max_steps:
        raise UserError(f"training.replay_step {t.replay_step} is never reached (the run's steps are "
                        f"0-{t.max_steps - 1})")
    if t.nan_recompute and t.strategy != "ddp":
        raise UserError("training.nan_recompute redoes a step on one rank alone, which FSDP2's sharded parameters "
                        "cannot (every rank takes part in each layer); use training.strategy=ddp, or leave "
                        "nan_recompute off")
    if t.spike_policy == "rollback" and not (t.spike_threshold > 0 and cfg.checkpoint.interval > 0):
        raise UserError("training.spike_policy rollback goes back to the last checkpoint before a spike: it needs "
                        "training.spike_threshold above 0 and checkpoint.interval above 0")
    for start, count in (t.skip_batches or {}).items():
        if not (start.isascii() and start.isdigit()) or count < 1:
            raise UserError(f"training.skip_batches maps a step to the batches skipped from it, e.g. "
                            f"""{{"120": 10}}; got {start!r}: {count}""")


def check_injection(d: DebugConfig, max_steps: int | None = None, interval: int = 0) -> None:
    """Fault injection set half-way, or aimed where it can never fire. Torch-free, so the supervisor finds these
    before it builds or starts anything; `trainer.diagnosis.faults.FaultInjector` runs the same checks on what it is given.
    Given the run's length and its `checkpoint.interval`, a fault inside a save and a write stall must be aimed at a
    step a checkpoint follows."""
    if (d.inject_nan_module is None) != (d.inject_nan_step is None):
        raise UserError("NaN injection needs both debug.inject_nan_module and debug.inject_nan_step, for example "
                        "--set debug.inject_nan_module=model.layers.1.mlp --set debug.inject_nan_step=3")
    if (d.inject_fault is None) != (d.inject_fault_step is None):
        raise UserError("fault injection needs both debug.inject_fault and debug.inject_fault_step, "
                        "for example --set debug.inject_fault=sigkill --set debug.inject_fault_step=3")
    in_a_save = d.inject_fault_during != "step"
    if in_a_save and d.inject_fault is None:
        raise UserError(f"debug.inject_fault_during {d.inject_fault_during} says when a fault fires, and no fault is "
                        f"set; add --set debug.inject_fault=sigkill --set debug.inject_fault_step=3 (for example), or "
                        f"leave inject_fault_during at step")
    if in_a_save and d.inject_fault in ("oom", "corrupt"):
        raise UserError(f"debug.inject_fault {d.inject_fault} fires in a step's forward pass, never inside a "
                        f"checkpoint save; leave debug.inject_fault_during at step")
    for step_key, rank_key in (("inject_nan_step", "inject_nan_rank"), ("inject_fault_step", "inject_fault_rank"),
                               ("inject_write_stall_step", "inject_fault_rank"),
                               ("inject_spike_step", "inject_fault_rank")):  # (a spike's batch is every rank's)
        step, rank = getattr(d, step_key), getattr(d, rank_key)
        if rank < 0:
            raise UserError(f"debug.{rank_key} must be 0 or more, got {rank}")
        if step is not None and not (0 <= step and (max_steps is None or step < max_steps)):
            last = "" if max_steps is None else f" (the run's steps are 0-{max_steps - 1}; training.max_steps = " \
                                                 f"{max_steps})"
            raise UserError(f"debug.{step_key} {step} is never reached{last}")
        in_the_save = step_key == "inject_write_stall_step" or (step_key == "inject_fault_step" and in_a_save)
        if in_the_save and step is not None and max_steps is not None and not saved_after(step, max_steps, interval):
            raise UserError(f"debug.{step_key} {step} never fires: no checkpoint follows step {step} (steps count "
                            f"from 0); {steps_saved_after(max_steps, interval)}")
    if not 0 <= d.inject_fault_code <= 255:
        raise UserError(f"debug.inject_fault_code must be an exit status within 0-255, got {d.inject_fault_code}")


def saved_after(step: int, max_steps: int, interval: int) -> bool:
    """Whether the loop saves a checkpoint after `step` (from 0): every `interval` completed steps, and at the end.
    The checkpoint after step s is step_<s + 1>."""
    return step + 1 == max_steps or (interval > 0 and (step + 1) % interval == 0)


def steps_saved_after(max_steps: int, interval: int) -> str:
    """The steps a checkpoint follows (the first few of them), as the advice of an error."""
    every = [k * interval - 1 for k in range(1, 5) if 0 < k * interval < max_steps]
    if not every:
        return (f"with checkpoint.interval {interval} only the last step, {max_steps - 1}, is followed by one: aim it "
                f"there, or set checkpoint.interval")
    listed = ", ".join(map(str, every[:3])) + (", …" if len(every) > 3 else "")
    return f"with checkpoint.interval {interval} checkpoints follow steps {listed} and {max_steps - 1}: aim it at one"


def check_world_size(cfg: Config, world_size: int) -> None:
    """Injection aimed at a rank the run does not have would silently never fire; known once the ranks are planned. A
    fault meant for another group of the run (`debug.inject_fault_restart`) is not this group's to check: after a GPU
    is excluded, the group that lost it is gone."""
    d = cfg.debug
    fault_here = (d.inject_fault_step is not None or d.inject_write_stall_step is not None) and \
        d.inject_fault_restart in (None, restart_count())
    for kind, on in (("nan", d.inject_nan_step is not None), ("fault", fault_here)):
        rank = getattr(d, f"inject_{kind}_rank")
        if on and rank >= world_size:
            raise UserError(f"debug.inject_{kind}_rank {rank} is outside the run's {world_size} "
                            f"rank{'s' if world_size > 1 else ''} (0-{world_size - 1})")
