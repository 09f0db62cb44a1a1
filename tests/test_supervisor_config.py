"""The supervisor's command line: config resolution, the run folder, user errors (exit 2, nothing started)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from rank_scripts.harness import WORKER, clean_env, run
from supervisor.plan.spec import Plan, RankSpec
from trainer.config import Config, apply_layer
from trainer.config.resolve import preset_layer
from trainer.data import TOKEN_CACHE_ENV
from trainer.errors import UserError
from trainer.model.estimate import GiB
from trainer.preflight import check_run


@pytest.mark.parametrize("args, message", [
    (("--set", "training.max_steps=-1"), "error: training.max_steps must be positive, got -1"),
    (("--set", "training.max_stepz=3"), "error: command line: unknown key 'max_stepz' in section 'training'"),
    (("--entry", "missing.py"), "error: --entry missing.py: no such file"),
    (("--nnodes", "2"), "error: --nnodes > 1 needs --master-addr and --master-port"),
    (("--nnodes", "2", "--master-addr", "h", "--master-port", "1234", "--max-restarts", "1"),
     "error: --max-restarts works on a single node only"),
    (("--nproc", "0"), "error: --nproc must be within 1-1,024 (ranks on this node), got 0"),
])
def test_user_errors_are_one_line_and_exit_2(tmp_path, args, message):
    r = run(tmp_path, *args, entry=WORKER if "--entry" not in args else None)
    assert r.returncode == 2
    assert r.stderr.startswith(message) and r.stderr.count("\n") == 1, r.stderr
    assert not r.log_dir.exists()


def test_a_control_secret_that_cannot_be_used_is_one_line_and_exit_2(tmp_path):
    """Several nodes need no secret (they then trust what torchrun trusts), but one that is set must be usable."""
    missing = tmp_path / "missing"
    r = run(tmp_path, "--nnodes", "2", "--master-addr", "h", "--master-port", "1234", entry=WORKER,
            env=clean_env(SUPERVISOR_CONTROL_SECRET_FILE=str(missing)))
    assert r.returncode == 2 and not r.log_dir.exists()
    assert r.stderr == (f"error: SUPERVISOR_CONTROL_SECRET_FILE={missing}: cannot read it (No such file or directory); "
                        f"name a readable file that holds the control secret, the same on every node\n"), r.stderr


def test_config_is_resolved_once_and_written_to_the_run_folder(tmp_path):
    r = run(tmp_path, "--debug", "--max-steps", "7", "--set", "training.batch_size=3", "--nproc", "2",
            entry_args=("--steps", "1"))
    assert r.returncode == 0, r.stderr
    run_dir = r.run_dir()
    assert run_dir.name.endswith("-debug") and run_dir.parent == r.log_dir
    cfg = Config.load(run_dir / "config.json")
    assert (cfg.preset, cfg.training.max_steps, cfg.training.batch_size) == ("debug", 7, 3)
    assert cfg.logging.run_dir == str(run_dir)
    assert cfg.system.device == "cpu"
    assert "run " + run_dir.name in (run_dir / "supervisor.log").read_text()


def test_inspection_flags_start_nothing(tmp_path):
    r = run(tmp_path, "--debug", "--print-config")
    assert r.returncode == 0
    assert json.loads(r.stdout)["preset"] == "debug"
    assert not r.log_dir.exists()


def test_trainer_entry_gets_the_run_config(tmp_path):
    plan = Plan(entry="/x/pretrain_main.py", entry_args=["--extra"], run_dir=tmp_path,
                ranks=[RankSpec(0, 0, None)])
    assert plan.argv(tmp_path / "config.json")[1:] == ["/x/pretrain_main.py", "--run-config",
                                                       str(tmp_path / "config.json"), "--extra"]
    other = Plan(entry="/x/train.py", entry_args=["--extra"], run_dir=tmp_path, ranks=[RankSpec(0, 0, None)])
    assert other.argv(tmp_path / "config.json")[1:] == ["/x/train.py", "--extra"]

    assert TOKEN_CACHE_ENV not in plan.rank_env(plan.ranks[0], 29500, None, 0)
    found = Plan(entry="/x/pretrain_main.py", entry_args=[], run_dir=tmp_path, ranks=[RankSpec(0, 0, None)],
                 token_cache=tmp_path / "cache" / "key")  # the supervisor found it: the ranks open it as it is
    assert found.rank_env(found.ranks[0], 29500, None, 0)[TOKEN_CACHE_ENV] == str(tmp_path / "cache" / "key")


def preset(name: str, **overrides: dict) -> Config:
    cfg = Config()
    apply_layer(cfg, preset_layer(name), name)
    apply_layer(cfg, overrides, "test")
    return cfg


def host_with(monkeypatch: pytest.MonkeyPatch, gib: float) -> None:
    """This machine as one with `gib` of host memory available and no swap: what CPU ranks are sized against."""
    memory = SimpleNamespace(available=int(gib * GiB), total=int(gib * GiB))
    monkeypatch.setattr(psutil, "virtual_memory", lambda: memory)
    monkeypatch.setattr(psutil, "swap_memory", lambda: SimpleNamespace(free=0))


def test_gpu_presets_refuse_a_cpu_unless_forced(tmp_path, monkeypatch):
    """The trainer's check of a run (`trainer.preflight.check_run`) on CPU ranks; on GPUs none of this applies."""
    monkeypatch.chdir(tmp_path)  # the checkpoint folder it checks
    host_with(monkeypatch, 1024)  # room for any of them: here only the kind of run matters

    def on_cpus(cfg: Config) -> None:
        check_run(cfg, 1, 1, on_gpus=False, notes=[])

    with pytest.raises(UserError, match=r"preset 'production' \([\d.]+B parameters, fsdp, bf16\) needs GPUs.*--debug"):
        on_cpus(preset("production"))
    on_cpus(preset("production", system={"device": "cpu"}))
    on_cpus(preset("debug"))
    on_cpus(preset("small"))
    check_run(preset("production"), 8, 8, on_gpus=True, notes=[])
    with pytest.raises(UserError, match="system.device=cuda but no GPU"):
        on_cpus(preset("debug", system={"device": "cuda"}))


