"""The `--dry-run` memory estimate against the peak the run itself reports, on a real GPU: `small` and `1b` as
shipped (compiled layers, chunked loss, DDP on one GPU), a few steps each through the supervisor.

The measured figure is the one rank 0 logs (`mem 41.2 GiB (52 %)`) and records as `peak_mem_gib`: the caching
allocator's peak reservation. The estimate is the dry run's total for the chosen strategy, flat overhead included:
the two numbers a user compares."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from rank_scripts.harness import PYTHON, clean_env, cleanup, run  # noqa: F401  (cleanup: fixture)

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA GPU: torch.cuda.is_available() is false here")]

STEPS = 6
TOLERANCE = 0.20
TOTAL_LINE = re.compile(r"^\s+total\s+(?P<ddp>[\d.]+) (?P<unit>GiB|MiB)", re.MULTILINE)
MEMORY_FIELD = re.compile(r"\| mem (?P<gib>[\d.]+) GiB \((?P<percent>\d+) %\)")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


def flags(cache_dir: Path, tmp_path: Path) -> list[str]:
    return ["--nproc", "1", "--max-steps", str(STEPS), "--set", "training.warmup_steps=1",
            "--set", "logging.log_interval=1", "--set", "training.eval_interval=0",
            "--set", "checkpoint.save_final=false", "--set", f"checkpoint.dir={tmp_path / 'ckpt'}",
            "--set", f"data.cache_dir={cache_dir}"]


def dry_run_total_gib(preset: str, extra: list[str], tmp_path: Path) -> float:
    result = subprocess.run([PYTHON, "-m", "supervisor", "--preset", preset, "--dry-run", *extra], cwd=tmp_path,
                            env=clean_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "strategy ddp" in result.stdout and "compiled layers, chunked loss" in result.stdout, result.stdout
    match = TOTAL_LINE.search(result.stdout)
    assert match, result.stdout
    return float(match["ddp"]) / (1024 if match["unit"] == "MiB" else 1)


@pytest.mark.parametrize("preset", ["small", "1b"])
def test_the_dry_run_estimate_is_within_20_percent_of_the_measured_peak(preset: str, tmp_path: Path,
                                                                         cache_dir: Path, cleanup) -> None:
    extra = flags(cache_dir, tmp_path)
    estimate_gib = dry_run_total_gib(preset, extra, tmp_path)
    r = run(tmp_path, "--preset", preset, *extra, entry=None, timeout=1500)
    assert r.returncode == 0, r.stderr[-3000:]
    log = (r.stdout + r.stderr)
    assert "compute: torch.compile each decoder layer | loss chunked" in log or "loss liger" in log, log[-3000:]
    logged = [float(m["gib"]) for m in MEMORY_FIELD.finditer(log)]
    assert logged, "rank 0's summary lines show no `mem … GiB (… %)`"
    steps = json.loads((r.run_dir() / "training_history.json").read_text())["steps"]
    recorded = [s["peak_mem_gib"] for s in steps]
    assert len(recorded) == STEPS and all(v is not None and v > 0 for v in recorded)
    measured = max(recorded)
    assert abs(max(logged) - measured) < 0.06  # the log shows what the history records (one decimal)
    error = estimate_gib / measured - 1
    print(f"{preset}: dry-run estimate {estimate_gib:.1f} GiB, measured peak (reserved) {measured:.1f} GiB, "
          f"error {error:+.0%}")
    assert abs(error) <= TOLERANCE, (f"{preset}: the dry run estimates {estimate_gib:.1f} GiB, the run peaked at "
                                     f"{measured:.1f} GiB ({error:+.0%}; allowed ±{TOLERANCE:.0%})")
