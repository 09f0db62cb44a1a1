"""The operator's diagnoses, each behind one narrow function the watcher, the report or the CLI calls; no torch.

* `culprit` — on a stall: which rank holds the others up, from the flight recorder's sequence numbers and the stacks;
* `stragglers` — during a run: a rank persistently slower than the others, from the per-step times ranks report;
* `oom` — after a rank ran out of memory: the headline and the fixes, from the rank's report file;
* `verdicts` — a stall across nodes: every node's verdict on its own ranks, gathered on every node, and the culprit
  they agree on (or a node's silence);
* `stacks` — every rank's Python stacks read from outside (py-spy), for the culprit rule;
* `gpu_fault` — after a failure: a GPU's fault or the program's, from what NVML says changed since the preflight
  (`supervisor.gpus.preflight`) and the failing rank's CUDA error text;
* `error_file` — after a failure: the root cause (exception, traceback, time) a program under torch's ``@record`` wrote
  into its ``TORCHELASTIC_ERROR_FILE``.
"""
