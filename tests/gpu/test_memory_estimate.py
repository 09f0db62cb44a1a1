"""The `--dry-run` memory estimate against the peak the run itself reports, on a real GPU: `small` and `1b` as
shipped (compiled layers, chunked loss, DDP on one GPU), a few steps each through the supervisor.

The measured figure is the one rank 0 logs (`mem 41.2 GiB (52 %)`) and records as `peak_mem_gib`: the caching
allocator's peak reservation. The estimate compared with it is the dry run's total less its flat overhead line (the
CUDA context and communication buffers, which the allocator never holds): like against like.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_support import Machine, supervise
from rank_support import set_flags

pytestmark = pytest.mark.gpu

STEPS = 6
TOLERANCE = 0.20
ROW = re.compile(r"^\s+(?P<name>total|overhead)\s+(?P<ddp>[\d.]+) (?P<unit>GiB|MiB)", re.MULTILINE)
MEMORY_FIELD = re.compile(r"\| mem (?P<gib>[\d.]+) GiB \((?P<percent>\d+) %\)")


def run_flags(tmp_path: Path, cache_dir: Path) -> dict[str, dict[str, object]]:
    """A few logged steps of the preset as shipped: nothing about the model, batch or fast path is changed."""
    return {"training": {"max_steps": STEPS, "warmup_steps": 1, "eval_interval": 0},
            "logging": {"log_interval": 1}, "checkpoint": {"save_final": False, "interval": 0,
                                                           "dir": str(tmp_path / "ckpt")},
            "data": {"cache_dir": str(cache_dir)}}


def allocator_estimate_gib(machine: Machine, preset: str, layer: dict, tmp_path: Path) -> float:
    """The dry run's DDP total less its overhead, in GiB."""
    done = subprocess.run([sys.executable, "-m", "supervisor", "--preset", preset, "--gpus", str(machine.id),
                           "--dry-run", *set_flags(layer)], cwd=tmp_path, env=machine.env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "strategy ddp" in done.stdout and "compiled layers" in done.stdout, done.stdout
    rows = {m["name"]: float(m["ddp"]) / (1024 if m["unit"] == "MiB" else 1) for m in ROW.finditer(done.stdout)}
    assert rows.keys() == {"total", "overhead"}, done.stdout
    return rows["total"] - rows["overhead"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("preset", ["small", "1b"])
def test_the_dry_run_estimate_is_within_20_percent_of_the_measured_peak(preset: str, machine: Machine,
                                                                         tmp_path: Path) -> None:
    layer = run_flags(tmp_path, tmp_path / "cache")  # the preset's own corpus and tokenizer
    estimate_gib = allocator_estimate_gib(machine, preset, layer, tmp_path)
    run = supervise(machine, tmp_path, layer, preset=preset, timeout=600)
    assert run.code == 0, run.output[-3000:]
    assert "compute: torch.compile each decoder layer" in run.output, run.output[-3000:]
    logged = [float(m["gib"]) for m in MEMORY_FIELD.finditer(run.output)]
    assert logged, "rank 0's summary lines show no `mem … GiB (… %)`"
    steps = json.loads((run.run_dir() / "training_history.json").read_text())["steps"]
    recorded = [s["peak_mem_gib"] for s in steps]
    assert len(recorded) == STEPS and all(v is not None and v > 0 for v in recorded)
    measured = max(recorded)
    assert abs(max(logged) - measured) < 0.06  # the log shows what the history records (one decimal)
    error = estimate_gib / measured - 1
    print(f"{preset}: dry-run estimate (less overhead) {estimate_gib:.1f} GiB, measured peak (reserved) "
          f"{measured:.1f} GiB, error {error:+.0%}")
    assert abs(error) <= TOLERANCE, (f"{preset}: the dry run estimates {estimate_gib:.1f} GiB, the run peaked at "
                                     f"{measured:.1f} GiB ({error:+.0%}; allowed ±{TOLERANCE:.0%})")
