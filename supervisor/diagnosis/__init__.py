"""The operator's diagnoses, each behind one narrow function the watcher, the report or the CLI calls; no torch.

* `culprit` — on a stall: which rank holds the others up, from the flight recorder's sequence numbers and the stacks;
* `stragglers` — during a run: a rank persistently slower than the others, from the per-step times ranks report;
* `oom` — after a rank ran out of memory: the headline and the fixes, from the rank's report file;
* `verdicts` — across nodes: every node's finding when the group was silent (a stall only when every node's ranks
  say so), and a stall's verdict of every node on its own ranks, gathered on every node, and the culprit they agree
  on (or a node's silence);
* `stacks` — every rank's Python stacks read from outside (py-spy), for the culprit rule;
* `quiet` — quiet is not hung: a rank of a program that reports nothing, in its own code and waiting for something of
  its own (a sleep, its files, sockets, input or child: its main thread's system call), and a node's finding on its
  ranks when the whole group was silent;
* `gpu_fault` — after a failure: a GPU's fault or the program's, from what NVML says changed since the preflight
  (`supervisor.gpus.preflight`) and the failing rank's CUDA error text;
* `error_file` — after a failure: the root cause (exception, traceback, time) a program under torch's ``@record`` wrote
  into its ``TORCHELASTIC_ERROR_FILE``.
"""
