"""GPU figures, side by side: the real rank against a textbook single-GPU loop, the cache build against the cores it
gets, and the supervisor's log pump where cores are free.

1. Training, one table per shape (125M is the `small` preset's shape, 1.1B the `1b` preset's). The rank runs through
   the supervisor (`python -m supervisor --nproc 1`, in a folder of its own: checkpoints land there and go after the
   run, a 1.1B one is 13 GB); tokens/s from rank 0's steady-state `training_history.json` records (after the warm-up
   steps, evaluation left out), with its peak `torch.cuda.max_memory_reserved`. Its rows, chosen with `--runs`:
     eager     the preset with the shape's model and batch and this benchmark's settings (no evaluation, frequent
               log records), `system.compile=false`: `auto` would compile on CUDA
     compiled  the same with `system.compile=true`
     shipped   the preset as shipped, what `bash run_training.sh --preset <name>` runs: only max_steps and the cache
               folder are given; compile, loss, evaluation and checkpoints are the preset's and the GPU defaults
   The textbook loop (transformers `LlamaForCausalLM` with SDPA, bf16 autocast, fused AdamW, clipping, gradient
   accumulation, random tokens; a fresh process per run) is, with `--anchor PATH`, the reference script
   `gpu_textbook_loop.py` (its printed line parsed; a failure is a "failed" cell), else the same loop in
   `bench/textbook_loop.py` (`plain loop`). A rank row's ratio is over the loop that compiles as it does (a shipped
   row compiles: `auto` on CUDA), and a loop runs only for the rank rows chosen. A shipped row is compared only
   where the preset's model, context, batch and accumulation are the shape's, as `small` and `1b` are
   (tests/test_bench_gpu.py checks it); elsewhere its cell names the fields that differ. MFU = tokens/s × FLOPs per token (`trainer.sizes.flops_per_token`:
   6·N_non-embedding + 12·L·H·T) / the GPU's bf16 peak (`trainer.metrics.peak_flops`); the anchor script's rows show
   the MFU it prints (the same formula at 989 TFLOP/s) and its peak `max_memory_allocated`.
2. Cache build scaling (`bench_cache.core_scaling`): the cache of a corpus of at least `--corpus-tokens` tokens (the
   standard library repeated, as JSONL) built with 1, 2, 4, 8, 16 cores (CPU affinity and the Rust encoder's thread
   count), as tokens/s and as a fraction of linear scaling from one core.
3. The log pump: `bench_supervisor.py`'s 2 ranks × 3 M lines, supervisor against writing to /dev/null.

Results: a markdown table per piece on stdout. With `--out DIR` each piece also goes to its own file,
`DIR/bench_gpu_<section>[_<shape>][_<runs>].md` (a training piece is rewritten after each row: a command cut short
keeps the rows it finished), and `DIR/bench_gpu.md` is rewritten from every piece in DIR, in the page's order;
`--collect DIR` does only that, so pieces from separate commands, gathered into one folder, make the whole page.

    python bench/run_all.py gpu --out DIR           # everything in one command: about 25 minutes on one H100
    python bench/bench_gpu.py --smoke --out DIR     # tiny shapes, a few steps, CPU: exercises every code path

Where a command may run 10 minutes (one H100, 16 cores; A is the path of gpu_textbook_loop.py), four commands:

    python bench/bench_gpu.py --sections training --shapes 125M --anchor A --out DIR                    # 6-8 min
    python bench/bench_gpu.py --sections training,logpump --shapes 1.1B --runs eager --anchor A --out DIR   # 3 min
    python bench/bench_gpu.py --sections training --shapes 1.1B --runs compiled,shipped --anchor A --out DIR  # 6-9
    python bench/bench_gpu.py --sections cache --out DIR                                                # 5-6 min
    python bench/run_all.py gpu --collect DIR       # after gathering the pieces into DIR: the page into BENCHMARKS.md

The estimates: the BPE (24k or 32k) and cache of each shape's corpus about 30 s, once (the cache is reused); a rank
or loop process 10-30 s to start; compiling 1-2 min per compiled run (less for the same graphs again: inductor's
cache); the steps at about 210k tokens/s eager and 400k compiled for 125M, 50k and 63-72k for 1.1B; a 1.1B checkpoint
written at the end of each rank run (13 GB); the cache builds about 5 min. Should the third command run long, split
it into `--runs compiled` and `--runs shipped`, each with its own compiled loop (about 5 min each).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trainer.choices import compile_enabled  # noqa: E402
from trainer.config import Config  # noqa: E402
from trainer.metrics import HISTORY_JSON, peak_flops  # noqa: E402
from trainer.resolve import add_config_arguments, resolve  # noqa: E402
from trainer.sizes import flops_per_token, model_vocab_size, parameter_count  # noqa: E402
from bench_cache import core_scaling  # noqa: E402  (beside this file)
from textbook_loop import parse_anchor_line  # noqa: E402  (beside this file)

GIB = 2**30
SECTIONS = ("training", "cache", "logpump")
RUN_KINDS = ("eager", "compiled", "shipped")  # the rank's rows, the choices of --runs
ANCHOR_LABEL = "textbook loop (anchors/gpu_textbook_loop.py)"


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
    `sets` on top, `shipped` runs the preset alone."""

    kind: str
    shape: str
    preset: str
    sets: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return f"rank, `{self.preset}` preset as shipped" if self.kind == "shipped" else f"rank {self.kind}"


