"""Diagnosis benchmark: the stall's stop, the straggler detector's delay and its false alarms, 2 CPU ranks on gloo.

    python bench/bench_diagnosis.py [--normal-runs 20] [--steps 60]

Every run is ``python -m supervisor`` with two fake GPUs (``SUPERVISOR_FAKE_GPUS=0,1``) on a tiny model:
1. stall detected → every rank gone: rank 1 hangs at step 3 (``--hang-timeout 5``); seconds from the supervisor's
   stall line to its exit (it exits after its last rank). Goal: ≤ 3 s (it was the 30 s grace period). The same for a
   frozen rank: rank 1 SIGSTOPped after step 3, answering neither the stack request nor the flight recorder; the
   headline must name it.
2. straggler detection delay: the normal step time is measured first (rank 0's ``training_history.json``), then rank 1
   sleeps 30 % of it before every step from step 5; steps from the slowdown to the warning. Goal: ≤ 30.
3. false alarms: ``straggler:`` warnings over N normal runs. Goal: 0.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--debug", "--no-footer", "--nproc", "2", "--grace-period", "30",
        "--set", "model.hidden_size=32", "--set", "model.num_layers=1", "--set", "model.num_heads=4",
        "--set", "model.num_kv_heads=2", "--set", "model.ffn_hidden_size=64",
        "--set", "model.max_position_embeddings=64", "--set", "data.source=stdlib", "--set", "data.vocab_size=300",
        "--set", "data.context_length=32", "--set", "data.max_samples=40", "--set", "training.batch_size=4",
        "--set", "training.warmup_steps=1", "--set", "training.eval_interval=0", "--set", "checkpoint.interval=0",
        "--set", "checkpoint.save_final=false", "--set", "logging.tensorboard=false"]
SLOW_FROM = 5
CUE = b"stalled: no progress"


def freeze_rank_1(supervisor: int) -> None:
    import psutil

    (rank,) = [p for p in psutil.Process(supervisor).children() if p.environ().get("RANK") == "1"]
    rank.suspend()  # SIGSTOP


def supervise(work: Path, *flags: str, freeze_after: bytes | None = None) -> tuple[int, str, Path, float | None]:
    """(exit code, output, run folder, seconds from the stall line to the exit or None); rank 1 is frozen once
    `freeze_after` shows up in the output."""
    logs = work / "logs"
    before = set(logs.iterdir()) if logs.exists() else set()
    out = work / "out.txt"
    env = {"SUPERVISOR_FAKE_GPUS": "0,1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": str(work)}
    with open(out, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "supervisor", *TINY, "--log-dir", str(logs),
                                 "--set", f"data.cache_dir={json.dumps(str(work / 'cache'))}",
                                 "--set", f"checkpoint.dir={json.dumps(str(work / 'ckpt'))}", *flags],
                                cwd=work, env=env, stdout=f, stderr=subprocess.STDOUT)
    detected = None
    while proc.poll() is None:
        text = out.read_bytes()
        if freeze_after is not None and freeze_after in text:
            freeze_rank_1(proc.pid)
            freeze_after = None
        if detected is None and CUE in text:
            detected = time.monotonic()
        time.sleep(0.01)
    gone = None if detected is None else time.monotonic() - detected
    run_dir = next(iter(set(logs.iterdir()) - before))
    return proc.returncode, out.read_text(errors="replace"), run_dir, gone


def step_time(run_dir: Path) -> float:
    history = json.loads((run_dir / "training_history.json").read_text())
    rates = [s["tokens_per_s"] for s in history["steps"][3:] if s.get("tokens_per_s")]
    return history["run"]["tokens_per_step"] / statistics.median(rates)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--normal-runs", type=int, default=20, help="normal runs counted for false alarms (default 20)")
    parser.add_argument("--steps", type=int, default=60, help="steps per run (default 60)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        alarms, step_times = 0, []
        for _ in range(args.normal_runs):
            code, out, run_dir, _ = supervise(work, "--set", f"training.max_steps={args.steps}")
            assert code == 0, out[-3000:]
            alarms += len(re.findall(r"^supervisor: straggler:", out, re.M))
            step_times.append(step_time(run_dir))
        normal = statistics.median(step_times)
        delay = 0.3 * normal
        code, out, _, _ = supervise(work, "--set", f"training.max_steps={args.steps}",
                                    "--set", "debug.inject_fault=slow", "--set", "debug.inject_fault_rank=1",
                                    "--set", f"debug.inject_fault_step={SLOW_FROM}",
                                    "--set", f"debug.inject_fault_delay_s={delay:.4f}")
        named = re.search(r"^supervisor: (straggler: (GPU\d) is (\d+) % slower .* \(at step (\d+)\))$", out, re.M)
        code_h, out_h, _, gone = supervise(work, "--set", "training.max_steps=12", "--hang-timeout", "5",
                                           "--set", "debug.inject_fault=hang", "--set", "debug.inject_fault_rank=1",
                                           "--set", "debug.inject_fault_step=3")
        headline = re.search(r"^supervisor: (GPU\d \(rank \d\) stalled at step .*)$", out_h, re.M)
        code_f, out_f, _, gone_f = supervise(work, "--set", "training.max_steps=2000", "--hang-timeout", "5",
                                             freeze_after=b"] Step [3/")
        frozen = re.search(r"^supervisor: (GPU\d \(rank \d\) stalled at step .*)$", out_f, re.M)
    print(f"stall detected -> every rank gone: {gone:.2f} s (exit {code_h}); headline: "
          f"{headline[1] if headline else 'none'}")
    print(f"frozen rank (SIGSTOP): stall detected -> every rank gone: {gone_f:.2f} s (exit {code_f}); headline: "
          f"{frozen[1] if frozen else 'none'}")
    print(f"straggler: normal step {normal * 1000:.1f} ms, rank 1 slowed by {delay * 1000:.1f} ms (30 %) from step "
          f"{SLOW_FROM}: " + (f"named {named[2]} ({named[3]} %) at step {named[4]}, "
                              f"{int(named[4]) - SLOW_FROM} steps after the slowdown" if named else "never named"))
    print(f"false alarms: {alarms} over {args.normal_runs} normal runs of {args.steps} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