@pytest.mark.parametrize("gib, advice", [
    (1024, "use --debug or --preset small on this CPU, or force it with --set system.device=cpu"),
    (64, "use --debug or --preset small on this CPU; forced onto CPU ranks (--set system.device=cpu) it would need "
         "about 127.6 GiB of host memory, 64.0 GiB available"),
    (16, "use --debug on this CPU; forced onto CPU ranks (--set system.device=cpu) it would need about 127.6 GiB of "
         "host memory, 16.0 GiB available"),
])
def test_a_gpu_preset_on_a_cpu_points_only_at_what_fits_the_host(tmp_path, monkeypatch, gib, advice):
    """Two CPU ranks of `small` take about 41 GiB in fp32 with the full loss: recommended only where they fit."""
    monkeypatch.chdir(tmp_path)
    host_with(monkeypatch, gib)
    with pytest.raises(UserError) as refused:
        check_run(preset("production"), 2, 2, on_gpus=False, notes=[])
    why = "preset 'production' (7.2B parameters, fsdp, bf16) needs GPUs and none was found"
    assert str(refused.value) == f"{why}; {advice}"


def test_cpu_ranks_clearly_beyond_the_host_memory_are_refused(tmp_path, monkeypatch):
    """By a margin: the estimate is approximate, so a run somewhat above what is available still starts."""
    monkeypatch.chdir(tmp_path)
    host_with(monkeypatch, 30)
    check_run(preset("small"), 2, 2, on_gpus=False, notes=[])  # 41.4 GiB: over 30, within the margin
    host_with(monkeypatch, 16)
    with pytest.raises(UserError) as refused:
        check_run(preset("small"), 2, 2, on_gpus=False, notes=[])
    assert str(refused.value).startswith("2 CPU ranks would need about 41.4 GiB of host memory (20.7 GiB each) by the "
                                         "estimate, more than 1.5 times the 16.0 GiB this machine has available")
    assert str(refused.value).endswith("(--set system.host_memory_check=false starts them anyway)")
    check_run(preset("small"), 2, 2, on_gpus=True, notes=[])  # on GPUs the host is not what holds it
    unchecked = preset("small")
    unchecked.system.host_memory_check = False
    check_run(unchecked, 2, 2, on_gpus=False, notes=[])  # the user's word over the estimate


def test_production_on_a_cpu_machine_is_refused_before_anything_starts(tmp_path):
    if not (Path(__file__).parents[1] / "pretrain_main.py").exists():
        pytest.skip("pretrain_main.py is not there")
    r = run(tmp_path, entry=None)
    assert r.returncode == 2
    assert r.stderr.startswith("error: preset 'production'") and "--debug" in r.stderr
