"""DataLoader workers for training batches (`training.num_workers`): what each start method costs, side by side.

    .venv/bin/python bench/bench_dataloader.py [--rounds 3] [--workers 2] [--steps 200] [--compute-ms 3]
                                               [--shape 1024,8,2] [--methods inline,fork,forkserver,spawn]

Each measurement runs in a fresh interpreter that first joins a one-member gloo group (as a rank has before its first
batch, so `fork` copies a process with gloo's threads running) and memory-maps a generated token file, then reads
batches through `trainer.data.batches.StepLoader`:
  start    StepLoader created → first batch in hand: the one-off cost at a run's first step (and at each resume)
  step     time per batch over the next --steps batches with no compute in between: the pure read rate
  +gpu     the same with --compute-ms of sleep after each batch, a GPU step during which the CPU only waits: what
           reading ahead buys (inline pays read + compute per step, workers about max(read, compute))
  USS      private memory of every process the method adds (workers; the server for forkserver; multiprocessing's
           resource tracker for forkserver and spawn), after the first batch
  orphans  the process is then killed outright (SIGKILL, as the OOM killer would): seconds until every process it
           started is gone, or "never" when some are still there after ORPHAN_WAIT_S (the bench then kills them)
Methods: inline (num_workers=0, the reference), fork, forkserver (torch preloaded in the server, its best case) and
spawn, the trainer's choice (StepLoader's docstring says why). Rounds interleave the methods, so a busy machine
penalises all alike; figures are medians over rounds, printed as ratios: start-up against fork's, step times against
inline's.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402

METHODS = ("inline", "fork", "forkserver", "spawn")
TOKENS = 20_000_000  # 40 MB of uint16 ids
SHAPE_KEYS = ("context_length", "micro_batch_size", "grad_accum")  # --shape, in this order
ORPHAN_WAIT_S = 20.0
TOKEN_ENV = "BENCH_DATALOADER_TOKEN"


def child(method: str, tokens_path: str, workers: int, steps: int, compute_ms: float, shape: dict[str, int]) -> None:
    """One measurement, in this (fresh) process: prints its figures as JSON, then dies by SIGKILL."""
    import multiprocessing

    import numpy as np
    import torch.distributed as dist

    from trainer.data.batches import BatchSampler, StepLoader

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if method == "forkserver":
        multiprocessing.set_forkserver_preload(["torch", "trainer.data.batches"])
    tokens = np.memmap(tokens_path, dtype="<u2", mode="r")
    sampler = BatchSampler(tokens, world_size=1, rank=0, seed=1, **shape)
    started = time.perf_counter()
    loader = StepLoader(sampler, end_step=2 * steps + 2, num_workers=0 if method == "inline" else workers,
                        start_method="spawn" if method == "inline" else method)
    loader.get(0)
    first = time.perf_counter() - started
    uss = sum(p.memory_full_info().uss for p in psutil.Process().children(recursive=True))
    started = time.perf_counter()
    for step in range(1, steps + 1):
        loader.get(step)
    per_step = (time.perf_counter() - started) / steps
    started = time.perf_counter()
    for step in range(steps + 1, 2 * steps + 1):
        loader.get(step)
        time.sleep(compute_ms / 1e3)
    with_compute = (time.perf_counter() - started) / steps
    print(json.dumps({"start_s": first, "step_ms": per_step * 1e3, "gpu_ms": with_compute * 1e3,
                      "uss_mb": uss / 2**20}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no close(), no exit handlers: what is left is what a crash leaves


def marked(token: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get(TOKEN_ENV) == token:
                found.append(process)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found


def measure(method: str, tokens_path: Path, args: argparse.Namespace) -> dict[str, float]:
    token = uuid.uuid4().hex
    proc = subprocess.Popen([sys.executable, __file__, "--child", method, str(tokens_path), str(args.workers),
                             str(args.steps), str(args.compute_ms), args.shape], stdout=subprocess.PIPE, text=True,
                            cwd=ROOT,
                            env={**os.environ, TOKEN_ENV: token})
    assert proc.stdout is not None
    figures = json.loads(proc.stdout.readline())
    proc.wait()
    died = time.perf_counter()
    while (left := marked(token)) and time.perf_counter() - died < ORPHAN_WAIT_S:
        time.sleep(0.05)
    figures["orphans_s"] = float("inf") if left else time.perf_counter() - died
    for process in left:
        process.kill()
    psutil.wait_procs(left, timeout=10)
    proc.stdout.close()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--compute-ms", type=float, default=3.0)
    parser.add_argument("--shape", default="1024,8,2", help="context_length,micro_batch_size,grad_accum")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        method, path, workers, steps, compute_ms, shape = args.child
        child(method, path, int(workers), int(steps), float(compute_ms),
              dict(zip(SHAPE_KEYS, map(int, shape.split(",")))))
        return
    methods = args.methods.split(",")
    shape = dict(zip(SHAPE_KEYS, map(int, args.shape.split(","))))

    import numpy as np

    with tempfile.TemporaryDirectory() as tmp:
        tokens_path = Path(tmp) / "tokens.bin"
        np.random.default_rng(0).integers(0, 50_000, TOKENS).astype("<u2").tofile(tokens_path)
        runs: dict[str, list[dict[str, float]]] = {m: [] for m in methods}
        for _ in range(args.rounds):
            for method in methods:
                runs[method].append(measure(method, tokens_path, args))
    median = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in runs.items()}
    batch_kb = shape["grad_accum"] * shape["micro_batch_size"] * (shape["context_length"] + 1) * 8 / 1024
    print(f"{args.workers} workers, {args.steps} steps of {batch_kb:.0f} KB, {TOKENS:,} tokens memory-mapped, "
          f"gloo group joined first; +gpu = {args.compute_ms:g} ms of waiting per step; "
          f"medians of {args.rounds} rounds")
    start_ref = "fork" if "fork" in median else methods[0]
    step_ref = "inline" if "inline" in median else methods[0]
    print(f"{'method':<11} {'start s':>8} {'vs ' + start_ref:>10} {'step ms':>8} {'vs ' + step_ref:>10} "
          f"{'+gpu ms':>8} {'vs ' + step_ref:>10} {'USS MB':>8} {'orphans':>8}")
    for method, m in median.items():
        orphans = "never" if m["orphans_s"] == float("inf") else f"{m['orphans_s']:.1f} s"
        print(f"{method:<11} {m['start_s']:>8.3f} {m['start_s'] / median[start_ref]['start_s']:>9.1f}x "
              f"{m['step_ms']:>8.3f} {m['step_ms'] / median[step_ref]['step_ms']:>9.2f}x "
              f"{m['gpu_ms']:>8.3f} {m['gpu_ms'] / median[step_ref]['gpu_ms']:>9.2f}x {m['uss_mb']:>8.0f} "
              f"{orphans:>8}")


if __name__ == "__main__":
    main()
