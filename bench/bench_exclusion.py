"""GPU exclusion benchmark: from a GPU fault to training again on the other GPUs, 4 fake GPUs on CPU ranks.

    python bench/bench_exclusion.py [--runs 3]

Every run is ``python -m supervisor --max-restarts 1`` with four fake GPUs (``SUPERVISOR_FAKE_GPUS=0,1,2,3``, the
ranks compute on the CPU, gloo) and the fake NVML state (``SUPERVISOR_FAKE_GPU_STATE``) on a tiny model; rank 1 loses
its GPU at the start of step 3 (``debug.inject_fault=gpu_lost``, first group only), the last checkpoint being
step_000002. Each output line is stamped as it arrives; the phases, from the fault's own line:

  failure seen    the supervisor's "failed with" line (the rank's exit, through its pidfd)
  group gone      the "restart 1" line: the other ranks stopped (SIGTERM, gloo's collectives cut short), NVML asked
                  again, the verdict and the new layout written
  resumed         rank 0's "resumed from": 3 new rank processes started, torch imported, the group formed, the model
                  built and the checkpoint loaded
  training again  the first step of the restarted group logged ("[all ranks] step 2/")

On a GPU machine the rank start-up (imports, NCCL's communicator, the CUDA context) and the checkpoint's size decide
"resumed"; on these CPU ranks it is mostly four, then three, processes importing torch on two cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_diagnosis import ROOT, TINY

# bench_diagnosis's tiny run on 4 ranks (the later flag wins), with the accumulation a 4 → 3 regroup keeps exactly
FLAGS = [*TINY, "--nproc", "4", "--max-restarts", "1", "--set", "training.batch_size=2",
         "--set", "training.grad_accum_nums=3", "--set", "training.max_steps=6", "--set", "checkpoint.interval=2",
         "--set", "logging.log_interval=1", "--set", "logging.plot=false",
         "--set", "debug.inject_fault=gpu_lost", "--set", "debug.inject_fault_step=3",
         "--set", "debug.inject_fault_rank=1", "--set", "debug.inject_fault_restart=0"]
MARKS = [("fault", "fault injection: gpu_lost"), ("failure seen", "failed with exit 1"),
         ("group gone", "supervisor: restart 1 of 1"), ("resumed", "resumed from"),
         ("training again", "[all ranks] step 2/")]


def one_run(work: Path) -> dict[str, float]:
    """Seconds from the fault to each mark of one run."""
    state = work / "gpu_state.json"
    state.write_text("{}")
    env = {"SUPERVISOR_FAKE_GPUS": "0,1,2,3", "SUPERVISOR_FAKE_GPU_STATE": str(state), "PATH": "/usr/bin:/bin",
           "PYTHONPATH": str(ROOT), "HOME": str(work)}
    proc = subprocess.Popen([sys.executable, "-m", "supervisor", *FLAGS, "--log-dir", str(work / "logs"),
                             "--set", f"data.cache_dir={json.dumps(str(work.parent / 'cache'))}",
                             "--set", f"checkpoint.dir={json.dumps(str(work / 'ckpt'))}"],
                            cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    seen: dict[str, float] = {}
    for raw in proc.stdout:
        line, now = raw.decode(errors="replace"), time.monotonic()
        for name, cue in MARKS:
            # "training again" is the restarted group's step 2, after "resumed from"; step 2 ran once before the fault
            if name not in seen and cue in line and (name != "training again" or "resumed" in seen):
                seen[name] = now
    if proc.wait() != 0 or len(seen) != len(MARKS):
        raise SystemExit(f"run in {work} failed (exit {proc.returncode}); marks seen: {sorted(seen)}")
    return {name: seen[name] - seen["fault"] for name, _ in MARKS[1:]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = []
        for i in range(args.runs + 1):  # the first builds the token cache: not measured
            work = Path(tmp) / f"run{i}"
            work.mkdir()
            marks = one_run(work)
            if i:
                runs.append(marks)
    print(f"GPU 1 of 4 lost at step 3 (fake GPUs, CPU ranks on gloo) -> training again on GPUs 0, 2, 3; median of "
          f"{len(runs)} runs, seconds after the fault:")
    for name, _ in MARKS[1:]:
        values = [r[name] for r in runs]
        print(f"  {name:<15} {statistics.median(values):6.2f} s   (runs: {', '.join(f'{v:.2f}' for v in values)})")


if __name__ == "__main__":
    main()
