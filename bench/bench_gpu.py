"""GPU figures, side by side in one run: the real rank against a textbook single-GPU loop, the cache build against
the cores it gets, and the supervisor's log pump where cores are free.

1. Training: for each shape, the rank (`python -m supervisor --nproc 1`, the trainer exactly as shipped; tokens/s
   read from rank 0's steady-state `training_history.json` records, with its peak `torch.cuda.max_memory_reserved`)
   and a textbook loop written here (transformers `LlamaForCausalLM` with SDPA, bf16 autocast, fused AdamW, clipping,
   gradient accumulation, random tokens; in a fresh process per run), each eager and compiled. MFU = tokens/s ×
   FLOPs per token (`trainer.sizes.flops_per_token`: 6·N_non-embedding + 12·L·H·T) / the GPU's bf16 peak
   (`trainer.metrics.peak_flops`). The rank's configurations are the table `RANK_RUNS` below.
2. Cache build scaling: the cache of a corpus of at least `--corpus-tokens` tokens (the standard library repeated,
   as JSONL) built with 1, 2, 4, 8, 16 cores (CPU affinity and the Rust encoder's thread count), as tokens/s and as a
   fraction of linear scaling from one core.
3. The log pump: `bench_supervisor.py`'s 2 ranks × 3 M lines, supervisor against writing to /dev/null.

    python bench/run_all.py gpu [--out DIR]           # on a GPU machine; about 20 minutes
    python bench/bench_gpu.py --sections training     # one part (training, cache, logpump)
    python bench/bench_gpu.py --smoke --out DIR       # tiny shapes, a few steps, CPU: exercises every code path

Results: a markdown table per part on stdout, and the same in `<DIR>/bench_gpu.md` with `--out DIR`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trainer.config import Config  # noqa: E402
from trainer.metrics import HISTORY_JSON, peak_flops  # noqa: E402
from trainer.sizes import flops_per_token  # noqa: E402

GIB = 2**30
SECTIONS = ("training", "cache", "logpump")


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

    def layer(self) -> dict[str, dict[str, object]]:
        """The shape as a config layer (the data's BPE vocabulary is the model's)."""
        return {"model": {"num_layers": self.layers, "hidden_size": self.hidden, "num_heads": self.heads,
                          "num_kv_heads": self.kv_heads, "ffn_hidden_size": self.ffn, "vocab_size": self.vocab,
                          "max_position_embeddings": max(self.context, 2048), "tie_word_embeddings": False},
                "data": {"vocab_size": self.vocab, "context_length": self.context},
                "training": {"batch_size": self.batch, "grad_accum_nums": self.accum}}

    def config(self) -> Config:
        return Config.from_dict(self.layer())


SHAPES = {
    "125M": Shape(12, 768, 12, 12, 2048, 24_576, 1024, 16, 2, steps=60, warmup=20),  # the `small` preset's shape
    "1.1B": Shape(16, 2048, 32, 8, 8192, 32_000, 2048, 8, 2, steps=40, warmup=15),
}
SMOKE_SHAPE = Shape(1, 32, 4, 2, 64, 300, 32, 4, 2, steps=6, warmup=2)
SMOKE_DATA = {"max_samples": 40, "val_fraction": 0.05}  # the test suite's tiny corpus (tests/rank_support.py)


@dataclass(frozen=True)
class RankRun:
    """One configuration of the real rank: a preset as shipped plus flags; `shape` sets the model and batch."""

    name: str
    shape: str
    preset: str = "small"
    sets: tuple[str, ...] = ()
    compiled: bool = False


# The rank's configurations. Add a preset as shipped with RankRun("rank 1b preset", "1.1B", preset="1b").
# `system.compile` defaults to `auto`, which compiles on CUDA (trainer/choices.py): the eager rows have to say so.
RANK_RUNS = [
    RankRun("rank eager", "125M", sets=("system.compile=false",)),
    RankRun("rank compiled", "125M", sets=("system.compile=true",), compiled=True),
    RankRun("rank eager", "1.1B", sets=("system.compile=false",)),
    RankRun("rank compiled", "1.1B", sets=("system.compile=true",), compiled=True),
]
PLAIN_RUNS = [("plain loop eager", False), ("plain loop compiled", True)]


@dataclass
class Result:
    shape: str
    name: str
    compiled: bool
    tokens_per_s: float | None = None
    peak_bytes: int | None = None
    device: str = ""
    error: str = ""
    flops_per_token: int = 0

    def mfu(self) -> float | None:
        peak = peak_flops(self.device)
        if peak is None or self.tokens_per_s is None:
            return None
        return self.tokens_per_s * self.flops_per_token / peak


@dataclass
class Options:
    smoke: bool
    work: Path
    cache_dir: Path
    out: Path | None
    sections: tuple[str, ...]
    corpus_tokens: int
    cores: list[int] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------------------------------
# 1. Training: the rank through the supervisor


def set_flags(layer: dict[str, dict[str, object]]) -> list[str]:
    return [arg for section, values in layer.items() for key, value in values.items()
            for arg in ("--set", f"{section}.{key}={json.dumps(value)}")]


def rank_throughput(run: RankRun, shape: Shape, opts: Options) -> Result:
    """The rank as the supervisor starts it: tokens/s from rank 0's history records after the warm-up steps."""
    result = Result(run.shape, run.name, run.compiled, flops_per_token=flops_per_token(shape.config()))
    work = opts.work / f"rank-{run.shape}-{run.name.replace(' ', '-')}"
    log_interval = max(1, shape.warmup // 4)
    layer = shape.layer()
    layer["data"].update({"cache_dir": str(opts.cache_dir), **(SMOKE_DATA if opts.smoke else {})})
    layer["training"].update({"max_steps": shape.steps, "warmup_steps": min(10, shape.steps - 1),
                              "eval_interval": 0})
    layer["checkpoint"] = {"dir": str(work / "ckpt"), "interval": 0, "save_final": False}
    layer["logging"] = {"log_interval": log_interval}
    if opts.smoke:
        layer["system"] = {"device": "cpu"}
    cmd = [sys.executable, "-m", "supervisor", "--preset", run.preset, "--nproc", "1", "--no-footer",
           "--log-dir", str(work / "logs"), "--hang-timeout", "900", *set_flags(layer)]
    for assignment in run.sets:
        cmd += ["--set", assignment]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        result.error = f"exit {done.returncode}: {(done.stdout + done.stderr).strip().splitlines()[-1:]}"
        return result
    (run_dir,) = [p for p in (work / "logs").iterdir() if p.is_dir()]
    records = json.loads((run_dir / HISTORY_JSON).read_text())["steps"]
    steady = [r for r in records if r["step"] >= shape.warmup and r["tokens_per_s"]]
    result.tokens_per_s = statistics.median(r["tokens_per_s"] for r in steady)
    peaks = [r["peak_mem_gib"] for r in records if r.get("peak_mem_gib")]
    result.peak_bytes = int(max(peaks) * 2**30) if peaks else None
    result.device = next((line.split("devices: ", 1)[1].split(" (", 1)[1].rstrip(")")
                          for line in done.stdout.splitlines() if "| devices: " in line), "")
    return result


# ---------------------------------------------------------------------------------------------------------------------
# 1. Training: the textbook loop


def plain_loop(shape: Shape, compiled: bool, smoke: bool) -> dict[str, object]:
    """The textbook single-device loop on random tokens (run in a child process: its own memory and compile cache)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    device = torch.device("cpu" if smoke else "cuda")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.ffn,
                         num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                         num_key_value_heads=shape.kv_heads, max_position_embeddings=shape.context,
                         tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    forward = torch.compile(model) if compiled else model
    tokens = torch.randint(0, shape.vocab, (shape.steps, shape.accum, shape.batch, shape.context), device=device)

    def step(i: int) -> None:
        for micro in tokens[i]:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = forward(input_ids=micro, labels=micro).loss  # transformers shifts the labels itself
            (loss / shape.accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for i in range(shape.warmup):
        step(i)
    synchronize()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    for i in range(shape.warmup, shape.steps):
        step(i)
    synchronize()
    seconds = time.perf_counter() - started
    timed = shape.steps - shape.warmup
    return {"tokens_per_s": timed * shape.accum * shape.batch * shape.context / seconds,
            "peak_bytes": torch.cuda.max_memory_reserved() if device.type == "cuda" else None,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}


def plain_throughput(shape_name: str, shape: Shape, name: str, compiled: bool, opts: Options) -> Result:
    result = Result(shape_name, name, compiled, flops_per_token=flops_per_token(shape.config()))
    cmd = [sys.executable, __file__, "--child-plain", json.dumps(shape.__dict__), str(int(compiled))]
    done = subprocess.run(cmd + (["--smoke"] if opts.smoke else []), cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        result.error = f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}"
        return result
    found = json.loads(done.stdout.strip().splitlines()[-1])
    result.tokens_per_s, result.peak_bytes, result.device = found["tokens_per_s"], found["peak_bytes"], found["device"]
    return result


def training(opts: Options) -> str:
    shapes = {"smoke": SMOKE_SHAPE} if opts.smoke else SHAPES
    runs = [RankRun("rank eager", "smoke")] if opts.smoke else RANK_RUNS
    plain = PLAIN_RUNS[:1] if opts.smoke else PLAIN_RUNS  # compiling on a CPU needs a C++ toolchain: eager only
    results: list[Result] = []
    for shape_name, shape in shapes.items():
        for run in (r for r in runs if r.shape == shape_name):
            results.append(rank_throughput(run, shape, opts))
            print(f"  {shape_name} {run.name}: {describe(results[-1])}", file=sys.stderr, flush=True)
        for name, compiled in plain:
            results.append(plain_throughput(shape_name, shape, name, compiled, opts))
            print(f"  {shape_name} {name}: {describe(results[-1])}", file=sys.stderr, flush=True)
    device = next((r.device for r in results if r.device), "unknown")
    lines = [f"Training throughput, one device ({device}); steady state after the warm-up steps",
             "", "| shape | run | tokens/s | MFU | peak memory | rank / plain loop |", "|---|---|---|---|---|---|"]
    for r in results:
        plain_twin = next((p for p in results if p.shape == r.shape and p.name.startswith("plain")
                           and p.compiled == r.compiled and p.tokens_per_s), None)
        ratio = (f"{r.tokens_per_s / plain_twin.tokens_per_s:.2f}×" if r.name.startswith("rank") and plain_twin
                 and r.tokens_per_s else "")
        mfu = r.mfu()
        lines.append(f"| {r.shape} | {r.name} | {describe(r)} | {'n/a' if mfu is None else f'{mfu:.1%}'} | "
                     f"{'n/a' if r.peak_bytes is None else f'{r.peak_bytes / GIB:.1f} GiB'} | {ratio} |")
    return "\n".join(lines)


def describe(r: Result) -> str:
    if r.error:
        return f"failed ({r.error})"
    return f"{r.tokens_per_s:,.0f}" if r.tokens_per_s is not None else "n/a"


# ---------------------------------------------------------------------------------------------------------------------
# 2. Cache build scaling


def cache_scaling(opts: Options) -> str:
    """Build the same large cache with 1, 2, 4 … cores; tokens/s and the fraction of linear scaling from one core."""
    from bench_cache import config_for

    from trainer.data.cache import prepare
    from trainer.data.corpus import StdlibCorpus

    data = SMOKE_DATA if opts.smoke else {}
    seed_cfg = config_for(opts.cache_dir, vocab_size=300 if opts.smoke else 8192,
                          context_length=32 if opts.smoke else 1024, **data)
    seed = prepare(seed_cfg, show_progress=False)  # its trained BPE tokenizes the large corpus
    seed_tokens = seed.tokens + seed.val_tokens
    repeats = max(1, math.ceil(opts.corpus_tokens / seed_tokens))
    source = opts.work / "corpus.jsonl"
    documents = list(StdlibCorpus().documents())[:seed.documents] if opts.smoke else list(StdlibCorpus().documents())
    with open(source, "w") as f:
        for _ in range(repeats):
            for text in documents:
                f.write(json.dumps({"text": text}) + "\n")
    config = opts.work / "large.json"
    config_for(opts.work / "scaling-cache", source=str(source), tokenizer=str(seed.path),
               context_length=seed_cfg.data.context_length).save(config)
    rows, base = [], None
    for cores in opts.cores:
        done = subprocess.run([sys.executable, __file__, "--child-cache", str(config), str(cores)], cwd=ROOT,
                              capture_output=True, text=True, env={**os.environ, "RAYON_NUM_THREADS": str(cores)})
        if done.returncode != 0:
            rows.append(f"| {cores} | failed: {done.stderr.strip().splitlines()[-1:]} | | |")
            continue
        found = json.loads(done.stdout.strip().splitlines()[-1])
        rate = found["tokens"] / found["seconds"]
        base = base or rate / cores
        rows.append(f"| {cores} | {found['tokens']:,} | {rate / 1e6:.2f} M | {rate / (base * cores):.0%} |")
        print(f"  cache build on {cores} core(s): {rate / 1e6:.2f} M tokens/s", file=sys.stderr, flush=True)
    return "\n".join([f"Cache build scaling: {source.stat().st_size / 1e6:,.0f} MB of JSONL (the standard library "
                      f"× {repeats}), BPE {seed_cfg.data.vocab_size:,}",
                      "", "| cores | tokens | tokens/s | of linear scaling |", "|---|---|---|---|", *rows])


def child_cache(config: str, cores: int) -> dict[str, object]:
    """One build, pinned to the first `cores` CPUs (the encoder's threads were capped by RAYON_NUM_THREADS)."""
    from bench_cache import child_ours

    available = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, available[:cores])
    return child_ours(config)


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


def parse() -> Options:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, a few steps, CPU ranks")
    parser.add_argument("--out", type=Path, help="also write the tables into DIR/bench_gpu.md")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    parser.add_argument("--cache-dir", type=Path, default=ROOT / "cache" / "datasets",
                        help="token caches of the training runs (reused between runs)")
    parser.add_argument("--corpus-tokens", type=float, default=100e6, help="size of the cache-scaling corpus")
    args = parser.parse_args()
    sections = tuple(s.strip() for s in args.sections.split(",") if s.strip())
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown section(s) {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    if args.smoke:
        sections = tuple(s for s in sections if s != "logpump")  # 3 M lines is not a smoke test
    available = len(os.sched_getaffinity(0))
    cores = [n for n in (1, 2, 4, 8, 16) if n <= available] if not args.smoke else [1, min(2, available)]
    return Options(smoke=args.smoke, work=Path(tempfile.mkdtemp(prefix="bench-gpu-")), cache_dir=args.cache_dir,
                   out=args.out, sections=sections, corpus_tokens=0 if args.smoke else int(args.corpus_tokens),
                   cores=sorted(set(cores)))


def main() -> None:
    if sys.argv[1:2] == ["--child-plain"]:
        print(json.dumps(plain_loop(Shape(**json.loads(sys.argv[2])), sys.argv[3] == "1", "--smoke" in sys.argv)))
        return
    if sys.argv[1:2] == ["--child-cache"]:
        print(json.dumps(child_cache(sys.argv[2], int(sys.argv[3]))))
        return
    opts = parse()
    parts = {"training": training, "cache": cache_scaling, "logpump": lambda o: log_pump()}
    tables = []
    for name in opts.sections:
        print(f"== {name}", file=sys.stderr, flush=True)
        tables.append(parts[name](opts))
        print(tables[-1] + "\n", flush=True)
    if opts.out is not None:
        opts.out.mkdir(parents=True, exist_ok=True)
        (opts.out / "bench_gpu.md").write_text("\n\n".join(tables) + "\n")


if __name__ == "__main__":
    main()
