"""What a fault costs on a real GPU, and a step replayed there: a restart's rank forked by the standby initialises CUDA
in the forked process, resumes from the node's memory and loads its compiled graphs from the run's cache; a replay of
a compiled run's step gives the run's own losses."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from gpu_support import Machine, compute_processes, gpu_layer, released, supervise

pytestmark = pytest.mark.gpu

COMPILE_LINE = re.compile(r"torch\.compile: the first forward and backward \(step (\d+)\).*; (\d+) of (\d+) graphs "
                          r"from the cache")


def test_a_restart_forked_by_the_standby_trains_on_the_gpu(machine: Machine, tmp_path: Path,
                                                            token_cache_dir: Path) -> None:
    """Compiled, one rank, forked by the standby (as every group's of a run with restarts): once it trains, SIGKILL to
    the rank; the restart's rank is forked by the standby too, holds a CUDA context of its own on the GPU (NVML lists
    it), resumes from memory, finds every graph in the cache, and trains; SIGTERM then ends the run with the GPU let
    go."""
    layer = gpu_layer(tmp_path, token_cache_dir, system={"compile": True}, training={"max_steps": 100_000},
                      checkpoint={"memory_interval": 1})
    before = compute_processes(machine.id)
    seen: dict[str, object] = {}

    def drive(text: str, proc: subprocess.Popen) -> None:
        logs = list((tmp_path / "logs").glob("*/supervisor.log"))
        log = logs[0].read_text() if logs else ""
        past_snapshot = "Step [" in text.partition("memory snapshots in ")[2]  # else no copy to resume from
        if "killed" not in seen and "the standby ready" in log and past_snapshot:
            (pid,) = re.findall(rf"group 0: {machine.label} pid (\d+) \(forked by the standby\)", log)
            os.kill(int(pid), signal.SIGKILL)
            seen["killed"] = int(pid)
        forked = re.findall(rf"group 1: {machine.label} pid (\d+) \(forked by the standby\)", log)
        if forked and "holding" not in seen and "Step [" in text.split("restart 1 of 1 after")[-1]:
            seen["holding"] = int(forked[0]) in compute_processes(machine.id)  # while it trains
            proc.send_signal(signal.SIGTERM)

    run = supervise(machine, tmp_path, layer, "--max-restarts", "1", on_output=drive)
    assert run.code == 128 + signal.SIGTERM, run.output[-4000:]
    assert re.search(r"the ranks resume from step \d+ .*; forked from the standby$", run.output, re.M), \
        run.output[-4000:]
    assert seen.get("holding") is True, "the forked rank holds no CUDA context on the GPU"
    assert "resumed from the memory copy in " in run.output
    compiled = COMPILE_LINE.findall(run.output)
    assert len(compiled) == 2 and compiled[1][1] == compiled[1][2] != "0", compiled
    assert run.survivors == [] and released(machine.id, before) == set()


def test_a_replay_of_a_compiled_run_gives_its_losses(machine: Machine, tmp_path: Path, token_cache_dir: Path) -> None:
    """12 compiled steps, checkpoints every 5; `--replay RUN --step 8` trains 5-8 again from step_000005, on the GPU,
    and its recorded losses are the run's own, float for float."""
    layer = gpu_layer(tmp_path, token_cache_dir, system={"compile": True}, training={"max_steps": 12},
                      checkpoint={"interval": 5})
    run = supervise(machine, tmp_path, layer)
    assert run.code == 0, run.output[-3000:]
    source = run.run_dir()
    replay = supervise(machine, tmp_path, {}, "--replay", str(source), "--step", "8", tag="-replay", preset=None)
    assert replay.code == 0, replay.output[-3000:]
    target = replay.run_dir()

    def losses(folder: Path) -> dict[int, float]:
        history = json.loads((folder / "training_history.json").read_text())
        return {r["step"]: r["loss"] for r in history["steps"] if 5 <= r["step"] <= 8}

    assert losses(target) == losses(source) and len(losses(source)) == 4
