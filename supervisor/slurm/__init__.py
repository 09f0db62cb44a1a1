"""Slurm: the multi-node layout a job's `SLURM_*` variables describe (`layout`, used by `python -m supervisor` in any
job), and what `train_slurm.sbatch` runs (`job`: one supervisor per node through `srun`, the time-limit warning
passed to its node's supervisor alone, the requeue, the requeue without a node whose GPU failed).
"""
