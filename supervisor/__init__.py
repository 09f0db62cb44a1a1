"""The launcher: one isolated process per GPU, prefixed logs, kill-all, hang watchdog, failure report.

The rooms, each a package whose docstring says what it holds, from the bottom up (a room imports only rooms listed
before it, and the leaves; `tests/test_house.py` checks it, and ARCHITECTURE.md's tables name what these say):

* `bootstrap` — the Python environment for the shell scripts (standard library only; run by path, imports nothing);
* `console` — where the supervisor's own output goes: the console (plain, or a terminal with a live footer) and
  `supervisor.log` (a leaf every room may import);
* `gpus` — which GPUs exist and which a run gets, their health before and after (NVML), a restart without a faulty one;
* `diagnosis` — the operator's diagnoses: a stall's culprit (on a node and across the nodes), stragglers, OOM, GPU
  faults, a program's error file;
* `plan` — what to start: each rank's spec and environment, where the ranks meet, the layout a Slurm job describes;
* `group` — one group of ranks from spawn to the last exit: processes, output, liveness, hangs, failures, the stop;
* `control` — multi-node: the authenticated channel between the nodes' supervisors (its `wire` format is a leaf);
* `report` — the end-of-run summary and exit code, and the live footer;
* `launch` — the command line (the supervisor's own flags and torchrun's) and the agent that runs a plan to its end:
  prepare the data once, start, watch, restart, report;
* `slurm` — what `train_slurm.sbatch` runs: one supervisor per node, the requeue.

`__main__` is ``python -m supervisor``. Imports `trainer`'s torch-free parts (the run's config, checkpoint layout,
token cache, progress records, errors); never torch at module level: it must start fast. Those are the project's
own, found first: a package of the user's on PYTHONPATH that is named like one of them (`trainer`), which a torchrun
program under the supervisor imports as its own (docs/torchrun.md), must not replace them here.
"""

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parent.parent)
if sys.path[0] != _ROOT:
    sys.path.insert(0, _ROOT)
