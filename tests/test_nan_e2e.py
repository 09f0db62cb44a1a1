"""End to end: the supervisor runs pretrain_main.py on 2 CPU ranks with a NaN injected into model.layers.1.mlp on
rank 1. Debug mode names that rank and that layer, dumps loadable files and trains on; a production run resumed from
the NaN checkpoint skips a NaN step and, with debug.max_nonfinite_steps=1, stops on both ranks with exit code 1.

In the slow tier: the default suite runs the debug half as the README's NaN rehearsal (tests/test_readme.py checks the
lines it prints) and the two ranks' production stop in tests/test_nan_guard.py."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rank_support import TINY, base_env, kill_on_exit, merged, set_flags

pytestmark = pytest.mark.slow

NAN_MODULE = "model.layers.1.mlp"


def supervise(tmp_path: Path, cache_dir: Path, debug: dict[str, object], *extra: str) -> subprocess.CompletedProcess:
    """`python -m supervisor --nproc 2 --debug` on the tiny run (two layers), output merged as the user sees it."""
    layer = merged(TINY, {"model": {"num_layers": 2}, "data": {"cache_dir": str(cache_dir)},
                          "checkpoint": {"dir": str(tmp_path / "ckpt")}, "debug": debug})
    cmd = [sys.executable, "-m", "supervisor", "--nproc", "2", "--debug", "--no-footer", "--log-dir",
           str(tmp_path / "logs"), "--hang-timeout", "60", *set_flags(layer), *extra]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    with kill_on_exit(proc):
        out, _ = proc.communicate(timeout=150)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, None)


def test_nan_on_rank_1_debug_then_production_stop(tmp_path: Path, token_cache_dir: Path) -> None:
    inject = {"inject_nan_module": NAN_MODULE, "inject_nan_rank": 1}
    run = supervise(tmp_path, token_cache_dir, {"nan_localize": True, "nan_dump": True, "inject_nan_step": 3,
                                                **inject})
    out = run.stdout
    assert run.returncode == 0, out
    assert f"fault injection ON: NaN in {NAN_MODULE} output at step 3 on rank 1" in out
    assert "CPU1:NaN GRADIENT DETECTED [GPU 1]" in out and "CPU0:NaN GRADIENT" not in out
    assert "CPU1:Step: 3" in out and "CPU1:Loss: nan" in out
    assert f"CPU1:First non-finite forward output: {NAN_MODULE} (LlamaMLP)" in out
    for label in ("CPU0", "CPU1"):  # both ranks took the same decision and trained on
        assert f"{label}:WARNING | non-finite step 3 skipped (GPU 1 local loss non-finite); 1 skipped so far" in out
        assert f"{label}:INFO | [GPU {label[-1]}] Step [5/6]" in out
    assert "CPU1:Checkpoint saved: ckpt/nan_grad_step_3.pt" in out
    assert "CPU1:Debug tensors saved: ckpt/debug/nan_debug_step_3.pkl" in out

    with open(tmp_path / "ckpt" / "debug" / "nan_debug_step_3.pkl", "rb") as f:  # the user's snippet
        debug_data = pickle.load(f)
    nan = {name: np.isnan(grad).sum() / grad.size * 100 for name, grad in debug_data["gradients"].items()
           if np.isnan(grad).any()}
    assert nan[f"{NAN_MODULE}.down_proj.weight"] == 100.0
    assert debug_data["first_nonfinite_module"]["name"] == NAN_MODULE
    assert debug_data["gpu_id"] == "1" and debug_data["step"] == 3 and debug_data["batch"].ndim == 2

    # production mode, resumed from the NaN checkpoint: one NaN step is one too many
    run = supervise(tmp_path, token_cache_dir, {"nan_localize": False, "nan_dump": False, "inject_nan_step": 5,
                                                "max_nonfinite_steps": 1, **inject},
                    "--resume", "ckpt/nan_grad_step_3.pt")
    out = run.stdout
    assert run.returncode == 1, out
    assert "resumed from ckpt/nan_grad_step_3.pt at step 4" in out, out
    assert "CPU1:INFO | [GPU 1] Step [4/6]" in out
    for label in ("CPU0", "CPU1"):  # both stop on their own at the same log step: nobody waits in a collective
        assert (f"{label}:ERROR | training stopped: 1 consecutive non-finite steps (steps 5-5) reached "
                f"debug.max_nonfinite_steps=1; last: GPU 1 local loss non-finite") in out
    assert "CPU1:NaN GRADIENT DETECTED [GPU 1]" in out and "CPU0:NaN GRADIENT" not in out
    assert (tmp_path / "ckpt" / "nan_grad_step_5.pt").is_file()
    assert (tmp_path / "ckpt" / "debug" / "nan_debug_step_5.pkl").is_file()
