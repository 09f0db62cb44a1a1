"""GPU figures, side by side: the real rank against a textbook single-GPU loop, what each of its GPU defaults buys,
the cache build against the cores it gets, and the supervisor's log pump where cores are free.

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
   (tests/test_bench_gpu.py checks it); elsewhere its cell names the fields that differ. MFU = tokens/s × FLOPs per token (`trainer.config.sizes.flops_per_token`:
   6·N_non-embedding + 12·L·H·T) / the GPU's bf16 peak (`trainer.metrics.peak_flops`); the anchor script's rows show
   the MFU it prints (the same formula at 989 TFLOP/s) and its peak `max_memory_allocated`.
2. Ablation, one table per shape: what each GPU default buys, and the alternatives tried. The shape's preset as
   shipped, then the same with one change per row (`ablations`: eager layers, the full logits, the chunked loss
   instead of liger's, SDPA's flash or cuDNN backend pinned, selective activation checkpointing, twice the
   micro-batch at half the accumulation), each as tokens/s, MFU and peak memory against the first row, measured in
   the same command, with the banner line of what the rank actually ran (a change that fell back shows there).
   `--ablations` picks changes by name. Where the same command measured the training section's shipped row, that run
   is the first row (its steps are the same; only the final-model export after them differs).
3. Cache build scaling (`bench_cache.core_scaling`): the cache of a corpus of at least `--corpus-tokens` tokens (the
   standard library repeated, as JSONL) built with 1, 2, 4, 8, 16 cores (CPU affinity and the Rust encoder's thread
   count), as tokens/s and as a fraction of linear scaling from one core.
4. The log pump: `bench_supervisor.py`'s 2 ranks × 3 M lines, supervisor against writing to /dev/null.

Results: a markdown table per piece on stdout. With `--out DIR` each piece also goes to its own file,
`DIR/bench_gpu_<section>[_<shape>][_<runs or changes>].md` (a training or ablation piece is rewritten after each
row: a command cut short keeps the rows it finished), and `DIR/bench_gpu.md` is rewritten from every piece in DIR, in the page's order;
`--collect DIR` does only that, so pieces from separate commands, gathered into one folder, make the whole page.

    python bench/run_all.py gpu --out DIR           # everything in one command: about 45 minutes on one H100
    python bench/bench_gpu.py --smoke --out DIR     # tiny shapes, a few steps, CPU: exercises every code path

Where a command may run 10 minutes (one H100, 16 cores; A is the path of gpu_textbook_loop.py), seven commands:

    python bench/bench_gpu.py --sections training --shapes 125M --anchor A --out DIR                    # 6-8 min
    python bench/bench_gpu.py --sections training,logpump --shapes 1.1B --runs eager --anchor A --out DIR   # 3 min
    python bench/bench_gpu.py --sections training --shapes 1.1B --runs compiled,shipped --anchor A --out DIR  # 6-9
    python bench/bench_gpu.py --sections cache --out DIR                                                # 5-6 min
    python bench/bench_gpu.py --sections ablation --shapes 125M --out DIR                               # 5-7 min
    python bench/bench_gpu.py --sections ablation --shapes 1.1B --ablations eager,full_loss,chunked_loss --out DIR
    python bench/bench_gpu.py --sections ablation --shapes 1.1B --ablations flash,cudnn,selective,batch --out DIR
    python bench/run_all.py gpu --collect DIR       # after gathering the pieces into DIR: the page into BENCHMARKS.md

The estimates: the BPE (24k or 32k) and cache of each shape's corpus about 30 s, once (the cache is reused); a rank
or loop process 10-30 s to start; compiling 1-2 min per compiled run (less for the same graphs again: inductor's
cache); the steps at about 210k tokens/s eager and 400k compiled for 125M, 50k and 63-72k for 1.1B; a 1.1B checkpoint
written at the end of each rank run (13 GB); the cache builds about 5 min. Should the third command run long, split
it into `--runs compiled` and `--runs shipped`, each with its own compiled loop (about 5 min each). Each 1.1B
ablation command runs the preset as shipped and its changes, about 1.5-2 min each (7-9 min).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from bench_cache import core_scaling  # beside this file
from gpu_runs import (
    GIB,
    NO_FINAL_MODEL,
    RANK_RUNS,
    ROOT,
    RUN_KINDS,
    SHAPES,
    SMOKE_ABLATIONS,
    SMOKE_DATA,
    SMOKE_RUNS,
    SMOKE_SHAPE,
    Options,
    RankRun,
    Result,
    Shape,
    ablations,
    loop_throughput,
    rank_job,
    rank_throughput,
)

SECTIONS = ("training", "ablation", "cache", "logpump")


@dataclass(frozen=True)
class Piece:
    """What one command can produce on its own, in a file of its own: a section; for training, one shape and the
    rank rows chosen (each compared with a loop of the same piece, measured in the same command); for ablation, one
    shape and the changes chosen (each compared with the preset as shipped, measured in the same command). `runs` is
    empty where every choice ran."""

    section: str
    shape: str = ""
    runs: tuple[str, ...] = ()

    @property
    def file_name(self) -> str:
        return "bench_gpu_" + "_".join(p for p in [self.section, self.shape, "-".join(self.runs)] if p) + ".md"


def page_order(out: Path) -> list[Path]:
    """The pieces in `out`, in the order of the page: by section, then shape, then (for a shape measured in parts)
    by the runs or changes each part chose."""
    shapes, names = [*SHAPES, "smoke"], [*RUN_KINDS, *ablations(SMOKE_SHAPE)]

    def place(path: Path) -> tuple[int, list[int]]:
        rest = path.stem.split("_", 3)[3:]  # bench_gpu_<section>_<shape>[_<runs>]
        shape, _, runs = (rest[0] if rest else "").partition("_")
        return (shapes.index(shape) if shape in shapes else len(shapes),
                [names.index(run) if run in names else len(names) for run in runs.split("-") if run])

    return [path for section in SECTIONS for path in sorted(out.glob(f"bench_gpu_{section}*.md"), key=place)]


# ---------------------------------------------------------------------------------------------------------------------
# 1. Training: the tables


def shapes_chosen(opts: Options) -> Iterator[tuple[str, Shape]]:
    shapes = {"smoke": SMOKE_SHAPE} if opts.smoke else SHAPES
    return ((name, shapes[name]) for name in opts.shapes)


def measure_rows(opts: Options, piece: Piece, measures: list[Callable[[], Result]],
                 table: Callable[[list[Result]], str]) -> str:
    """Run the measures in order; the piece's table is rewritten after every row (a command cut short keeps the rows
    it finished). Returns the whole table."""
    results: list[Result] = []
    for measure in measures:
        results.append(measure())
        print(f"  {piece.shape} {results[-1].name}: {describe(results[-1])}", file=sys.stderr, flush=True)
        save(opts, piece, table(results))
    return table(results)


def training(opts: Options) -> Iterator[tuple[Piece, str]]:
    """A table per shape: the rank rows chosen, then the loops they are compared with."""
    for shape_name, shape in shapes_chosen(opts):
        jobs = [rank_job(run, shape, opts) for run in (SMOKE_RUNS if opts.smoke else RANK_RUNS)
                if run.shape == shape_name and run.kind in opts.runs]
        loops = sorted({job.compiled for job in jobs})  # the loops the chosen rank rows are compared with
        measures: list[Callable[[], Result]] = [partial(rank_throughput, job, shape, opts) for job in jobs]
        measures += [partial(loop_throughput, shape, compiled, opts) for compiled in loops]
        piece = Piece("training", shape_name, () if opts.runs == RUN_KINDS else opts.runs)
        yield piece, measure_rows(opts, piece, measures, partial(training_table, shape_name, shape, opts))


def training_table(shape_name: str, shape: Shape, opts: Options, results: list[Result]) -> str:
    device = next((r.device for r in results if r.device), "unknown")
    runs = "" if opts.runs == RUN_KINDS else f"; the {', '.join(opts.runs)} rank runs"
    lines = [f"Training throughput, {shape_name} ({shape.describe()}), one device ({device}); steady state after the "
             f"warm-up steps{runs}", "",
             "| run | tokens/s | MFU | peak memory | rank / loop |", "|---|---|---|---|---|"]
    lines += [f"| {r.name} | {figures(r)} | {ratio(r, results)} |" for r in results]
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


def figures(r: Result) -> str:
    """The tokens/s, MFU and peak memory cells of a row."""
    mfu = r.mfu()
    return (f"{describe(r)} | {'n/a' if mfu is None else f'{mfu:.1%}'} | "
            f"{'n/a' if r.peak_bytes is None else f'{r.peak_bytes / GIB:.1f} GiB'}")


def describe(r: Result) -> str:
    if r.error:
        return f"failed ({r.error})".replace("|", "\\|")
    return f"{r.tokens_per_s:,.0f}" if r.tokens_per_s is not None else "n/a"


# ---------------------------------------------------------------------------------------------------------------------
# 2. Ablation: what each GPU default buys


def ablation(opts: Options) -> Iterator[tuple[Piece, str]]:
    """A table per shape: its preset as shipped, then with one choice changed per row (`ablations`), each against the
    first row. The preset is the one the training section ships for the shape (on a CPU, `debug`); no row exports the
    final model."""
    for shape_name, shape in shapes_chosen(opts):
        preset = next(run.preset for run in (SMOKE_RUNS if opts.smoke else RANK_RUNS)
                      if run.shape == shape_name and run.kind == "shipped")
        changes = ablations(shape)
        names = SMOKE_ABLATIONS if opts.smoke else opts.ablations or tuple(changes)
        runs = [RankRun("shipped", shape_name, preset, change, NO_FINAL_MODEL)
                for change in [(), *(changes[name] for name in names)]]
        measures = [partial(rank_throughput, rank_job(run, shape, opts), shape, opts) for run in runs]
        piece = Piece("ablation", shape_name, () if opts.smoke or not opts.ablations else names)
        yield piece, measure_rows(opts, piece, measures, partial(ablation_table, shape_name, preset))


def ablation_table(shape_name: str, preset: str, results: list[Result]) -> str:
    device = next((r.device for r in results if r.device), "unknown")
    base = results[0]
    lines = [f"What each choice buys, {shape_name}: the `{preset}` preset as shipped, then with one change per row "
             f"({device}); steady state after the warm-up steps", "",
             "| run | tokens/s | MFU | peak memory | vs as shipped | what ran |", "|---|---|---|---|---|---|"]
    for r in results:
        versus = f"{r.tokens_per_s / base.tokens_per_s:.2f}×" if r.tokens_per_s and base.tokens_per_s else ""
        lines.append(f"| {r.name} | {figures(r)} | {versus} | {r.compute.replace('|', '·')} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------------
# 4. The log pump


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
    texts = [path.read_text().strip() for path in page_order(out)]
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
    ablation_names = tuple(ablations(SMOKE_SHAPE))
    parser.add_argument("--ablations", default="",
                        help=f"ablation: the changes, comma-separated, of {', '.join(ablation_names)} (default all)")
    parser.add_argument("--anchor", type=Path, metavar="PATH",
                        help="the textbook loop script (gpu_textbook_loop.py) instead of bench/textbook_loop.py")
    parser.add_argument("--cache-dir", type=Path, default=ROOT / "cache" / "datasets",
                        help="token caches of the training runs (reused between runs)")
    parser.add_argument("--run-timeout", type=float, default=300.0, metavar="S",
                        help="stop a rank or loop run still going after S seconds (its row says so; the rest go on)")
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
    chosen = comma_list(parser, "--ablations", args.ablations, ablation_names)
    available = len(os.sched_getaffinity(0))
    cores = [n for n in (1, 2, 4, 8, 16) if n <= available] if not args.smoke else [1, min(2, available)]
    return Options(smoke=args.smoke, work=Path(tempfile.mkdtemp(prefix="bench-gpu-")), cache_dir=args.cache_dir,
                   out=args.out, sections=sections, shapes=shapes, runs=runs,
                   anchor=None if args.anchor is None else args.anchor.resolve(),  # its runs start in `work`
                   corpus_tokens=0 if args.smoke else int(args.corpus_tokens), cores=sorted(set(cores)),
                   ablations=() if chosen == ablation_names else chosen, run_timeout_s=args.run_timeout)


def main() -> None:
    opts = parse(sys.argv[1:])
    if isinstance(opts, Path):
        print(collect(opts), end="")
        return
    parts: dict[str, Callable[[Options], Iterable[tuple[Piece, str]]]] = {
        "training": training,
        "ablation": ablation,
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
