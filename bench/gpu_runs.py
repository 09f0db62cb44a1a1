"""The GPU benchmark's runs (`bench_gpu.py` makes its tables of them): the model shapes, the rank run through the
supervisor on a shape, the textbook loop on the same shape, and what one such run measured.

A rank row is a preset with `--set` flags on top (`RankRun`), made concrete as the flags the supervisor gets and the
config they resolve to (`RankJob`); its figures come from rank 0's `training_history.json`, never from the log text.
A loop row is a child process printing one JSON line (bench/textbook_loop.py) or the anchor script's figures line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from textbook_loop import parse_anchor_line  # noqa: E402  (beside this file)

from trainer.config import Config  # noqa: E402
from trainer.config.choices import compile_enabled  # noqa: E402
from trainer.config.resolve import add_config_arguments, resolve  # noqa: E402
from trainer.config.sizes import flops_per_token, model_vocab_size, parameter_count  # noqa: E402
from trainer.metrics import HISTORY_JSON, peak_flops  # noqa: E402

GIB = 2**30
RUN_KINDS = ("eager", "compiled", "shipped")  # the rank's rows, the choices of --runs
ANCHOR_LABEL = "textbook loop (anchors/gpu_textbook_loop.py)"
CONSOLES = "bench_gpu_consoles.txt"  # every rank run's console, appended as it is printed (under --out if given)


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    context: int
    batch: int
    accum: int
    steps: int  # optimizer steps per run
    warmup: int  # steps left out of the throughput (compilation, allocator warm-up)

    def settings(self) -> dict[str, object]:
        """The config keys the shape fixes (the data's BPE vocabulary is the model's; embeddings untied, as the
        textbook loop has them)."""
        return {"model.num_layers": self.layers, "model.hidden_size": self.hidden, "model.num_heads": self.heads,
                "model.num_kv_heads": self.kv_heads, "model.ffn_hidden_size": self.ffn,
                "model.vocab_size": self.vocab, "model.tie_word_embeddings": False, "data.vocab_size": self.vocab,
                "data.context_length": self.context, "training.batch_size": self.batch,
                "training.grad_accum_nums": self.accum}

    def layer(self) -> dict[str, dict[str, object]]:
        """The shape as a config layer."""
        layer: dict[str, dict[str, object]] = {"model": {"max_position_embeddings": max(self.context, 2048)}}
        for dotted, value in self.settings().items():
            section, key = dotted.split(".")
            layer.setdefault(section, {})[key] = value
        return layer

    def config(self) -> Config:
        return Config.from_dict(self.layer())

    def differences(self, cfg: Config) -> list[str]:
        """The keys where a resolved config is not this shape, as `key value (shape: value)`."""
        found = []
        for dotted, want in self.settings().items():
            section, key = dotted.split(".")
            have = model_vocab_size(cfg) if dotted == "model.vocab_size" else getattr(getattr(cfg, section), key)
            if have != want:
                found.append(f"{dotted} {have} (shape: {want})")
        return found

    def describe(self) -> str:
        return (f"{self.layers} × {self.hidden:,}, {self.heads} heads, {self.kv_heads} KV, FFN {self.ffn:,}, "
                f"vocabulary {self.vocab:,}, context {self.context:,}, batch {self.batch} × {self.accum}")


SHAPES = {
    "125M": Shape(12, 768, 12, 12, 2048, 24_576, 1024, 16, 2, steps=60, warmup=20),  # the `small` preset's shape
    "1.1B": Shape(16, 2048, 32, 8, 8192, 32_000, 2048, 8, 2, steps=40, warmup=15),  # the `1b` preset's shape
}
SMOKE_SHAPE = Shape(1, 32, 4, 2, 64, 300, 32, 4, 2, steps=6, warmup=2)
SMOKE_DATA = {"max_samples": 40, "val_fraction": 0.05}  # the test suite's tiny corpus (tests/rank_support.py)


@dataclass(frozen=True)
class RankRun:
    """One row of the real rank: `kind` is one of RUN_KINDS; `eager` and `compiled` set the shape on the preset, with
    `sets` on top, `shipped` runs the preset alone (an ablation row: with the change in `sets`). `untimed` settings
    change only what happens after the measured steps, so the row's name leaves them out."""

    kind: str
    shape: str
    preset: str
    sets: tuple[str, ...] = ()
    untimed: tuple[str, ...] = ()

    @property
    def own_flags(self) -> list[str]:
        """The row's own settings as `--set` flags, on top of what its kind gives."""
        return [arg for s in self.sets + self.untimed for arg in ("--set", s)]

    @property
    def timed(self) -> tuple[str, ...]:
        """What the measured steps run: two rows that differ only in `untimed` settings measure the same thing."""
        return (self.kind, self.shape, self.preset, *self.sets)

    @property
    def name(self) -> str:
        if self.kind == "shipped":
            return f"rank, `{self.preset}` preset as shipped" + (f" with {', '.join(self.sets)}" if self.sets else "")
        return f"rank {self.kind}"


