"""What the GPU tier's tests share: the machine's usable GPU, runs through the supervisor on it, and NVML's list of
processes holding GPU memory. The skip condition and the fixtures are in tests/gpu/conftest.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gpu_visibility
from process_tree import watching
from rank_scripts.harness import clean_env
from rank_support import TINY, merged, set_flags
from supervisor.gpus import discovery as gpus

TORCH_PROBE = ("import json, torch\n"
               "ok = torch.cuda.is_available()\n"
               "print(json.dumps({'torch': torch.__version__, 'cuda': ok, 'count': torch.cuda.device_count() if ok "
               "else 0, 'capability': torch.cuda.get_device_capability(0) if ok else None}))\n")
RUN_TIMEOUT = 300.0


@dataclass(frozen=True)
class Machine:
    """The GPU the tier trains on (the first usable one, by physical id) and how to start processes that see it."""

    gpu: gpus.Gpu
    inventory: gpus.Inventory
    capability: tuple[int, int]
    env: dict[str, str]

    @property
    def id(self) -> int:
        return self.gpu.index

    @property
    def label(self) -> str:
        return f"GPU{self.gpu.index}"


def probe() -> Machine | str:
    """The machine, or why the tier cannot run here."""
    env = gpu_visibility.machine_gpus(clean_env(PYTHON=sys.executable))  # the shell scripts use this Python too
    inventory = gpus.discover(env)
    if not inventory.usable:
        visible = gpu_visibility.MACHINE_VALUE
        return (f"no CUDA GPU: NVML and nvidia-smi found {'none' if not inventory.gpus else 'none usable'} "
                f"(CUDA_VISIBLE_DEVICES {'unset' if visible is None else repr(visible)})")
    found = subprocess.run([sys.executable, "-c", TORCH_PROBE], env=env, capture_output=True, text=True, timeout=120)
    if found.returncode != 0:
        return f"torch cannot be imported: {found.stderr.strip()[-500:]}"
    torch_info = json.loads(found.stdout)
    if not torch_info["cuda"]:
        return f"this torch ({torch_info['torch']}) cannot use the GPU (a CPU build, or no driver)"
    return Machine(inventory.usable[0], inventory, tuple(torch_info["capability"]), env)


# ---------------------------------------------------------------------------------------------------------------------
# GPU memory held by processes


def compute_processes(index: int) -> set[int]:
    """Pids NVML lists as holding a compute context on the GPU (the pytest process holds none: it hides the GPUs)."""
    import pynvml

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        return {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
    finally:
        pynvml.nvmlShutdown()


def released(index: int, before: set[int], timeout: float = 10.0) -> set[int]:
    """The compute processes on the GPU that were not there `before`, after up to `timeout` seconds for the driver to
    tear down the contexts of processes that just died (empty when everything let go)."""
    deadline = time.monotonic() + timeout
    while (left := compute_processes(index) - before) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


# ---------------------------------------------------------------------------------------------------------------------
# Training runs on the GPU through the supervisor


@dataclass
class Outcome:
    code: int
    output: str  # stdout and stderr merged, as the user sees them
    log_dir: Path
    survivors: list[Any]

    def run_dir(self) -> Path:
        (folder,) = [p for p in self.log_dir.iterdir() if p.is_dir()]
        return folder


def gpu_layer(tmp_path: Path, cache_dir: Path, **overrides: dict[str, Any]) -> dict[str, Any]:
    """The tests' tiny run (rank_support.TINY) on the GPU in bf16, checkpoints under `tmp_path`. Eager unless a test
    turns compilation on: compiling costs each run tens of seconds and is tested on its own."""
    layer = merged(TINY, {"system": {"device": "cuda", "compile": False}, "data": {"cache_dir": str(cache_dir)},
                          "training": {"use_amp": True, "precision": "bf16", "learning_rate": 1e-2},
                          "checkpoint": {"dir": str(tmp_path / "ckpt")}})
    return merged(layer, overrides)


def supervise(machine: Machine, tmp_path: Path, layer: dict[str, Any], *extra: str, tag: str = "",
              command: list[str] | None = None, on_output: Callable[[str, subprocess.Popen], None] | None = None,
              preset: str | None = "debug", timeout: float = RUN_TIMEOUT) -> Outcome:
    """`python -m supervisor --gpus <id> --preset <preset> ...` (or `command`) to its end, in `tmp_path`, output in
    run<tag>.txt.

    `on_output(text, proc)` is called while the run goes, with the output so far (to signal it at a given line).
    `preset` None: no --preset (a --replay takes the run's own config)."""
    log, log_dir = tmp_path / f"run{tag}.txt", tmp_path / f"logs{tag}"
    base = command or [sys.executable, "-m", "supervisor", "--gpus", str(machine.id)]
    cmd = [*base, *(["--preset", preset] if preset else []), "--no-footer", "--log-dir", str(log_dir),
           "--grace-period", "5", *set_flags(layer), *extra]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=machine.env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    with watching(proc) as tree:
        deadline = time.monotonic() + timeout
        while proc.poll() is None:
            assert time.monotonic() < deadline, f"no end within {timeout} s:\n{log.read_text()[-3000:]}"
            if on_output is not None:
                on_output(log.read_text(errors="replace"), proc)
            time.sleep(0.05)
        tree.stop()
        return Outcome(proc.returncode, log.read_text(errors="replace"), log_dir, tree.survivors(timeout=5.0))


def banner(outcome: Outcome, machine: Machine, key: str) -> str:
    """Rank 0's banner line that starts with `key` ("precision", "world size" ...), without the prefixes."""
    found = re.search(rf"^{machine.label}:INFO \| ({re.escape(key)}: .*)$", outcome.output, re.M)
    assert found, f"no '{key}:' banner line:\n{outcome.output[-3000:]}"
    return found.group(1)
