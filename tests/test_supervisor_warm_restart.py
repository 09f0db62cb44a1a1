"""A fault costs seconds: what a restart of the trainer does not do again.

* compiled once per run: torch.compile's caches are in the run folder (`compile-cache/`), so the restarted group's
  first compiled step loads its graphs from inductor's cache instead of compiling them (the rank's log says how many);
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from rank_scripts.harness import clean_env
from rank_support import TINY, merged, set_flags

from supervisor.plan.spec import COMPILE_CACHE_DIR, Plan, RankSpec


def supervise(tmp_path: Path, layer: dict, *flags: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "supervisor", "--debug", "--no-footer", "--log-dir",
                           str(tmp_path / "logs"), *flags, *set_flags(layer)], cwd=tmp_path, env=clean_env(),
                          capture_output=True, check=False, text=True, timeout=timeout)


def test_compile_caches_live_in_the_run_folder_unless_set(tmp_path: Path, monkeypatch) -> None:
    plan = Plan(entry="pretrain_main.py", entry_args=[], run_dir=tmp_path, ranks=[RankSpec(0, 0, None)])
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", "/somewhere/mine")
    env = plan.rank_env(plan.ranks[0], 29500, None, 0)
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / COMPILE_CACHE_DIR / "inductor")
    assert env["TRITON_CACHE_DIR"] == "/somewhere/mine"


def test_a_restart_loads_the_compiled_graphs_from_the_run_folder(tmp_path: Path, token_cache_dir: Path) -> None:
    """One compiled CPU rank (inductor's C++ kernels), a fault after step 2's checkpoint: the first group compiles
    every graph, the restarted group's first compiled step finds each of them in the run folder's cache."""
    layer = merged(TINY, {"system": {"compile": True}, "data": {"cache_dir": str(token_cache_dir)},
                          "training": {"max_steps": 4},
                          "checkpoint": {"dir": str(tmp_path / "ckpt"), "interval": 2, "async_save": False},
                          "debug": {"inject_fault": "exit", "inject_fault_step": 3, "inject_fault_restart": 0}})
    proc = supervise(tmp_path, layer, "--nproc", "1", "--max-restarts", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "logs").iterdir()
    cache = run_dir / COMPILE_CACHE_DIR / "inductor"
    said = re.findall(r"torch\.compile: the first forward and backward \(step (\d)\).*; (\d+) of (\d+) graphs from the "
                      r"cache in (\S+)", proc.stdout)
    assert [(step, folder) for step, _, _, folder in said] == [("0", str(cache)), ("2", str(cache))], proc.stdout
    (_, first_hits, _, _), (_, hits, graphs, _) = said
    assert first_hits == "0" and int(graphs) > 0 and hits == graphs
