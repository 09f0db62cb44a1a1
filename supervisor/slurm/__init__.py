"""Slurm's batch side.

* `job` — what `train_slurm.sbatch` runs: the control secret, one supervisor per node through ``srun`` with the
  user's flags, the time-limit warning (``--signal=B:USR1``) passed on to its node's supervisor alone, the requeue
  after it, the requeue without a node whose GPU failed or that was lost.

The layout a job describes is `supervisor.plan.slurm`: any ``python -m supervisor`` in a job reads it.
"""
