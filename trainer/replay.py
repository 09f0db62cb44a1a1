"""Replaying one step of an earlier run: `--replay <run folder> --step N` (`supervisor.launch.cli`).

The replay reads the run's own resolved config (`config.json`, or the last restart's `config.restart<n>.json`), takes
the newest intact checkpoint of that run at or before step N (a checkpoint `step_<c>` holds the state before step
index c), and starts as many ranks as ran the step (`training_history.json` says how many; else the checkpoint).
The ranks resume from it, train the same batches up to step N (the batch order is a function of the config, its
`training.skip_batches` included: the skips the run recorded are taken from its history), run step N with the NaN
diagnostics of debug mode on (the first non-finite module, every NaN gradient, the dumps), say which documents step
N's batch holds, and stop (`training.replay_step`, read by `trainer.loop`). N is the step as the log lines count it.
The config keeps the run's `debug` keys: the loop turns the diagnostics on for a replay itself, so that the `auto`
choices they would change (`trainer.config.choices`: compiled layers, the loss path) stay the run's. What a replay
reproduces is the steps' numbers: a NaN or loss-spike injection stays (it is part of them), while an injected fault of
a process or a device (`debug.inject_fault`, a `corrupt` result among them, and the checkpoint write stall) is left
out, said in the banner: the run met it once and went on after it (a restart, or the recompute that did not
reproduce a corrupted result), and fired again it would end the replay, or make a device's fault look like the
numerics'.

Bit-exact: with the same number of ranks on the same kind of device the replayed steps print the losses the run
printed (checked on CPU ranks, compiled layers included: the hooks are traced into them). `--nproc M` folds the run's W ranks onto M (the accumulation raised by W/M, the same global batch and
batches): the sums over ranks become sums over micro-batches, so the losses agree to rounding only.

The replay writes into a run folder of its own (its checkpoints, dumps and reports under it); the original run's
folder and checkpoints are only read.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
from dataclasses import dataclass, field, fields
from pathlib import Path

from trainer.checkpoint.layout import META_FILE, checksum_damage, damage, list_checkpoints, step_of
from trainer.config import Config, DebugConfig
from trainer.errors import UserError
from trainer.metrics import HISTORY_JSON, recorded
from trainer.rank_cli import resolving_flags

REPLAY_CHECKPOINTS = "checkpoints"  # the replay's own checkpoint folder, inside its run folder
RESTART_CONFIG = re.compile(r"config\.restart(\d+)\.json")
# the injections of a process's or a device's fault, which a replay leaves out (a NaN or a spike injection stays)
FAULT_KEYS = (*(f.name for f in fields(DebugConfig) if f.name.startswith("inject_fault")), "inject_write_stall_step")


@dataclass
class Replay:
    """What `--replay RUN --step N` starts: the config the ranks get, how many, from which checkpoint."""

    source: Path  # the original run's folder
    step: int
    config: Config
    world_size: int  # the ranks that ran the step
    checkpoint: Path | None  # None: from step 0, as the run began
    notes: list[str] = field(default_factory=list)

    def place(self, run_dir: Path) -> None:
        """The replay's own run folder is known: its checkpoints (the NaN dump's among them) go inside it."""
        self.config.checkpoint.dir = str(run_dir / REPLAY_CHECKPOINTS)


def from_flags(args: argparse.Namespace) -> Replay | None:
    """`--replay RUN --step N [--nproc M]` from the supervisor's command line; None without --replay."""
    if args.replay is None:
        if args.step is not None:
            raise UserError("--step N names the step --replay RUN replays; add --replay <run folder>")
        return None
    if args.step is None:
        raise UserError(f"--replay {args.replay} needs the step to replay: --step N (as the log lines count it)")
    if flags := resolving_flags(args):
        raise UserError(f"--replay runs the run's own config as it was; drop {', '.join(dict.fromkeys(flags))}")
    return plan(Path(args.replay), args.step, args.nproc, Path(args.log_dir))


