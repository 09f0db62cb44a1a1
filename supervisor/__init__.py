"""The launcher: one isolated process per GPU, prefixed logs, kill-all, hang watchdog, failure report.

The run, in the order it happens:

* `cli` (arguments → config → devices → plan) and `launcher` (prepare the data once, start, watch, restart, report);
* `plan` (each rank's environment), `gpus` (which GPUs exist and which a run gets), `rendezvous` (a free port),
  `exclusion` (a restart without a faulty GPU);
* `worker` (one rank's process), `reaper` (the sentinel that kills every rank if the supervisor dies), `signals`;
* `pump` (rank output → prefixed console lines and per-rank logs), `console` and `footer` (the supervisor's own
  output);
* `watch` (one group from start to last exit), `liveness` (what each rank last said, and its allowance),
  `failure` (whose failure is the run's);
* `report` (the summary and the exit code);
* subpackages — `diagnosis` (culprit, stragglers, OOM, preflight, GPU faults), `control` (the authenticated channel
  between the nodes' supervisors), `slurm` (the layout a job describes, and the job script's side);
* `bootstrap` (the Python environment for the shell scripts; standard library only).

Imports `trainer`'s torch-free parts (the run's config, checkpoint layout, token cache, progress records, errors);
never torch at module level: it must start fast.
"""
