"""How long a checkpoint stops training: synchronous saves against saves written in the background, side by side.

Each side is a real supervised run (`python -m supervisor`, as `run_training.sh` starts it) of the `small` preset
(~125M parameters; with AdamW the full state is ~1.5 GB) on 2 CPU ranks with a tiny batch (1 sequence of 128
tokens), a checkpoint every 4 steps, for DDP (synchronous: rank 0 writes the full state.pt; in the background: each
rank stages and writes its share of the replicated state) and FSDP2 (every rank writes its DCP shards). The figures
are each run's own records in training_history.json: `blocked_s` (training stopped: staging, and for a synchronous
save the whole write) and `write_s`. Every strategy's two sides run back to back in each round, so a
busy machine penalises both alike; the ratio is the median of the per-round ratios of the median blocked time.

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
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORLD = 2
TINY_BATCH = ["--set", "training.batch_size=1", "--set", "training.grad_accum_nums=1",
              "--set", "data.context_length=128", "--set", "data.max_samples=200"]


def placement(gpu: int | None) -> list[str]:
    """Where the ranks run: WORLD CPU ranks, or one rank on GPU `gpu` with eager layers."""
    if gpu is None:
        return ["--nproc", str(WORLD), "--set", "system.device=cpu"]
    return ["--gpus", str(gpu), "--set", "system.compile=false"]


def run(folder: Path, cache_dir: Path, strategy: str, background: bool, steps: int, interval: int, preset: str,
        gpu: int | None) -> list[dict[str, float]]:
    """One supervised run; its checkpoints' records (rank 0's training_history.json)."""
    argv = [sys.executable, "-m", "supervisor", "--preset", preset, *placement(gpu), "--no-footer",
            "--log-dir", str(folder / "logs"), "--max-steps", str(steps), *TINY_BATCH,
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
    (history,) = (folder / "logs").glob("*/training_history.json")
    return json.loads(history.read_text())["checkpoints"]


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
        rows: dict[str, list[tuple[float, float, float, float, float]]] = {s: [] for s in args.strategies}
        for r in range(args.rounds):
            for strategy in rows:
                figures = {}
                for background in (False, True):
                    folder = work_dir / f"{r}-{strategy}-{background}"
                    folder.mkdir()
                    records = run(folder, cache_dir, strategy, background, args.steps, args.interval, args.preset,
                                  args.gpu)
                    figures[background] = (statistics.median(c["blocked_s"] for c in records),
                                           statistics.median(c["write_s"] for c in records), records[0]["bytes"],
                                           statistics.median(c["waited_s"] for c in records))
                (sync_blocked, sync_write, size, _), (bg_blocked, bg_write, _, waited) = figures[False], figures[True]
                rows[strategy].append((sync_blocked, bg_blocked, bg_blocked / sync_blocked, bg_write, size))
                print(f"round {r} {strategy}: synchronous blocked {sync_blocked:.2f} s (write {sync_write:.2f} s) | "
                      f"background blocked {bg_blocked:.2f} s ({waited:.2f} s of it waiting for the previous save; "
                      f"write {bg_write:.2f} s) | ratio {bg_blocked / sync_blocked:.3f}", flush=True)
    print(f"\n{'strategy':<9}{'size':>10}{'sync blocked':>14}{'async blocked':>15}{'async write':>13}{'ratio':>8}")
    for strategy, got in rows.items():
        ratio = statistics.median(g[2] for g in got)
        print(f"{strategy:<9}{got[0][4] / 1e9:>8.2f} GB{statistics.median(g[0] for g in got):>12.2f} s"
              f"{statistics.median(g[1] for g in got):>13.2f} s{statistics.median(g[3] for g in got):>11.2f} s"
              f"{ratio:>8.3f}")
    print("goal: ratio <= 0.10")


if __name__ == "__main__":
    main()
