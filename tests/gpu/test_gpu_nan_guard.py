"""The NaN guard on a real GPU: production mode adds no host synchronisation to a training step (the CUDA driver's
own check, `torch.cuda.set_sync_debug_mode("error")`, around real `Trainer` iterations, eager and with compiled
layers as shipped), and debug mode names the
first non-finite module on the GPU, through the supervisor.

The same file is the in-process worker: ``python tests/gpu/test_gpu_nan_guard.py <config.json>`` builds the
`Trainer` of that config on cuda:0 and runs its steps, the non-log ones under the sync check.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the worker runs as a script

import pytest  # noqa: E402

pytestmark = pytest.mark.gpu

STEPS, LOG_INTERVAL = 8, 1000  # step 0 and the last step log; steps 1-6 are the ones a production run repeats
NAN_MODULE, NAN_STEP = "model.layers.0.mlp", 2


def sync_free_steps(config_path: str) -> None:
    """The worker: every non-log iteration runs with CUDA's sync check raising on any device→host synchronisation."""
    import torch

    from trainer.config import Config
    from trainer.loop import Trainer
    from trainer.metrics import EtaClock, Throughput
    from trainer.model.distributed import StopRequest, StopVote, init_distributed, teardown
    from trainer.progress import ProgressReporter
    from trainer.run_dir import agree_run_dir

    torch.cuda.set_sync_debug_mode("error")  # the check can fail: a deliberate read must raise
    try:
        torch.ones(1, device="cuda").item()
        raise AssertionError("set_sync_debug_mode('error') did not catch .item()")
    except RuntimeError:
        pass
    finally:
        torch.cuda.set_sync_debug_mode("default")
    cfg = Config.load(config_path)
    ctx = init_distributed(cfg)
    try:
        trainer = Trainer(cfg, ctx, agree_run_dir(cfg, ctx, None), ProgressReporter(), StopRequest())
        assert trainer.device.type == "cuda" and trainer.precision.name == "bf16"
        assert trainer.compiled == (cfg.system.compile is True)
        now = 0.0
        eta, throughput, vote = EtaClock(0, STEPS, now), Throughput(trainer.tokens_per_step, 0, now), StopVote(ctx)
        checked = []
        for step in range(STEPS):
            log_step = step % LOG_INTERVAL == 0 or step == STEPS - 1
            torch.cuda.set_sync_debug_mode("default" if log_step else "error")
            try:
                trainer.iteration(step, vote, eta, throughput)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            if not log_step:
                checked.append(step)
        torch.cuda.synchronize()
        print(json.dumps({"checked": checked, "skipped": trainer.guard.skipped_steps}), flush=True)
    finally:
        teardown()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_production_guard_adds_no_host_sync(compiled: bool, machine, tmp_path: Path, token_cache_dir: Path) -> None:
    from gpu_support import gpu_layer
    from trainer.config import Config

    layer = gpu_layer(tmp_path, token_cache_dir, system={"device": "cuda", "compile": compiled},
                      training={"max_steps": STEPS, "precision": "bf16"},
                      logging={"log_interval": LOG_INTERVAL, "run_dir": str(tmp_path / "run")})
    cfg = Config.from_dict(layer)
    cfg.preset = "debug"
    cfg.save(tmp_path / "config.json")
    done = subprocess.run([sys.executable, __file__, str(tmp_path / "config.json")], cwd=tmp_path, env=machine.env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"checked": list(range(1, STEPS - 1)), "skipped": 0}


def test_debug_mode_names_the_first_nonfinite_module_on_the_gpu(machine, tmp_path: Path,
                                                                token_cache_dir: Path) -> None:
    from gpu_support import gpu_layer, supervise

    layer = gpu_layer(tmp_path, token_cache_dir, training={"max_steps": 4},
                      debug={"nan_localize": True, "nan_dump": True, "inject_nan_step": NAN_STEP,
                             "inject_nan_module": NAN_MODULE, "inject_nan_rank": 0})
    run = supervise(machine, tmp_path, layer)
    out, label, gpu = run.output, machine.label, machine.id
    assert run.code == 0, out[-4000:]
    assert f"{label}:NaN GRADIENT DETECTED [GPU {gpu}]" in out and f"{label}:Step: {NAN_STEP}" in out
    assert f"{label}:First non-finite forward output: {NAN_MODULE} (LlamaMLP)" in out, out[-4000:]
    with open(tmp_path / "ckpt" / "debug" / f"nan_debug_step_{NAN_STEP}.pkl", "rb") as f:
        dump = pickle.load(f)
    assert dump["gpu_id"] == str(gpu) and dump["first_nonfinite_module"]["name"] == NAN_MODULE
    assert (tmp_path / "ckpt" / f"nan_grad_step_{NAN_STEP}.pt").is_file()


if __name__ == "__main__":
    sync_free_steps(sys.argv[1])