EAGER = ("system.compile=false",)  # `auto` compiles on CUDA (trainer/choices.py): an eager row has to say so
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


@dataclass(frozen=True)
class Piece:
    """What one command can produce on its own, in a file of its own: a section; for training, one shape and the
    rank rows chosen (each compared with a loop of the same piece, measured in the same command)."""

    section: str
    shape: str = ""
    runs: tuple[str, ...] = RUN_KINDS

    @property
    def file_name(self) -> str:
        parts = [self.section, self.shape, "" if self.runs == RUN_KINDS else "-".join(self.runs)]
        return "bench_gpu_" + "_".join(p for p in parts if p) + ".md"


def page_order() -> list[Piece]:
    """Every piece a command can write, in the order of the page."""
    choices = [RUN_KINDS, *(c for n in range(1, len(RUN_KINDS)) for c in itertools.combinations(RUN_KINDS, n))]
    training = [Piece("training", shape, runs) for shape in [*SHAPES, "smoke"] for runs in choices]
    return training + [Piece(section) for section in SECTIONS if section != "training"]


@dataclass
class Options:
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


def failure(done: subprocess.CompletedProcess[str], what: str = "") -> str:
    """A failed child in a table cell: its exit status (or what is missing) and its last line of output."""
    lines = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()]
    head = what or f"exit {done.returncode}"
    return f"{head}: {lines[-1].strip()[:160] if lines else 'no output'}"


# ---------------------------------------------------------------------------------------------------------------------
# 1. Training: the rank through the supervisor


def set_flags(layer: dict[str, dict[str, object]]) -> list[str]:
    return [arg for section, values in layer.items() for key, value in values.items()
            for arg in ("--set", f"{section}.{key}={json.dumps(value)}")]


