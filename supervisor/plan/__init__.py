"""What to start, decided before anything starts.

* `spec` — one `RankSpec` per rank of this node and the `Plan` that says how to start them (entry, environment,
  limits, timings);
* `rendezvous` — where the ranks meet: node 0's address and port checked before anything starts, a free port nobody
  else can take while the group runs, and the loopback interface;
* `slurm` — the multi-node layout a Slurm job's ``SLURM_*`` variables describe (host lists, a port from the job id).

Imports the leaves (`console`, `control.wire`), `gpus` and `diagnosis`.
"""