EAGER = ("system.compile=false",)  # `auto` compiles on CUDA (trainer/config/choices.py): an eager row has to say so
COMPILED = ("system.compile=true",)
RANK_RUNS = [
    RankRun("eager", "125M", "small", EAGER),
    RankRun("compiled", "125M", "small", COMPILED),
    RankRun("shipped", "125M", "small"),
    RankRun("eager", "1.1B", "1b", EAGER),
    RankRun("compiled", "1.1B", "1b", COMPILED),
    RankRun("shipped", "1.1B", "1b"),
]
# On a CPU: `debug` is the preset that trains there in seconds (its shape is not the smoke shape: no ratio).
SMOKE_RUNS = [RankRun("eager", "smoke", "small", EAGER), RankRun("shipped", "smoke", "debug")]


def ablations(shape: Shape) -> dict[str, tuple[str, ...]]:
    """What each GPU default buys and the alternatives to it: the preset as shipped with one choice changed (the
    `ablation` section; `--ablations` picks by name). `batch` keeps the tokens per step: the micro-batch doubles, the
    accumulation halves."""
    return {
        "eager": EAGER,  # the compiled decoder layers
        "full_loss": ("training.loss=full",),  # the full logits, against the chunked or liger loss
        "chunked_loss": ("training.loss=chunked",),  # liger's fused kernel, where it is installed, against chunked
        "flash": ("model.attention_backend=flash",),  # SDPA's backend pinned, against the one PyTorch picks
        "cudnn": ("model.attention_backend=cudnn",),
        "selective": ("model.gradient_checkpointing=selective",),  # what checkpointing every other layer costs
        "batch": (f"training.batch_size={shape.batch * 2}", f"training.grad_accum_nums={max(1, shape.accum // 2)}"),
    }


# On CPU ranks `auto` means eager layers and the full loss, and liger, flash and cuDNN need CUDA: the chunked loss is
# the change that shows there.
SMOKE_ABLATIONS = ("chunked_loss",)
NO_FINAL_MODEL = ("checkpoint.save_final=false",)  # ablation rows skip the `final/` export, written after the steps


@dataclass(frozen=True)
class RankJob:
    """A rank row made concrete: the config flags the supervisor gets and the config they resolve to."""

    run: RankRun
    flags: tuple[str, ...]
    cfg: Config
    compiled: bool


@dataclass
class Result:
    name: str
    compiled: bool
    loop: bool  # a textbook loop's row (the rank's rows are compared with one)
    compute: str = ""  # the rank's banner line of what it ran: compilation, loss, checkpointing, attention
    tokens_per_s: float | None = None
    peak_bytes: int | None = None
    device: str = ""
    error: str = ""
    flops_per_token: int = 0
    printed_mfu: float | None = None  # the anchor script's own figure
    unlike: str = ""  # why a shipped row is not compared: the preset's fields that are not the shape's

    def mfu(self) -> float | None:
        if self.printed_mfu is not None:
            return self.printed_mfu
        peak = peak_flops(self.device)
        if peak is None or self.tokens_per_s is None:
            return None
        return self.tokens_per_s * self.flops_per_token / peak


@dataclass
class Options:
    """What a `bench_gpu.py` command was asked (`bench_gpu.parse`); a run reads where it works and what it runs on."""

    smoke: bool
    work: Path
    cache_dir: Path
    out: Path | None
    sections: tuple[str, ...]
    shapes: tuple[str, ...]
    runs: tuple[str, ...]
    anchor: Path | None
    corpus_tokens: int
    cores: list[int] = field(default_factory=list)
    ablations: tuple[str, ...] = ()  # the ablation section's changes, by name; empty: every one
    run_timeout_s: float = 300.0  # a run still going then is stopped and its row says so (the next rows still run)
    # rank rows this command has measured, by what their timed steps ran (`RankRun.timed`): the ablation's first row
    # is the training section's shipped row, and on a GPU a second run of it would cost minutes for the same figure
    measured: dict[tuple[str, ...], Result] = field(default_factory=dict)


