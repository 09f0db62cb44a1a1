"""A fault costs seconds: what a restart of the trainer does not do again.

* compiled once per run: torch.compile's caches are in the run folder (`compile-cache/`), so the restarted group's
  first compiled step loads its graphs from inductor's cache instead of compiling them (the rank's log says how many);
* resumed from memory: the ranks' snapshot of the latest state in the node's shared memory is what a restart loads (no
  step trained twice, the same final loss as without the fault), and nothing of the run is left in /dev/shm;
* no import after the fault: every group's ranks are forked by the run's standby, which imported what a rank needs
  once before the first group; a SIGKILL of the supervisor then leaves no rank, no standby and no memory folder (its
  sentinel); without its standby a restart spawns its ranks as ever.

The compiled graphs, the restart without a standby and rank 0's kill are in the slow tier (CI runs it), for the
default suite's time.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from rank_scripts.harness import Run, clean_env, start, survivors
from rank_support import TINY, merged, set_flags

from supervisor.console import Console
from supervisor.group.reaper import Reaper
from supervisor.group.standby import RUN_FROM, Standby
from supervisor.plan.spec import COMPILE_CACHE_DIR, Plan, RankSpec
from trainer.checkpoint.layout import MEMORY_DIR_ENV
from trainer.metrics import HISTORY_JSON
from trainer.standby import cuda_loaded


def supervise(tmp_path: Path, layer: dict, *flags: str, timeout: float = 180) -> subprocess.CompletedProcess:
    tmp_path.mkdir(exist_ok=True)
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


@pytest.mark.slow
def test_a_restart_loads_the_compiled_graphs_from_the_run_folder(tmp_path: Path, token_cache_dir: Path) -> None:
    """One compiled CPU rank (inductor's C++ kernels), a fault at step 3: the first group compiles every graph, the
    restarted group's first compiled step (step 3, from the node's memory) finds each of them in the run folder's
    cache."""
    layer = merged(TINY, {"system": {"compile": True}, "data": {"cache_dir": str(token_cache_dir)},
                          "training": {"max_steps": 5},
                          "checkpoint": {"dir": str(tmp_path / "ckpt"), "interval": 2, "async_save": False},
                          "debug": {"inject_fault": "exit", "inject_fault_step": 3, "inject_fault_restart": 0}})
    proc = supervise(tmp_path, layer, "--nproc", "1", "--max-restarts", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "logs").iterdir()
    cache = run_dir / COMPILE_CACHE_DIR / "inductor"
    said = re.findall(r"torch\.compile: the first forward and backward \(step (\d)\).*; (\d+) of (\d+) graphs from the "
                      r"cache in (\S+)", proc.stdout)
    assert [(step, folder) for step, _, _, folder in said] == [("0", str(cache)), ("3", str(cache))], proc.stdout
    (_, first_hits, _, _), (_, hits, graphs, _) = said
    assert first_hits == "0" and int(graphs) > 0 and hits == graphs


def is_standby(process: psutil.Process) -> bool:
    return any("trainer.standby" in arg for arg in process.cmdline())


def final_loss(output: str) -> str:
    (loss,) = re.findall(r"^supervisor: run finished in .*, final loss (\S+);", output, re.M)
    return loss


def steps_logged(run_dir: Path) -> list[int]:
    return [int(s) for s in re.findall(r"\[GPU 0\] Step \[(\d+)/", (run_dir / "cpu0.log").read_text())]


@pytest.mark.parametrize("killed", [1, pytest.param(0, marks=pytest.mark.slow)])
def test_a_restart_resumes_from_the_nodes_memory(tmp_path: Path, token_cache_dir: Path, killed: int) -> None:
    """Rank 1 (or rank 0) SIGKILLed at the start of step 5, the last checkpoint step 3's: the restarted group loads the
    state after five steps from this node's memory, trains no step twice, and ends on the loss of the same run
    without the fault (which, with no restart to come, takes no snapshots); the run leaves nothing in /dev/shm.
    training_history.json holds every step and step 3's checkpoint even where rank 0, which writes it, was killed
    before its group could save it (its journal)."""
    base = merged(TINY, {"data": {"cache_dir": str(token_cache_dir)}, "training": {"max_steps": 8},
                         "checkpoint": {"interval": 3, "memory_interval": 1,
                                        "async_save": False}})  # step 3's checkpoint complete before the fault
    clean = supervise(tmp_path / "clean", merged(base, {"checkpoint": {"dir": str(tmp_path / "clean" / "ckpt")}}),
                      "--nproc", "2")
    assert clean.returncode == 0, clean.stderr[-3000:]
    assert "memory snapshots in" not in clean.stdout  # no restart to come: nothing would read them
    (clean_run,) = (tmp_path / "clean" / "logs").iterdir()  # nor a standby: the ranks spawned, each importing
    assert re.search(r"group 0: CPU0 pid \d+, CPU1 pid \d+$", (clean_run / "supervisor.log").read_text(), re.M)
    fault = {"inject_fault": "sigkill", "inject_fault_step": 5, "inject_fault_rank": killed, "inject_fault_restart": 0}
    proc = supervise(tmp_path / "fault", merged(base, {"checkpoint": {"dir": str(tmp_path / "fault" / "ckpt")},
                                                       "debug": fault}), "--nproc", "2", "--max-restarts", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "fault" / "logs").iterdir()
    memory = f"/dev/shm/gpu-pretrain-{run_dir.name}-"
    assert ("failed: SIGKILL (137); the ranks resume from step 5 in this node's memory (from this run's latest "
            "checkpoint if that copy fails their checks)") in proc.stderr
    assert re.search(rf"resumed from the memory copy in {memory}\w+ at step 5 \(checked and loaded in [\d.]+ s; on "
                     rf"disk: \S+step_000003\)", proc.stdout), proc.stdout[-3000:]
    assert f"memory snapshots in {memory}" in proc.stdout
    assert steps_logged(run_dir) == list(range(8))
    assert final_loss(proc.stderr) == final_loss(clean.stderr)
    saved = json.loads((run_dir / HISTORY_JSON).read_text())
    assert [r["step"] for r in saved["steps"]] == list(range(8))
    assert [c["step"] for c in saved["checkpoints"]] == [3, 6, 8]
    assert not list(Path("/dev/shm").glob(f"gpu-pretrain-{run_dir.name}-*"))


def wait_until(condition: Callable[[], object], run: Run, what: str, timeout: float = 120) -> None:
    """Poll `condition` while the supervisor runs, never a fixed sleep."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline and run.proc.poll() is None, \
            f"never {what}: {run.err_path.read_text()[-2000:]}"
        time.sleep(0.05)


