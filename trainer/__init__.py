"""Everything one training rank does, and the description of a run it shares with the supervisor.

The rooms, each a package whose docstring says what it holds, from the bottom up (a room imports only rooms listed
before it, and the leaves; `tests/test_house.py` checks it):

* leaves any room may import — `errors` (`UserError`: one line, exit 2), `progress` (the progress channel to the
  supervisor, the device label), `durable` (temporary name → fsync → rename), `torch_release` (the installed torch's
  release and the trainer's floor);
* `config` — the run's configuration: types, bounds, layers, presets, sizes (no torch);
* `model` — the model, its loss, optimizer, process groups and wrapping, memory estimate;
* `data` — the token cache (built once per run) and the batches each rank reads from it;
* `diagnosis` — the rank's side of diagnosis: NaN guard, OOM report, flight recorder, step times, fault injection;
* `checkpoint` — checkpoints on disk, which one `--resume` means, saving and loading them over a run;
* the rank's run, at the top of this folder — `loop` (the step loop), `compile_check` (the first compiled step,
  tried alone), `metrics` (log line, history, MFU),
  `run_dir` (the run folder), `wandb_run`, `rank_cli` (`pretrain_main.py`), `preflight` (a run's config checked
  before anything starts: the supervisor's one call into the trainer), `replay` (the config that replays a step of an
  earlier run: `--replay RUN --step N`), `standby` (the node's standby: imports what a rank needs once,
  then forks every group's ranks).

Nothing here imports `supervisor`: the supervisor uses the run's description; the rank never needs the supervisor.
"""