def plan(source: Path, step: int, nproc: int | None, log_dir: Path) -> Replay:
    """The replay of `step` of the run in `source` on `nproc` ranks (None: as many as ran it). Its checkpoint folder
    is `log_dir` until its run folder is made there (`Replay.place`): the checks before the run touch no folder of
    the original's."""
    cfg = run_config(source)
    if not 0 <= step < cfg.training.max_steps:
        raise UserError(f"--step {step} is not a step of {source} (its steps are 0-{cfg.training.max_steps - 1})")
    passed: list[str] = []
    checkpoint = start_checkpoint(cfg, step, passed)
    world_size = ranks_that_ran(source, checkpoint) or nproc
    if world_size is None:
        raise UserError(f"--replay {source}: neither its {HISTORY_JSON} nor a checkpoint says how many ranks it ran "
                        f"on; give --nproc N")
    replay = Replay(source, step, copy.deepcopy(cfg), world_size, checkpoint)
    replay.notes += passed
    t = replay.config.training
    t.replay_step = step
    t.spike_policy = "log"  # a replay says a spike; going back is the run's decision, recorded already
    t.nan_recompute = False  # the diagnostics show the step itself
    t.skip_batches = {**(cfg.training.skip_batches or {}), **recorded_skips(source)} or None
    if nproc is not None and nproc != world_size:
        micro_batches = t.grad_accum_nums * world_size
        if micro_batches % nproc:
            raise UserError(f"--nproc {nproc}: the run's {micro_batches} micro-batches per step (accumulation "
                            f"{t.grad_accum_nums} on {world_size} ranks) do not divide among {nproc} ranks")
        t.grad_accum_nums = micro_batches // nproc
        replay.notes.append(f"--nproc {nproc}: the run's {world_size} ranks folded onto {nproc} (accumulation "
                            f"{t.grad_accum_nums}): the same batches, losses equal to rounding, not bit-exact")
        replay.world_size = nproc
    if (left_out := leave_out_faults(replay.config.debug)) is not None:
        replay.notes.append(left_out)
    c = replay.config.checkpoint
    c.resume = str(checkpoint) if checkpoint is not None else None
    c.dir = str(log_dir)
    c.interval, c.save_final = 0, False  # nothing to keep but what the diagnostics dump
    replay.config.logging.wandb = False  # a replay is no run of the project to chart
    gone = "" if Path(cfg.checkpoint.dir).is_dir() else f": its checkpoint folder {cfg.checkpoint.dir} is gone"
    start = (f"from {checkpoint}" if checkpoint is not None
             else f"from step 0 (no checkpoint of the run at or before it{gone})")
    replay.notes.insert(0, f"replay of step {step} of {source}: {start} on {replay.world_size} rank"
                           f"{'s' * (replay.world_size != 1)}, with the NaN diagnostics on; then it stops")
    replay.config.notes = [*cfg.notes, *replay.notes]
    return replay


def leave_out_faults(debug: DebugConfig) -> str | None:
    """Reset the injected faults of processes and devices in `debug` (a replay's copy) to none; the line that says
    which, None where there were none."""
    injected = []
    if debug.inject_fault is not None or debug.inject_fault_step is not None:
        injected.append(f"debug.inject_fault {debug.inject_fault or 'raise'} at step {debug.inject_fault_step} on "
                        f"rank {debug.inject_fault_rank}")
    if debug.inject_write_stall_step is not None:
        injected.append(f"the write stall after step {debug.inject_write_stall_step}")
    if not injected:
        return None
    for name, value in ((name, getattr(DebugConfig(), name)) for name in FAULT_KEYS):
        setattr(debug, name, value)
    return (f"the run's injected {' and '.join(injected)} is left out: a replay reproduces the steps' numbers, not "
            f"what happened to a process or a device (a NaN or loss-spike injection stays)")


def run_config(source: Path) -> Config:
    """The resolved config the run's last group read: config.json, or its last restart's."""
    if not (source / "config.json").is_file():
        raise UserError(f"--replay {source}: no config.json there; name a run folder (logs/<run-id>/)")
    restarts = sorted((int(m.group(1)), p) for p in source.iterdir() if (m := RESTART_CONFIG.fullmatch(p.name)))
    return Config.load(restarts[-1][1] if restarts else source / "config.json")


def start_checkpoint(cfg: Config, step: int, passed: list[str]) -> Path | None:
    """The run's newest intact checkpoint at or before `step`, each one passed over said in `passed`; where it has
    none, what the run itself began from (a checkpoint it was told to resume, or step 0). Intact means its checksums
    too, every byte read here: the ranks would refuse a damaged one, which the replay named, rather than go back."""
    for path in reversed(list_checkpoints(Path(cfg.checkpoint.dir))):
        if (step_of(path) or 0) > step:
            continue
        if (problem := damage(path) or checksum_damage(path)) is None:
            return path
        passed.append(f"{path} passed over: {problem}")
    spec = cfg.checkpoint.resume
    return Path(spec) if spec not in (None, "auto") else None


def ranks_that_ran(source: Path, checkpoint: Path | None) -> int | None:
    """How many ranks the run's last group had (its history says), else those that wrote the checkpoint; None when
    neither says."""
    for path in (source / HISTORY_JSON, checkpoint / META_FILE if checkpoint is not None else None):
        try:
            raw = json.loads(path.read_text()) if path is not None else {}
            return int(raw["run"]["world_size"] if "run" in raw else raw["world_size"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


def recorded_skips(source: Path) -> dict[str, int]:
    """The batches the run's rollbacks skipped (the spikes its history recorded: its journal, so a run whose rank 0
    was killed outright has them too), as `training.skip_batches`."""
    return {str(s["skip_from"]): int(s["skip_count"]) for s in recorded(source).spikes
            if isinstance(s.get("skip_count"), int) and s["skip_count"] and "skip_from" in s}