def start_with_standby(tmp_path: Path, token_cache_dir: Path, restarts: int) -> tuple[Run, psutil.Process, list[int]]:
    """A run of 2 CPU ranks that would train for ever, once its first group has trained a step past its first memory
    snapshot (a fault before it, on a loaded machine, would find no copy to resume from); its standby, and the first
    group's pids (CPU0's, CPU1's: a forked rank's /proc environment is the standby's, so supervisor.log names them)."""
    layer = merged(TINY, {"data": {"cache_dir": str(token_cache_dir)}, "training": {"max_steps": 100_000},
                          "checkpoint": {"dir": str(tmp_path / "ckpt"), "memory_interval": 1}})
    run = start(tmp_path, "--debug", "--no-footer", "--nproc", "2", "--max-restarts", str(restarts),
                *set_flags(layer), entry=None)
    snapshot = "memory snapshots in "
    wait_until(lambda: list(run.log_dir.glob("*/cpu0.log")) and "Step [" in
               (run.run_dir() / "cpu0.log").read_text().partition(snapshot)[2], run, "trained past a memory snapshot")
    log = (run.run_dir() / "supervisor.log").read_text()
    assert "the standby ready: " in log.split("group 0: ")[0]  # the first group waited for its imports
    (first,) = re.findall(r"group 0: CPU0 pid (\d+)(?: \(forked by the standby\))?, CPU1 pid (\d+)", log)
    ranks = [int(pid) for pid in first]
    (standby,) = [p for p in psutil.Process(run.proc.pid).children()
                  if is_standby(p) and p.pid not in ranks]  # (a forked rank's command line is the standby's too)
    return run, standby, ranks


def pipes_held(pid: int) -> set[str]:
    fds = Path(f"/proc/{pid}/fd")
    return {link for fd in fds.iterdir() if (link := os.readlink(fd)).startswith("pipe:")}


def wait_for_a_step_after_restart(run: Run, restarts: int) -> None:
    marker = f"----- restart 1 of {restarts} -----"
    wait_until(lambda: marker in (log := (run.run_dir() / "cpu0.log").read_text()) and "Step [" in log.split(marker)[1],
               run, "trained after the restart")


