"""The batch side of a Slurm job, what `train_slurm.sbatch` runs: one supervisor per node, and a requeue when Slurm's
time-limit warning stopped the run at a checkpoint.

Usage (inside an allocation): ``python -m supervisor.slurm_job [training flags...]``, which runs

    srun --ntasks-per-node=1 --cpus-per-task=<the job's> bash run_training.sh --resume auto [training flags...]

- The training flags are the user's, after the script name (``sbatch train_slurm.sbatch --debug``); nothing here
  chooses a preset, so the supervisor's default (production) holds unless they name one. ``--resume auto`` continues
  a requeued job from its latest checkpoint, and starts fresh when there is none.
- Nodes, GPUs per node and CPUs per task are the job's own (``#SBATCH`` lines, overridden by ``sbatch`` options). The
  step asks for the job's CPUs per task explicitly: srun in Slurm 22.05 no longer inherits it, and a step confined to
  one CPU would squeeze a node's supervisor and ranks onto it wherever Slurm binds tasks to cores.
- `SUPERVISOR_CONTROL_SECRET` is generated here unless already set: srun hands the job's environment to every node's
  supervisor, so they share a secret that nobody outside the job has (supervisor/control_wire.py).
- Exit code 138 (every rank checkpointed after SIGUSR1): ``scontrol requeue``, and the job starts again in a new
  allocation. Any other code is the job's.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

from supervisor.control_wire import SECRET_ENV
from trainer.errors import USER_ERROR_EXIT_CODE, UserError

ROOT = Path(__file__).resolve().parent.parent
REQUEUE_EXIT_CODE = 128 + 10  # SIGUSR1: the time-limit warning, answered with a checkpoint


def step_command(env: dict[str, str], flags: list[str]) -> list[str]:
    cpus = [f"--cpus-per-task={env['SLURM_CPUS_PER_TASK']}"] if env.get("SLURM_CPUS_PER_TASK") else []
    return ["srun", "--ntasks-per-node=1", *cpus, "bash", str(ROOT / "run_training.sh"), "--resume", "auto", *flags]


def run_job(env: dict[str, str], flags: list[str]) -> int:
    job_id = env.get("SLURM_JOB_ID")
    if not job_id:
        raise UserError("train_slurm.sbatch is a Slurm job script and SLURM_JOB_ID is not set; submit it with sbatch "
                        "train_slurm.sbatch [flags...] (or start run_training.sh yourself)")
    if not env.get(SECRET_ENV):
        env[SECRET_ENV] = secrets.token_hex(32)
    code = subprocess.run(step_command(env, flags), env=env).returncode
    code = code if code >= 0 else 128 - code  # srun itself ended by a signal: the shell's convention
    if code == REQUEUE_EXIT_CODE:
        print(f"stopped by the time-limit warning (exit {code}): requeueing job {job_id}; its next allocation "
              f"resumes from the latest checkpoint", flush=True)
        subprocess.run(["scontrol", "requeue", job_id])
    return code


def main() -> int:
    try:
        return run_job(dict(os.environ), sys.argv[1:])
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return USER_ERROR_EXIT_CODE


if __name__ == "__main__":
    sys.exit(main())
