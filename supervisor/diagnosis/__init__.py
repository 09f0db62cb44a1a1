"""The operator's diagnoses, each behind one narrow function the watcher, the report or the CLI calls; no torch.

* `culprit` — on a stall: which rank holds the others up, from the flight recorder's sequence numbers and the stacks;
* `stragglers` — during a run: a rank persistently slower than the others, from the per-step times ranks report;
* `oom` — after a rank ran out of memory: the headline and the fixes, from the rank's report file;
* `preflight` — before a run: GPUs busy with another process, lost GPUs, uncorrectable ECC errors, pending page
  retirements, clock throttling (NVML, or the ``SUPERVISOR_FAKE_GPU_STATE`` test seam);
* `gpu_fault` — after a failure: a GPU's fault or the program's, from what NVML says changed since the preflight and
  the failing rank's CUDA error text;
* `error_file` — after a failure: the root cause (exception, traceback, time) a program under torch's ``@record`` wrote
  into its ``TORCHELASTIC_ERROR_FILE``.
"""