def test_a_restart_forked_by_the_standby_then_the_supervisor_killed(tmp_path: Path, token_cache_dir: Path) -> None:
    """The first group's ranks are forked by the standby once it has imported what a rank needs; rank 1 is SIGKILLed:
    the restarted group's ranks are forked by the standby too (no import, no exec after the fault: their command line
    is the standby's; the restart's line says so), each the supervisor's own child in a session of its own, and train
    on from the node's memory. Then SIGKILL to the supervisor: its sentinel kills every rank and the standby, and
    removes the memory folder."""
    run, standby, ranks = start_with_standby(tmp_path, token_cache_dir, restarts=2)
    assert "RANK" not in standby.environ()  # the ranks' common environment: no RANK of its own
    os.kill(ranks[1], signal.SIGKILL)
    run.wait_for_stderr("restart 1 of 2 after CPU1 (rank 1) failed: SIGKILL (137); the ranks resume from step ")
    wait_for_a_step_after_restart(run, restarts=2)
    assert re.search(r"the ranks resume from step \d+ .*; forked from the standby$", run.err_path.read_text(), re.M)
    first, restarted = re.findall(r"group [01]: CPU0 pid (\d+) \(forked by the standby\), CPU1 pid (\d+) \(forked by "
                                  r"the standby\)", (run.run_dir() / "supervisor.log").read_text())
    assert list(map(int, first)) == ranks
    for pid in map(int, restarted):
        rank = psutil.Process(pid)
        assert rank.ppid() == run.proc.pid and os.getsid(pid) == pid
        assert rank.cmdline() == standby.cmdline()  # forked, never exec'd: nothing imported after the fault
    # forked in one request, the two hold no pipe in common (else a rank's end of output would wait for the other's)
    assert not set.intersection(*(pipes_held(int(pid)) for pid in restarted))
    assert "resumed from the memory copy in " in (run.run_dir() / "cpu0.log").read_text()
    everything = [p.pid for p in psutil.Process(run.proc.pid).children(recursive=True)]
    folder = Path(standby.environ()[MEMORY_DIR_ENV])  # the ranks' common environment
    os.kill(run.proc.pid, signal.SIGKILL)
    run.proc.wait()
    assert survivors(everything) == []
    deadline = time.monotonic() + 10
    while folder.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not folder.exists()


@pytest.mark.slow
def test_a_restart_without_its_standby_spawns_its_ranks(tmp_path: Path, token_cache_dir: Path) -> None:
    """The standby SIGKILLed once the first group (which it forked) trains, then rank 1: the restart finds it gone, spawns its ranks as ever and trains
    on (then a SIGTERM ends the run as ever)."""
    run, standby, ranks = start_with_standby(tmp_path, token_cache_dir, restarts=1)
    standby.kill()
    os.kill(ranks[1], signal.SIGKILL)
    wait_for_a_step_after_restart(run, restarts=1)
    err = run.err_path.read_text()
    assert "restart 1 of 1 after CPU1 (rank 1) failed: SIGKILL (137)" in err and "forked" not in err
    assert re.search(r"group 1: CPU0 pid \d+, CPU1 pid \d+$", (run.run_dir() / "supervisor.log").read_text(), re.M)
    run.proc.send_signal(signal.SIGTERM)
    assert run.proc.wait(timeout=60) == 128 + signal.SIGTERM


def test_a_stop_signal_while_the_standby_imports_starts_no_rank_and_leaves_nothing(tmp_path: Path,
                                                                                 token_cache_dir: Path) -> None:
    """The first group waits for the standby's imports; a Ctrl-C meanwhile is the interruption before any rank, as
    during the dataset's preparation: exit 130, no rank started, the standby gone with the supervisor."""
    layer = merged(TINY, {"data": {"cache_dir": str(token_cache_dir)}, "checkpoint": {"dir": str(tmp_path / "ckpt")}})
    run = start(tmp_path, "--debug", "--no-footer", "--nproc", "2", "--max-restarts", "1", *set_flags(layer),
                entry=None)
    supervisor = psutil.Process(run.proc.pid)
    wait_until(lambda: any(is_standby(p) for p in supervisor.children()), run, "started its standby")
    (standby,) = [p for p in supervisor.children() if is_standby(p)]
    log = next(run.log_dir.glob("*/supervisor.log")).read_text()
    assert "the standby ready" not in log and "group 0" not in log  # still importing (seconds of CPU)
    run.proc.send_signal(signal.SIGINT)
    assert run.proc.wait(timeout=60) == 130
    assert "SIGINT: interrupted during dataset preparation; no rank was started" in run.err_path.read_text()
    assert "group 0" not in next(run.log_dir.glob("*/supervisor.log")).read_text()
    assert survivors([standby.pid]) == []


