"""Fault injection: the settings, the NaN hook, and every process fault in a real subprocess (exit codes, signals)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from rank_scripts.harness import project_pythonpath
from trainer.config import DebugConfig, check_injection
from trainer.diagnosis.faults import FaultInjector
from trainer.errors import UserError

ROOT = Path(__file__).resolve().parent.parent

# One "rank" that calls before_step like the loop does, printing each step it completes.
RANK_SCRIPT = """
import faulthandler, signal, sys
faulthandler.enable()
signal.signal(signal.SIGTERM, lambda *_: print("SIGTERM noted", flush=True))  # like the loop: finish the step first
from trainer.config import DebugConfig
from trainer.diagnosis.faults import FaultInjector
faults = FaultInjector(DebugConfig(inject_fault={kind!r}, inject_fault_step=2, inject_fault_rank=1,
                                   inject_fault_code=7), rank={rank})
for step in range(4):
    faults.before_step(step)
    print(f"step {{step}} done", flush=True)
"""


def start_rank(kind: str, rank: int = 1) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", RANK_SCRIPT.format(kind=kind, rank=rank)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": project_pythonpath()})


def kill_tree(proc: subprocess.Popen[str]) -> None:
    try:
        for p in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
            p.kill()
    except psutil.NoSuchProcess:
        pass
    proc.wait(timeout=10)


@pytest.fixture
def ranks() -> list[subprocess.Popen[str]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        kill_tree(proc)


def test_off_by_default_and_banner_when_on() -> None:
    assert FaultInjector(DebugConfig(), rank=0).describe() is None
    assert not FaultInjector(DebugConfig(), rank=0).enabled
    on = FaultInjector(DebugConfig(inject_nan_module="model.layers.1.mlp", inject_nan_step=3, inject_nan_rank=1,
                                   inject_fault="exit", inject_fault_step=5, inject_fault_code=9), rank=0)
    assert on.enabled
    assert on.describe() == ("fault injection ON: NaN in model.layers.1.mlp output at step 3 on rank 1; "
                             "exit (code 9) at step 5 on rank 0")


def test_a_write_stall_holds_its_step_on_its_rank_until_training_waits(capsys: pytest.CaptureFixture[str]) -> None:
    """debug.inject_write_stall_step: the writer thread of the checkpoint after that step, on inject_fault_rank, waits
    for the event training sets when it waits for the write; any other step or rank goes on at once."""
    debug = DebugConfig(inject_write_stall_step=3, inject_fault_rank=1)
    here, elsewhere = FaultInjector(debug, rank=1), FaultInjector(debug, rank=0)
    assert here.enabled and here.describe() == ("fault injection ON: the checkpoint write after step 3 stalls on rank 1 "
                                                "until training waits for it")
    awaited = threading.Event()
    elsewhere.stall_write(3, awaited)
    here.stall_write(2, awaited)
    assert capsys.readouterr().err == ""
    writer = threading.Thread(target=here.stall_write, args=(3, awaited))
    writer.start()
    writer.join(0.2)
    assert writer.is_alive()  # held: nothing has waited for the write yet
    awaited.set()
    writer.join(30)
    assert not writer.is_alive()
    assert capsys.readouterr().err == ("fault injection: the checkpoint write after step 3 stalls on rank 1 until "
                                       "training waits for it\n")
    with pytest.raises(UserError, match=r"debug.inject_write_stall_step 6 is never reached \(the run's steps are 0-5"):
        check_injection(DebugConfig(inject_write_stall_step=6), max_steps=6)


@pytest.mark.parametrize("settings, needs", [
    ({"inject_nan_step": 3}, "inject_nan_module"),
    ({"inject_nan_module": "lm_head"}, "inject_nan_step"),
    ({"inject_fault": "hang"}, "inject_fault_step"),
    ({"inject_fault_step": 2}, "inject_fault"),
])
def test_half_set_injection_is_a_user_error(settings: dict[str, object], needs: str) -> None:
    with pytest.raises(UserError, match=needs):
        FaultInjector(DebugConfig(**settings), rank=0)  # type: ignore[arg-type]


def tiny_net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


def test_unknown_module_names_the_closest_ones() -> None:
    model = torch.nn.ModuleDict({"layers": torch.nn.ModuleList([torch.nn.ModuleDict({"mlp": tiny_net()})])})
    faults = FaultInjector(DebugConfig(inject_nan_module="layers.0.mpl", inject_nan_step=1), rank=0)
    with pytest.raises(UserError, match="no module 'layers.0.mpl'; did you mean 'layers.0.mlp'"):
        faults.attach(model)
    faults = FaultInjector(DebugConfig(inject_nan_module="decoder", inject_nan_step=1), rank=0)
    with pytest.raises(UserError, match="no module 'decoder'; names look like layers, layers.0, "):
        faults.attach(model)


def test_nan_only_at_its_step_on_its_rank_in_training() -> None:
    net = tiny_net()
    x = torch.randn(3, 4)
    debug = DebugConfig(inject_nan_module="0", inject_nan_step=2, inject_nan_rank=1)
    here, elsewhere = FaultInjector(debug, rank=1), FaultInjector(debug, rank=0)
    here.attach(net)
    elsewhere.attach(net)  # a second hook that never fires: the rank filter
    for step in range(4):
        here.before_step(step)
        elsewhere.before_step(step)
        out = net(x)
        assert out.isnan().all().item() == (step == 2), step
    here.before_step(2)
    elsewhere.before_step(2)
    out = net(x)
    out.sum().backward()  # the NaN flows back into the gradients, as a real one would
    assert net[0].weight.grad.isnan().all()
    net.eval()
    assert torch.isfinite(net(x)).all()  # evaluation passes stay clean


@pytest.mark.parametrize("kind, code, message", [
    ("raise", 1, "RuntimeError: injected fault at step 2 on rank 1"),
    ("exit", 7, ""),
    ("sigkill", -signal.SIGKILL, ""),
    ("segv", -signal.SIGSEGV, "Fatal Python error: Segmentation fault"),
])
def test_process_fault_fires_at_its_step(ranks: list[subprocess.Popen[str]], kind: str, code: int,
                                         message: str) -> None:
    ranks.append(start_rank(kind))
    out, err = ranks[0].communicate(timeout=60)
    assert ranks[0].returncode == code, err
    assert "step 1 done" in out and "step 2 done" not in out
    assert f"fault injection: {kind} at step 2 on rank 1" in err
    assert message in err


def test_other_ranks_run_through(ranks: list[subprocess.Popen[str]]) -> None:
    ranks.append(start_rank("sigkill", rank=0))
    out, err = ranks[0].communicate(timeout=60)
    assert ranks[0].returncode == 0, err
    assert "step 3 done" in out


def test_hang_makes_no_progress_and_ignores_a_polite_stop(ranks: list[subprocess.Popen[str]]) -> None:
    proc = start_rank("hang")
    ranks.append(proc)
    assert proc.stderr is not None and proc.stdout is not None
    lines = iter(proc.stderr.readline, "")  # ends at EOF, should the process die instead of hanging
    assert any("fault injection: hang at step 2 on rank 1" in line for line in lines)
    os.kill(proc.pid, signal.SIGTERM)
    time.sleep(1.0)
    assert proc.poll() is None  # still hanging: only a kill ends it, which is the supervisor's job
    kill_tree(proc)
    out = proc.stdout.read()
    assert "step 1 done" in out and "step 2 done" not in out and "SIGTERM noted" in out


def test_checkpoint_fault_fires_only_inside_the_checkpoint_after_its_step() -> None:
    debug = DebugConfig(inject_fault="raise", inject_fault_step=2, inject_fault_rank=1,
                        inject_fault_during="checkpoint")
    here, elsewhere = FaultInjector(debug, rank=1), FaultInjector(debug, rank=0)
    assert here.describe() == "fault injection ON: raise during the checkpoint after step 2 on rank 1"
    for step in range(4):
        here.before_step(step)  # the step itself never fires in this mode
        elsewhere.during_checkpoint(step)
    here.during_checkpoint(1)
    with pytest.raises(RuntimeError, match="injected fault during the checkpoint after step 2 on rank 1"):
        here.during_checkpoint(2)


def test_gpu_lost_marks_the_gpu_lost_and_dies_with_cudas_error(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    state = tmp_path / "gpu_state.json"
    state.write_text('{"0": {"ecc_uncorrectable": 1}}')
    monkeypatch.setenv("SUPERVISOR_FAKE_GPU_STATE", str(state))
    monkeypatch.setenv("GPU_RANK", "2")
    debug = DebugConfig(inject_fault="gpu_lost", inject_fault_step=1, inject_fault_rank=1, inject_fault_restart=0)
    faults = FaultInjector(debug, rank=1)
    assert faults.describe() == "fault injection ON: gpu_lost at step 1 on rank 1 (first group only)"
    faults.before_step(0)
    with pytest.raises(RuntimeError, match=r"^CUDA error: uncorrectable ECC error encountered \(injected at step 1"):
        faults.before_step(1)
    assert json.loads(state.read_text()) == {"0": {"ecc_uncorrectable": 1}, "2": {"lost": True}}
    monkeypatch.setenv("SUPERVISOR_RESTART_COUNT", "1")  # the group after the restart: the fault was the first's
    later = FaultInjector(debug, rank=1)
    assert later.describe() is None
    later.before_step(1)


# A one-process run that saves a checkpoint after every step, with a fault set to fire inside the save after step 1.
SAVE_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from pathlib import Path
from test_checkpoint import make_cfg, make_meta, make_state, train_once
from trainer.checkpoint import layout, store
from trainer.config import DebugConfig
from trainer.diagnosis.faults import FaultInjector
from trainer.model.distributed import init_distributed
cfg = make_cfg(Path({folder!r}))
ctx = init_distributed(cfg)
state = make_state(cfg)
faults = FaultInjector(DebugConfig(inject_fault="sigkill", inject_fault_step=1, inject_fault_during="checkpoint"),
                       rank=0)
root = Path(cfg.checkpoint.dir)
for step in range(3):
    faults.before_step(step)
    train_once(state, step)
    store.save(layout.step_path(root, step + 1), state, make_meta(state, step + 1), ctx,
               fault=lambda phase: faults.during_checkpoint(step, phase))
    print(f"saved step_{{step + 1}}", flush=True)
"""


def test_fault_inside_a_checkpoint_leaves_it_unpublished(ranks: list[subprocess.Popen[str]], tmp_path: Path) -> None:
    from trainer.checkpoint import layout, store

    proc = subprocess.Popen([sys.executable, "-c", SAVE_SCRIPT.format(tests=str(ROOT / "tests"), folder=str(tmp_path))],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": project_pythonpath(), "OMP_NUM_THREADS": "1"})
    ranks.append(proc)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, err
    assert "fault injection: sigkill during the checkpoint after step 1 on rank 0" in err
    assert "saved step_1" in out and "saved step_2" not in out
    root = tmp_path / "ckpt"
    partial = root / ".tmp-step_000002"
    assert (partial / store.STATE_FILE).is_file() and not (partial / layout.META_FILE).exists()
    assert not (root / "step_000002").exists()
    assert layout.latest_checkpoint(root) == root / "step_000001"
    state = torch.load(root / "step_000001" / store.STATE_FILE, map_location="cpu", weights_only=True)
    assert state["meta"]["step"] == 1 and "model" in state
