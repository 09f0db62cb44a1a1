"""The rank's side of diagnosis: what it measures, records and rehearses so that a failure can be explained.
`supervisor.diagnosis` reads what these write; the torch-free ones (`oom_report`'s record, `flight_recorder`'s paths,
`step_timer`'s field names) are imported by the supervisor too, so this package imports nothing itself.

* `nan_guard` — skip non-finite steps without a host synchronisation; in debug mode, find the first module that made
  one (`nan_report`: the report and the dump files);
* `recompute` — a non-finite step recomputed once, in the run, from the parameters kept before it; `nan_verdict` — the
  verdict, the model's numerics or the device's (its words, the suspect GPU's `gpu_fault.json`; torch-free: the
  supervisor reads it);
* `spikes` — the loss-spike detector (its window, its rule);
* `host_sync` — counting device→host synchronisations (the guard's cost, measured);
* `oom_report` — what a rank that ran out of memory leaves for the supervisor;
* `flight_recorder` — dumping PyTorch's record of collectives when the supervisor asks, at a stall;
* `step_timer` — the per-step times the straggler detector compares;
* `faults` — fault injection (crash, hang, NaN, slow, out of memory, a lost GPU) to rehearse all of the above;
* `fake_gpu_state` — the fake NVML state file: the test seam the supervisor reads and the `gpu_lost` fault writes.
"""