def failure(done: ConsoleRun, what: str = "") -> str:
    """A failed child in a table cell: its exit status (or what is missing, or the time limit it ran past) and its
    last line of output."""
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    stopped = done.stopped_after_s
    head = what or (f"exit {done.returncode}" if stopped is None else f"stopped after {stopped:g} s (--run-timeout)")
    return f"{head}: {lines[-1].strip()[:160] if lines else 'no output'}"


# ---------------------------------------------------------------------------------------------------------------------
# The rank through the supervisor


def set_flags(layer: dict[str, dict[str, object]]) -> list[str]:
    return [arg for section, values in layer.items() for key, value in values.items()
            for arg in ("--set", f"{section}.{key}={json.dumps(value)}")]


def config_flags(run: RankRun, shape: Shape, opts: Options) -> list[str]:
    """The config flags of a rank row (the supervisor's flags aside: they decide where the logs go, not the run)."""
    if run.kind == "shipped":  # smoke: on the tests' tiny corpus, so the CPU run reuses their token cache
        smoke = set_flags({"data": {**SMOKE_DATA, "vocab_size": shape.vocab}}) if opts.smoke else []
        return ["--preset", run.preset, "--max-steps", str(shape.steps), "--set", f"data.cache_dir={opts.cache_dir}",
                *smoke, *run.own_flags]
    layer = shape.layer()
    layer["data"].update({"cache_dir": str(opts.cache_dir), **(SMOKE_DATA if opts.smoke else {})})
    layer["training"].update({"max_steps": shape.steps, "warmup_steps": min(10, shape.steps - 1),
                              "eval_interval": 0})
    layer["checkpoint"] = {"interval": 0, "save_final": False}
    layer["logging"] = {"log_interval": max(1, shape.warmup // 4)}
    if opts.smoke:
        layer["system"] = {"device": "cpu"}
    return ["--preset", run.preset, *set_flags(layer), *run.own_flags]


def resolved(flags: list[str]) -> Config:
    """The config a rank row runs, resolved from its flags the way the supervisor resolves them."""
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    return resolve(parser.parse_args(flags))


def rank_job(run: RankRun, shape: Shape, opts: Options) -> RankJob:
    flags = config_flags(run, shape, opts)
    cfg = resolved(flags)
    return RankJob(run, tuple(flags), cfg, compile_enabled(cfg, cuda=not opts.smoke))


@dataclass
class ConsoleRun:
    """A child run whose console went to the consoles file: its exit status, what it printed (stdout and stderr
    merged, in the order printed), and the time limit it was stopped at, if it was."""

    cmd: list[str]
    returncode: int
    stdout: str
    stopped_after_s: float | None = None


STOP_GRACE_S = 30.0  # after SIGTERM to a run past its limit (the supervisor stops its ranks), before SIGKILL


def console_run(cmd: list[str], work: Path, env: dict[str, str] | None, consoles: Path, title: str,
                timeout_s: float) -> ConsoleRun:
    """`cmd` with its console (stdout and stderr as a user sees them: rank 0's MFU lines, the compile time) appended
    to `consoles` as it is printed, so that a run stopped from outside (a lease's deadline) leaves what it printed;
    one still going after `timeout_s` gets SIGTERM, then SIGKILL with whatever it started, so that one run that hangs
    does not take the rows after it."""
    consoles.parent.mkdir(parents=True, exist_ok=True)
    stopped_after_s = None
    with consoles.open("a") as sink:
        sink.write(f"== {title}: {' '.join(cmd[1:])}\n")
        sink.flush()
        start = sink.tell()
        proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            stopped_after_s = timeout_s
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    with consoles.open() as source:
        source.seek(start)
        return ConsoleRun(cmd, proc.returncode, source.read(), stopped_after_s)


def consoles(opts: Options) -> Path:
    """Where every run of this command appends its console: beside the tables, or in the scratch folder."""
    return (opts.out if opts.out is not None else opts.work) / CONSOLES


def rank_throughput(job: RankJob, shape: Shape, opts: Options) -> Result:
    """The rank as the supervisor starts it: tokens/s from rank 0's history records after the warm-up steps."""
    run = job.run
    if (done_before := opts.measured.get(run.timed)) is not None:
        print(f"  {run.shape} {run.name}: measured earlier in this command", file=sys.stderr, flush=True)
        return done_before
    result = Result(run.name, job.compiled, loop=False, flops_per_token=flops_per_token(job.cfg))
    opts.measured[run.timed] = result  # filled in below; a failed row is not run again either
    if run.kind == "shipped" and not run.sets and (unlike := shape.differences(job.cfg)):
        result.unlike = f"the `{run.preset}` preset is not the {run.shape} shape: {'; '.join(unlike)}"
        print(f"  {run.shape} {run.name}: not compared, {result.unlike}", file=sys.stderr, flush=True)
    work = Path(tempfile.mkdtemp(prefix=f"rank-{run.shape}-{run.kind}-", dir=opts.work))
    cmd = [sys.executable, "-m", "supervisor", "--nproc", "1", "--no-footer", "--log-dir", str(work / "logs"),
           *job.flags]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = console_run(cmd, work, env, consoles(opts), f"{run.shape} {run.name}", opts.run_timeout_s)
    if not Path(job.cfg.checkpoint.dir).is_absolute():  # under `work`: gone, while the next run needs the disk
        shutil.rmtree(work / job.cfg.checkpoint.dir, ignore_errors=True)
    if done.returncode != 0:
        result.error = failure(done)
        return result
    (run_dir,) = [p for p in (work / "logs").iterdir() if p.is_dir()]
    records = json.loads((run_dir / HISTORY_JSON).read_text())["steps"]
    steady = [r["tokens_per_s"] for r in records
              if r["step"] >= shape.warmup and r["tokens_per_s"] and r.get("val_loss") is None]
    if not steady:
        result.error = f"no record after step {shape.warmup} without evaluation in {HISTORY_JSON}"
        return result
    result.tokens_per_s = statistics.median(steady)
    peaks = [r["peak_mem_gib"] for r in records if r.get("peak_mem_gib")]
    result.peak_bytes = int(max(peaks) * GIB) if peaks else None
    banner = done.stdout.splitlines()
    result.device = next((line.split("devices: ", 1)[1].split(" (", 1)[1].rstrip(")")
                          for line in banner if "| devices: " in line), "")
    result.compute = next((line.split("compute: ", 1)[1] for line in banner if "| compute: " in line), "")
    return result


# ---------------------------------------------------------------------------------------------------------------------
# The textbook loop


def loop_title(shape: Shape, result: Result) -> str:
    return f"{parameter_count(shape.config()) / 1e6:.0f}M {result.name}"


def plain_throughput(result: Result, shape: Shape, opts: Options) -> None:
    """bench/textbook_loop.py's loop, in a child process."""
    cmd = [sys.executable, str(Path(__file__).with_name("textbook_loop.py")), json.dumps(shape.__dict__),
           str(int(result.compiled))]
    done = console_run(cmd + (["--smoke"] if opts.smoke else []), ROOT, None, consoles(opts),
                       loop_title(shape, result), opts.run_timeout_s)
    if done.returncode != 0:
        result.error = failure(done)
        return
    found = json.loads(next(line for line in reversed(done.stdout.splitlines()) if line.startswith("{")))
    result.tokens_per_s, result.peak_bytes, result.device = found["tokens_per_s"], found["peak_bytes"], found["device"]


def anchor_throughput(result: Result, shape: Shape, opts: Options) -> None:
    """The anchor script in a child process (`H L A K F V CTX B ACCUM STEPS [compile]`, STEPS timed after its own
    warm-up), its printed line the figures. What it ran is checked: the same compilation and parameter count."""
    assert opts.anchor is not None
    numbers = (shape.hidden, shape.layers, shape.heads, shape.kv_heads, shape.ffn, shape.vocab, shape.context,
               shape.batch, shape.accum, shape.steps - shape.warmup)
    cmd = [sys.executable, str(opts.anchor), *map(str, numbers), *(["compile"] if result.compiled else [])]
    done = console_run(cmd, opts.work, None, consoles(opts), loop_title(shape, result), opts.run_timeout_s)
    figures = parse_anchor_line(done.stdout)
    if done.returncode != 0 or figures is None:
        result.error = failure(done, "" if done.returncode else "no figures line")
        return
    params = f"{parameter_count(shape.config()) / 1e6:.1f}"
    if figures.compiled != result.compiled or f"{figures.params_m:.1f}" != params:
        result.error = (f"it ran a different model: {figures.params_m:.1f}M parameters, "
                        f"{'' if figures.compiled else 'not '}compiled (asked for {params}M)")
        return
    result.tokens_per_s, result.printed_mfu = figures.tokens_per_s, figures.mfu
    result.peak_bytes = int(figures.peak_gib * GIB)


def loop_throughput(shape: Shape, compiled: bool, opts: Options) -> Result:
    name = f"{ANCHOR_LABEL if opts.anchor else 'plain loop'} {'compiled' if compiled else 'eager'}"
    result = Result(name, compiled, loop=True, flops_per_token=flops_per_token(shape.config()))
    (anchor_throughput if opts.anchor else plain_throughput)(result, shape, opts)
    return result
