"""One group of ranks, from spawn to the last exit: what torch.distributed.elastic calls the process context.

* `worker` — one rank: its own process group, the parent-death signal, signalled and reaped by pid;
* `reaper` — the sentinel that kills every rank's group if the supervisor dies without cleaning up (SIGKILL) and
  removes the supervisor's folders in /dev/shm, and the sweep of what is left below the supervisor after a group;
* `standby` — one process per run with restarts that imports what a rank needs once, before the first group, and forks
  every group's ranks (re-parented to the supervisor) instead of spawning them;
* `pump` — rank output → ``GPU<id>:`` lines on the console and plain lines in ``gpu<id>.log``;
* `signals` — signals as readable events in the watcher's ``select`` loop;
* `liveness` — what each rank last said on the progress channel (or, for a program that says nothing, its output and
  CPU time), and the allowance before it counts as stalled;
* `hangs` — the hang watchdog: when a group is stalled and which rank holds it up (its stacks read from outside);
* `failure` — which rank's failure is the run's when several fail, and the gate that keeps the others' fallout off the
  console;
* `stop` — the stop ladder: SIGTERM, the short kill for ranks in a rendezvous or held by a lost node, SIGKILL after
  the grace period, what is left behind;
* `watch` — the watcher: one ``select`` loop over exits, progress, signals and the control channel, from start to the
  last exit.

Imports the leaves, `gpus`, `diagnosis` and `plan`; the control channel only as a type (it is above).
"""