def test_the_standby_imports_what_a_spawned_rank_imports_not_the_working_folders(tmp_path: Path,
                                                                                token_cache_dir: Path) -> None:
    """Started from a folder holding a `transformers.py` and a `trainer/` package of the user's (which a spawned rank,
    `python pretrain_main.py`, never sees): the standby imports the project's and the installed ones, and forks both
    groups; a fault at step 2 is restarted from it."""
    (tmp_path / "transformers.py").write_text("raise SystemExit('the working folder shadowed transformers')\n")
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "__init__.py").write_text("raise SystemExit('the working folder shadowed trainer')\n")
    layer = merged(TINY, {"data": {"cache_dir": str(token_cache_dir)}, "training": {"max_steps": 4},
                          "checkpoint": {"dir": str(tmp_path / "ckpt")},
                          "debug": {"inject_fault": "exit", "inject_fault_step": 2, "inject_fault_restart": 0}})
    proc = supervise(tmp_path, layer, "--nproc", "2", "--max-restarts", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = next((tmp_path / "logs").glob("*/supervisor.log")).read_text()
    assert "shadowed" not in log and "cannot fork" not in log, log
    assert len(re.findall(r"group [01]: CPU0 pid \d+ \(forked by the standby\), CPU1 pid \d+ \(forked by the "
                          r"standby\)", log)) == 2, log


@pytest.mark.parametrize("safe_path", [False, True])
def test_the_standby_s_import_path_is_a_spawned_script_s(tmp_path: Path, safe_path: bool) -> None:
    """`python -c RUN_FROM FOLDER MODULE` (how the standby is started) sees the sys.path that `python FOLDER/script.py`
    sees, from a working folder of its own, with PYTHONPATH (where the module is found under PYTHONSAFEPATH: no script
    folder on the path at all)."""
    folder, work, extra = tmp_path / "project", tmp_path / "work", tmp_path / "extra"
    for d in (folder, work, extra):
        d.mkdir()
    (folder / "script.py").write_text("import json, sys\nprint(json.dumps(sys.path))\n")
    (extra / "path_probe.py").write_text("import json, sys\nprint(json.dumps(sys.path))\n")  # as trainer.standby
    env = {**clean_env(), "PYTHONPATH": str(extra)}
    if safe_path:
        env["PYTHONSAFEPATH"] = "1"
    else:
        env.pop("PYTHONSAFEPATH", None)

    def path_of(argv: list[str]) -> list[str]:
        done = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, check=True)
        return json.loads(done.stdout)

    spawned = path_of([sys.executable, str(folder / "script.py")])
    assert path_of([sys.executable, "-c", RUN_FROM, str(folder), "path_probe"]) == spawned
    assert (str(folder) in spawned) is not (safe_path and sys.version_info >= (3, 11))
    assert str(work) not in spawned and str(extra) in spawned


def test_a_standby_that_fails_to_import_says_why_and_the_ranks_are_spawned(tmp_path: Path) -> None:
    """A standby whose import fails (here: a `trainer.rank_cli` of the entry's folder that raises) is unfit with its
    last line of stderr in supervisor.log; nothing forks from it."""
    entry = tmp_path / "project"
    (entry / "trainer").mkdir(parents=True)
    project = Path(__file__).resolve().parent.parent
    for name in ("__init__.py", "standby.py", "progress.py"):
        (entry / "trainer" / name).write_text((project / "trainer" / name).read_text())
    (entry / "trainer" / "rank_cli.py").write_text("raise ImportError('a broken install')\n")
    plan = Plan(entry=str(entry / "pretrain_main.py"), entry_args=[], run_dir=tmp_path, ranks=[RankSpec(0, 0, None)])
    console, reaper = Console(terminal=False), Reaper()
    console.open_log(tmp_path / "supervisor.log")
    try:
        standby = Standby(plan, reaper, console)
        assert not standby.wait_ready()
        assert standby.fork([(plan.ranks[0], {}, [])]) is None
        standby.close()
    finally:
        reaper.close()
    assert "the standby cannot fork ranks (it exited (1) before it was ready: ImportError: a broken install): the " \
           "ranks are spawned" in (tmp_path / "supervisor.log").read_text()


def test_a_standby_not_ready_in_time_is_stopped_and_forks_nothing(tmp_path: Path) -> None:
    """Its imports take seconds; given a hundredth of one it is unfit (the ranks are then spawned), said so in
    supervisor.log, and stopped."""
    plan = Plan(entry="pretrain_main.py", entry_args=[], run_dir=tmp_path, ranks=[RankSpec(0, 0, None)])
    console, reaper = Console(terminal=False), Reaper()
    console.open_log(tmp_path / "supervisor.log")
    try:
        standby = Standby(plan, reaper, console)
        assert not standby.wait_ready(timeout=0.01)
        assert standby.process.wait(timeout=30) == -signal.SIGKILL
        assert standby.fork([(plan.ranks[0], {}, [])]) is None
        standby.close()
    finally:
        reaper.close()
    assert "the standby cannot fork ranks (not ready within 0 s): the ranks are spawned" in \
        (tmp_path / "supervisor.log").read_text()


def test_the_standby_knows_when_an_import_loaded_cuda(tmp_path: Path) -> None:
    """A fork after CUDA is initialised gives the rank a GPU it cannot use: the standby reads its own memory map for
    the driver library (what a CUDA call loads) and serves no fork where it is there."""
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert not cuda_loaded(maps)
    maps.write_text(maps.read_text() + "7f02-7f03 r-xp 0 08:01 2 /usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15\n")
    assert cuda_loaded(maps)
