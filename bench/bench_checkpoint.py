"""How long a checkpoint stops training: synchronous saves against saves written in the background, side by side.

Each side is a real supervised run (`python -m supervisor`, as `run_training.sh` starts it) of the `small` preset
(~125M parameters; with AdamW the full state is ~1.5 GB) on 2 CPU ranks with a tiny batch (1 sequence of 128
tokens), a checkpoint every 4 steps, for DDP (synchronous: rank 0 writes the full state.pt; in the background: each
rank stages and writes its share of the replicated state) and FSDP2 (every rank writes its DCP shards). The figures
are each run's own records in training_history.json: `blocked_s` (training stopped: staging, and for a synchronous
save the whole write) and `write_s`. Every strategy's two sides run back to back in each round, so a
busy machine penalises both alike; the ratio is the median of the per-round ratios of the median blocked time. The
first background save's blocked time is shown beside the later ones' (its staging buffers are allocated before the
first step, so it should block no longer), and what that allocation took at the start (rank 0's line).

The cost of verifying a checkpoint at resume: after each background run its latest checkpoint is dropped from the
page cache (posix_fadvise DONTNEED on each file) and a run resumes from it with nothing left to train; the ranks check
every file's size and checksum, each its share, before loading, and rank 0 says how long that took. Seconds per GB,
from the disk; and, read again from the page cache by this process alone (`layout.verify_files`), the checksum's own
cost.

    .venv/bin/python bench/bench_checkpoint.py [--rounds 1] [--steps 12] [--interval 4]

On a GPU (`--gpu ID`): one rank on that GPU, the `--preset` given (`1b`: ~1.1B parameters, a ~13 GB state), DDP
only (`--strategies`), layers eager (the save is measured, not the step); the background save stages into pinned host
memory.

    python bench/bench_checkpoint.py --gpu 0 --preset 1b --strategies ddp --steps 8 --interval 4

Goal: blocked time in the background <= 10 % of the synchronous save's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trainer.checkpoint import layout  # noqa: E402  (torch-free)

WORLD = 2
TINY_BATCH = ["--set", "training.batch_size=1", "--set", "training.grad_accum_nums=1",
              "--set", "data.context_length=128", "--set", "data.max_samples=200"]


def placement(gpu: int | None) -> list[str]:
    """Where the ranks run: WORLD CPU ranks, or one rank on GPU `gpu` with eager layers."""
    if gpu is None:
        return ["--nproc", str(WORLD), "--set", "system.device=cpu"]
    return ["--gpus", str(gpu), "--set", "system.compile=false"]


ALLOCATED = re.compile(r"each is first staged in host memory \(.* allocated in (?P<seconds>\d+\.\d+) s ")
VERIFIED = re.compile(r"checkpoint \S+ verified: \d+ files, .* read in (?P<seconds>\d+\.\d+) s ")


def run(folder: Path, cache_dir: Path, strategy: str, background: bool, steps: int, interval: int, preset: str,
        gpu: int | None, logs: str = "logs", *extra: str) -> tuple[list[dict[str, float]], str]:
    """One supervised run (logs in `folder/logs`); its checkpoints' records (rank 0's training_history.json) and its
    output."""
    argv = [sys.executable, "-m", "supervisor", "--preset", preset, *placement(gpu), "--no-footer",
            "--log-dir", str(folder / logs), "--max-steps", str(steps), *TINY_BATCH, *extra,
            "--set", f"data.cache_dir={json.dumps(str(cache_dir))}",
            "--set", f"training.strategy={json.dumps(strategy)}", "--set", "training.eval_interval=0",
            "--set", "training.warmup_steps=1", "--set", f"checkpoint.interval={interval}",
            "--set", f"checkpoint.dir={json.dumps(str(folder / 'ckpt'))}", "--set", "checkpoint.save_final=false",
            "--set", f"checkpoint.async_save={json.dumps(background)}", "--set", "logging.plot=false",
            "--set", "logging.log_interval=1"]
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # wheels carried to a GPU stay
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    done = subprocess.run(argv, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{strategy} {'background' if background else 'synchronous'} run failed "
                         f"(exit {done.returncode}):\n{done.stdout[-3000:]}")
    (history,) = (folder / logs).glob("*/training_history.json")
    return json.loads(history.read_text())["checkpoints"], done.stdout


def evict(checkpoint: Path) -> None:
    """Drop the checkpoint's files from the page cache (they are clean: the save fsynced them), so that the next read
    comes from the disk."""
    for file in checkpoint.rglob("*"):
        if file.is_file():
            fd = os.open(file, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def verification(folder: Path, cache_dir: Path, strategy: str, steps: int, interval: int, preset: str,
                 gpu: int | None) -> tuple[float, float, float]:
    """(GB, seconds at resume from the disk, seconds from the page cache by one reader) for the background run's
    latest checkpoint in `folder`."""
    latest = layout.latest_checkpoint(folder / "ckpt")
    assert latest is not None
    files = json.loads((latest / layout.META_FILE).read_text())["files"]
    evict(latest)
    _, out = run(folder, cache_dir, strategy, True, steps, interval, preset, gpu, "logs-resume", "--resume", "auto")
    said = VERIFIED.search(out)
    if said is None:
        raise SystemExit(f"{strategy}: the resumed run did not say it verified {latest}:\n{out[-3000:]}")
    started = time.perf_counter()
    problem = layout.verify_files(latest, sorted(files), files)
    warm = time.perf_counter() - started
    if problem is not None:
        raise SystemExit(f"{strategy}: {problem}")
    return sum(f["bytes"] for f in files.values()) / 1e9, float(said["seconds"]), warm


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=12, help="steps per run")
    parser.add_argument("--interval", type=int, default=4,
                        help="steps between checkpoints: a save that comes before the previous one is written waits")
    parser.add_argument("--preset", default="small", choices=sorted(p.stem for p in (ROOT / "presets").glob("*.json")))
    parser.add_argument("--gpu", type=int, help="one rank on this GPU instead of CPU ranks")
    parser.add_argument("--strategies", default="ddp,fsdp", help="comma-separated, of ddp, fsdp")
    args = parser.parse_args(argv)
    args.strategies = [s for s in args.strategies.split(",") if s]
    if not args.strategies or set(args.strategies) - {"ddp", "fsdp"}:
        parser.error("--strategies: choose from ddp, fsdp")
    return args


def main() -> None:
    args = parse(sys.argv[1:])
    with tempfile.TemporaryDirectory(prefix="bench-checkpoint-") as work:
        work_dir = Path(work)
        cache_dir = work_dir / "cache"
        rows: dict[str, list[dict[str, float]]] = {s: [] for s in args.strategies}
        for r in range(args.rounds):
            for strategy in rows:
                figures, folders = {}, {}
                for background in (False, True):
                    folders[background] = work_dir / f"{r}-{strategy}-{background}"
                    folders[background].mkdir()
                    figures[background] = run(folders[background], cache_dir, strategy, background, args.steps,
                                              args.interval, args.preset, args.gpu)
                (synchronous, _), (background_saves, out) = figures[False], figures[True]
                allocated = ALLOCATED.search(out)
                if allocated is None:
                    raise SystemExit(f"{strategy}: the background run did not say it allocated its staging buffers:\n"
                                     f"{out[-3000:]}")
                gb, verify_s, warm_s = verification(folders[True], cache_dir, strategy, args.steps, args.interval,
                                                    args.preset, args.gpu)
                row = {"size": synchronous[0]["bytes"],
                       "sync": statistics.median(c["blocked_s"] for c in synchronous),
                       "sync_write": statistics.median(c["write_s"] for c in synchronous),
                       "async": statistics.median(c["blocked_s"] for c in background_saves),
                       "first": background_saves[0]["blocked_s"], "allocated": float(allocated["seconds"]),
                       "later": statistics.median(c["blocked_s"] for c in background_saves[1:]),
                       "write": statistics.median(c["write_s"] for c in background_saves),
                       "waited": statistics.median(c["waited_s"] for c in background_saves),
                       "verify": verify_s / gb, "warm": warm_s / gb}
                row["ratio"] = row["async"] / row["sync"]
                rows[strategy].append(row)
                print(f"round {r} {strategy}: synchronous blocked {row['sync']:.2f} s (write {row['sync_write']:.2f} "
                      f"s) | background blocked {row['async']:.2f} s (first save {row['first']:.2f} s, later ones "
                      f"{row['later']:.2f} s; staging allocated at the start in {row['allocated']:.2f} s; "
                      f"{row['waited']:.2f} s waiting for the previous save; write "
                      f"{row['write']:.2f} s) | ratio {row['ratio']:.3f} | resume verified {gb:.2f} GB in "
                      f"{verify_s:.2f} s from the disk, {warm_s:.2f} s from the page cache by one reader", flush=True)
    print(f"\n{'strategy':<9}{'size':>10}{'sync blocked':>14}{'async blocked':>15}{'first':>8}{'later':>8}"
          f"{'at start':>10}{'async write':>13}{'ratio':>8}{'verify s/GB':>13}{'cached s/GB':>13}")
    for strategy, got in rows.items():
        m = {key: statistics.median(g[key] for g in got) for key in got[0]}
        print(f"{strategy:<9}{m['size'] / 1e9:>8.2f} GB{m['sync']:>12.2f} s{m['async']:>13.2f} s{m['first']:>6.2f} s"
              f"{m['later']:>6.2f} s{m['allocated']:>8.2f} s{m['write']:>11.2f} s{m['ratio']:>8.3f}"
              f"{m['verify']:>13.2f}{m['warm']:>13.2f}")
    print("goal: ratio <= 0.10")


if __name__ == "__main__":
    main()