def config_flags(run: RankRun, shape: Shape, opts: Options) -> list[str]:
    """The config flags of a rank row (the supervisor's flags aside: they decide where the logs go, not the run)."""
    if run.kind == "shipped":  # smoke: on the tests' tiny corpus, so the CPU run reuses their token cache
        smoke = set_flags({"data": {**SMOKE_DATA, "vocab_size": shape.vocab}}) if opts.smoke else []
        return ["--preset", run.preset, "--max-steps", str(shape.steps), "--set", f"data.cache_dir={opts.cache_dir}",
                *smoke]
    layer = shape.layer()
    layer["data"].update({"cache_dir": str(opts.cache_dir), **(SMOKE_DATA if opts.smoke else {})})
    layer["training"].update({"max_steps": shape.steps, "warmup_steps": min(10, shape.steps - 1),
                              "eval_interval": 0})
    layer["checkpoint"] = {"interval": 0, "save_final": False}
    layer["logging"] = {"log_interval": max(1, shape.warmup // 4)}
    if opts.smoke:
        layer["system"] = {"device": "cpu"}
    return ["--preset", run.preset, *set_flags(layer), *(arg for s in run.sets for arg in ("--set", s))]


def resolved(flags: list[str]) -> Config:
    """The config a rank row runs, resolved from its flags the way the supervisor resolves them."""
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    return resolve(parser.parse_args(flags))


def rank_job(run: RankRun, shape: Shape, opts: Options) -> RankJob:
    flags = config_flags(run, shape, opts)
    cfg = resolved(flags)
    return RankJob(run, tuple(flags), cfg, compile_enabled(cfg, cuda=not opts.smoke))


def rank_throughput(job: RankJob, shape: Shape, opts: Options) -> Result:
    """The rank as the supervisor starts it: tokens/s from rank 0's history records after the warm-up steps."""
    run = job.run
    result = Result(run.name, job.compiled, loop=False, flops_per_token=flops_per_token(job.cfg))
    if run.kind == "shipped" and (unlike := shape.differences(job.cfg)):
        result.unlike = f"the `{run.preset}` preset is not the {run.shape} shape: {'; '.join(unlike)}"
        print(f"  {run.shape} {run.name}: not compared, {result.unlike}", file=sys.stderr, flush=True)
    work = opts.work / f"rank-{run.shape}-{run.kind}"
    work.mkdir(parents=True)
    cmd = [sys.executable, "-m", "supervisor", "--nproc", "1", "--no-footer", "--log-dir", str(work / "logs"),
           *job.flags]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
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
    result.device = next((line.split("devices: ", 1)[1].split(" (", 1)[1].rstrip(")")
                          for line in done.stdout.splitlines() if "| devices: " in line), "")
    return result


# ---------------------------------------------------------------------------------------------------------------------
# 1. Training: the textbook loop


def plain_throughput(result: Result, shape: Shape, opts: Options) -> None:
    """bench/textbook_loop.py's loop, in a child process."""
    cmd = [sys.executable, str(Path(__file__).with_name("textbook_loop.py")), json.dumps(shape.__dict__),
           str(int(result.compiled))]
    done = subprocess.run(cmd + (["--smoke"] if opts.smoke else []), cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        result.error = failure(done)
        return
    found = json.loads(done.stdout.strip().splitlines()[-1])
    result.tokens_per_s, result.peak_bytes, result.device = found["tokens_per_s"], found["peak_bytes"], found["device"]


def anchor_throughput(result: Result, shape: Shape, opts: Options) -> None:
    """The anchor script in a child process (`H L A K F V CTX B ACCUM STEPS [compile]`, STEPS timed after its own
    warm-up), its printed line the figures. What it ran is checked: the same compilation and parameter count."""
    assert opts.anchor is not None
    numbers = (shape.hidden, shape.layers, shape.heads, shape.kv_heads, shape.ffn, shape.vocab, shape.context,
               shape.batch, shape.accum, shape.steps - shape.warmup)
    cmd = [sys.executable, str(opts.anchor), *map(str, numbers), *(["compile"] if result.compiled else [])]
    done = subprocess.run(cmd, cwd=opts.work, capture_output=True, text=True)
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


# ---------------------------------------------------------------------------------------------------------------------
# 1. Training: the tables


def training(opts: Options) -> Iterator[tuple[Piece, str]]:
    """A table per shape, rewritten into its piece's file after every row."""
    shapes = {"smoke": SMOKE_SHAPE} if opts.smoke else SHAPES
    for shape_name in opts.shapes:
        shape = shapes[shape_name]
        jobs = [rank_job(run, shape, opts) for run in (SMOKE_RUNS if opts.smoke else RANK_RUNS)
                if run.shape == shape_name and run.kind in opts.runs]
        loops = sorted({job.compiled for job in jobs})  # the loops the chosen rank rows are compared with
        measures: list[Callable[[], Result]] = [partial(rank_throughput, job, shape, opts) for job in jobs]
        measures += [partial(loop_throughput, shape, compiled, opts) for compiled in loops]
        piece = Piece("training", shape_name, opts.runs)
        results: list[Result] = []
        for measure in measures:
            results.append(measure())
            print(f"  {shape_name} {results[-1].name}: {describe(results[-1])}", file=sys.stderr, flush=True)
            save(opts, piece, training_table(shape_name, shape, results, opts))
        yield piece, training_table(shape_name, shape, results, opts)


def training_table(shape_name: str, shape: Shape, results: list[Result], opts: Options) -> str:
    device = next((r.device for r in results if r.device), "unknown")
    runs = "" if opts.runs == RUN_KINDS else f"; the {', '.join(opts.runs)} rank runs"
    lines = [f"Training throughput, {shape_name} ({shape.describe()}), one device ({device}); steady state after the "
             f"warm-up steps{runs}", "",
             "| run | tokens/s | MFU | peak memory | rank / loop |", "|---|---|---|---|---|"]
    for r in results:
        mfu = r.mfu()
        lines.append(f"| {r.name} | {describe(r)} | {'n/a' if mfu is None else f'{mfu:.1%}'} | "
                     f"{'n/a' if r.peak_bytes is None else f'{r.peak_bytes / GIB:.1f} GiB'} | {ratio(r, results)} |")
    if opts.anchor is not None:
        lines += ["", "The anchor script's peak memory is `max_memory_allocated` (the rank's is the reservation), its "
                      "MFU the one it prints."]
    return "\n".join(lines)


def ratio(r: Result, results: list[Result]) -> str:
    """A rank row's tokens/s over the loop that compiles as it does."""
    if r.loop:
        return ""
    if r.unlike:
        return f"not compared: {r.unlike}".replace("|", "\\|")
    twin = next((p for p in results if p.loop and p.compiled == r.compiled and p.tokens_per_s), None)
    return f"{r.tokens_per_s / twin.tokens_per_s:.2f}×" if twin and r.tokens_per_s else ""


def describe(r: Result) -> str:
    if r.error:
        return f"failed ({r.error})".replace("|", "\\|")
    return f"{r.tokens_per_s:,.0f}" if r.tokens_per_s is not None else "n/a"


# ---------------------------------------------------------------------------------------------------------------------
# 3. The log pump


def log_pump(rounds: int = 3) -> str:
    """bench_supervisor.py's section 3: 2 CPU ranks × 3 M lines through the supervisor vs straight to /dev/null."""
    from bench_supervisor import ANCHORS, direct_spam, log_lines

    script = ANCHORS / "spam2.py"
    ratios, own = [], []
    for _ in range(rounds):
        direct_wall, _ = direct_spam(script)
        wall, _, check, launcher_cpu = log_lines("supervisor", script)
        ratios.append(wall / direct_wall)
        own.append(launcher_cpu)
        print(f"  log pump: {wall:.2f} s vs {direct_wall:.2f} s direct ({check})", file=sys.stderr, flush=True)
    return "\n".join([f"Log pump, 2 ranks × 3 M lines on {os.cpu_count()} cores", "",
                      "| supervisor / direct to /dev/null (median) | supervisor's own CPU seconds (median) |",
                      "|---|---|", f"| {statistics.median(ratios):.2f}× | {statistics.median(own):.1f} s |"])


# ---------------------------------------------------------------------------------------------------------------------
# Pieces and the page


def save(opts: Options, piece: Piece, text: str) -> None:
    if opts.out is not None:
        opts.out.mkdir(parents=True, exist_ok=True)
        (opts.out / piece.file_name).write_text(text + "\n")


def collect(out: Path) -> str:
    """`out/bench_gpu.md` from every piece in `out`, in the page's order; returns the page."""
    texts = [path.read_text().strip() for piece in page_order() if (path := out / piece.file_name).is_file()]
    page = "\n\n".join(texts) + "\n"
    (out / "bench_gpu.md").write_text(page)
    return page


def comma_list(parser: argparse.ArgumentParser, flag: str, given: str, allowed: Iterable[str]) -> tuple[str, ...]:
    """A comma-separated option as a tuple in the order of `allowed`; an unknown name stops with the choices."""
    names = {s.strip() for s in given.split(",") if s.strip()}
    allowed = tuple(allowed)
    if names - set(allowed):
        parser.error(f"{flag}: unknown {sorted(names - set(allowed))}; choose from {', '.join(allowed)}")
    return tuple(name for name in allowed if name in names)


def parse(argv: list[str]) -> Options | Path:
    """The options of a run, or the folder of `--collect`."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, a few steps, CPU ranks")
    parser.add_argument("--out", type=Path, help="also write each piece into DIR, and DIR/bench_gpu.md from them all")
    parser.add_argument("--collect", type=Path, metavar="DIR", help="only write DIR/bench_gpu.md from its pieces")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    parser.add_argument("--shapes", help=f"training: comma-separated, of {', '.join(SHAPES)} (default all)")
    parser.add_argument("--runs", default=",".join(RUN_KINDS),
                        help=f"training: the rank's rows, comma-separated, of {', '.join(RUN_KINDS)} (default all)")
    parser.add_argument("--anchor", type=Path, metavar="PATH",
                        help="the textbook loop script (gpu_textbook_loop.py) instead of bench/textbook_loop.py")
    parser.add_argument("--cache-dir", type=Path, default=ROOT / "cache" / "datasets",
                        help="token caches of the training runs (reused between runs)")
    parser.add_argument("--corpus-tokens", type=float, default=100e6, help="size of the cache-scaling corpus")
    args = parser.parse_args(argv)
    if args.collect is not None:
        return args.collect
    sections = comma_list(parser, "--sections", args.sections, SECTIONS)
    if args.smoke:
        sections = tuple(s for s in sections if s != "logpump")  # 3 M lines is not a smoke test
    shape_names = ["smoke"] if args.smoke else list(SHAPES)
    shapes = comma_list(parser, "--shapes", args.shapes or ",".join(shape_names), shape_names)
    runs = comma_list(parser, "--runs", args.runs, RUN_KINDS)
    available = len(os.sched_getaffinity(0))
    cores = [n for n in (1, 2, 4, 8, 16) if n <= available] if not args.smoke else [1, min(2, available)]
    return Options(smoke=args.smoke, work=Path(tempfile.mkdtemp(prefix="bench-gpu-")), cache_dir=args.cache_dir,
                   out=args.out, sections=sections, shapes=shapes, runs=runs,
                   anchor=None if args.anchor is None else args.anchor.resolve(),  # its runs start in `work`
                   corpus_tokens=0 if args.smoke else int(args.corpus_tokens), cores=sorted(set(cores)))


def main() -> None:
    opts = parse(sys.argv[1:])
    if isinstance(opts, Path):
        print(collect(opts), end="")
        return
    parts: dict[str, Callable[[Options], Iterable[tuple[Piece, str]]]] = {
        "training": training,
        "cache": lambda o: [(Piece("cache"), core_scaling(o.work, o.cache_dir, o.corpus_tokens, o.cores,
                                                          SMOKE_DATA if o.smoke else None))],
        "logpump": lambda o: [(Piece("logpump"), log_pump())],
    }
    for name in opts.sections:
        print(f"== {name}", file=sys.stderr, flush=True)
        for piece, text in parts[name](opts):
            save(opts, piece, text)
            print(text + "\n", flush=True)
    if opts.out is not None:
        collect(opts.out)


if __name__ == "__main__":
    main()
