"""A run from the command line to its exit code.

* `cli` — ``python -m supervisor``: arguments → config → devices → plan → the agent; one call into the trainer checks
  what a run asks of it before anything starts;
* `torchrun_args` — torchrun's command line (``[torchrun's flags] SCRIPT ARGS...``, ``-m``, ``--no-python``) read with
  torchrun's meanings into the same launch: honoured, accepted with one line saying what happens instead, or refused
  with one ``error:`` line (docs/torchrun.md);
* `agent` — one run: prepare the data once (a build stopped at once when another node is lost, fails or stalls),
  start the group, watch it, restart it when allowed, report.

The top of the house but for `slurm`: imports any room below.
"""
