"""The supervisor instead of torchrun: torchrun's own command lines, on programs written for torchrun
(tests/torchrun_programs/), give what real torchrun gives them (losses, environment), plus the supervisor's
report, restarts, GPU view and prefixed output. Real torchrun runs beside it where results are compared."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from rank_scripts.harness import Run, clean_env, start, survivors
from supervisor.diagnosis import error_file

PROGRAMS = Path(__file__).resolve().parent / "torchrun_programs"
TORCHRUN = Path(sys.executable).parent / "torchrun"
# what differs by design between torchrun and the supervisor, and why (docs/torchrun.md)
NOT_COMPARED = {
    "MASTER_PORT": "a free port, chosen anew by each launcher",
    "TORCHELASTIC_RUN_ID": "a fresh id per run of --standalone (checked: one, or none as torch 2.11 gives)",
    "TORCHELASTIC_ERROR_FILE": "a path: torchrun's temporary folder, the run folder here (checked)",
    "TORCHELASTIC_USE_AGENT_STORE": "torchrun's agent hosts the store; here rank 0 does, as without an agent",
}


def supervise(tmp: Path, *argv: str, env: dict[str, str] | None = None, timeout: float = 120) -> Run:
    """``python -m supervisor --log-dir <tmp>/logs ARGV``, waited for."""
    return start(tmp, *argv, entry=None, env=env).wait(timeout)


def torchrun(tmp: Path, *argv: str, cwd: Path | None = None,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Real torchrun with the same arguments (its exit code is not compared: on gloo its ranks sometimes abort at
    exit, after writing what the tests read)."""
    if not TORCHRUN.exists():
        pytest.skip(f"no torchrun beside {sys.executable}")
    return subprocess.run([str(TORCHRUN), *argv], cwd=cwd or tmp, env=env or clean_env(), capture_output=True,
                          text=True, timeout=120)


def wait_for(path: Path, pattern: str, run: Run, timeout: float = 60) -> str:
    """The first line of `path` matching `pattern`, once the supervisor has written it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and run.proc.poll() is None:
        for line in path.read_text(errors="replace").splitlines():
            if re.search(pattern, line):
                return line
        time.sleep(0.05)
    raise AssertionError(f"no line matching {pattern!r} while the run was going: {path.read_text()[-2000:]}")


def records(folder: Path, count: int, name: str = "rank{}.json") -> list[dict]:
    return [json.loads((folder / name.format(rank)).read_text()) for rank in range(count)]


def test_a_tutorial_program_trains_as_under_torchrun(tmp_path):
    """``--nproc-per-node 2 ddp_tutorial.py 2 32 --out DIR``: the same losses and torchrun's environment; the tqdm
    bar reaches the console, prefixed, while the program holds it; the run folder is the program's, without a
    config.json, and its log keeps the bar readable."""
    ours, theirs, go = tmp_path / "ours", tmp_path / "theirs", tmp_path / "go"
    ours.mkdir(), theirs.mkdir()
    program = str(PROGRAMS / "ddp_tutorial.py")
    run = start(tmp_path, "--nproc-per-node", "2", program, "2", "32", "--out", str(ours), "--bar-wait", str(go),
                entry=None)
    held = wait_for(run.err_path, r"^CPU0:epoch 0: .*\| 2/4 ", run)  # rank 0 waits for `go` at this state
    go.touch()
    run.wait(120)
    assert run.returncode == 0, run.stderr[-3000:]
    torchrun(tmp_path, "--nproc-per-node", "2", program, "2", "32", "--out", str(theirs))
    for mine, real in zip(records(ours, 2), records(theirs, 2)):
        assert mine["losses"] == real["losses"] and len(mine["losses"]) == 8
        assert {k: v for k, v in mine["env"].items() if k not in NOT_COMPARED} == \
            {k: v for k, v in real["env"].items() if k not in NOT_COMPARED}
        if real["env"]["TORCHELASTIC_RUN_ID"] == "none":  # torch 2.11's torchrun and before: a static rendezvous
            assert mine["env"]["TORCHELASTIC_RUN_ID"] == "none"
        else:
            uuid.UUID(mine["env"]["TORCHELASTIC_RUN_ID"])
    run_dir = run.run_dir()
    assert run_dir.name.endswith("-ddp_tutorial") and not (run_dir / "config.json").exists()
    assert records(ours, 2)[1]["env"]["TORCHELASTIC_ERROR_FILE"] == str(run_dir / "errors" / "cpu1.json")
    log = (run_dir / "cpu0.log").read_text()
    bar_lines = [line for line in log.splitlines() if line.startswith("epoch 0:")]
    assert held.removeprefix("CPU0:") in bar_lines and bar_lines[-1].startswith("epoch 0: 100%|")
    assert len(bar_lines) < 6 and "\r" not in log  # of the epoch's 5 states: the held one and the last


@pytest.mark.parametrize("launch, cwd", [
    # in the slow tier: the default suite compares the tutorial program with torchrun, and runs the README's nano_train
    pytest.param(("--standalone", "--nproc_per_node=2", str(PROGRAMS / "nano_train.py")), None,
                 id="standalone-script", marks=pytest.mark.slow),
    pytest.param(("--rdzv-backend=c10d", "--rdzv-endpoint=localhost:{port}", "--nnodes=1", "--nproc-per-node", "2",
                  "-m", "nano_train"), PROGRAMS, id="c10d-module", marks=pytest.mark.slow),
])
def test_a_nanogpt_style_script_gets_torchruns_results(tmp_path, launch, cwd):
    from supervisor.plan.rendezvous import PortReservation

    reservation = PortReservation.take()
    port = reservation.port
    reservation.release()
    launch = tuple(arg.format(port=port) for arg in launch)
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    run = start(tmp_path, *launch, "--max_iters=6", f"--out_dir={ours}", entry=None,
                env=clean_env(PYTHONPATH=f"{cwd}:{clean_env()['PYTHONPATH']}") if cwd else None).wait(120)
    assert run.returncode == 0, run.stderr[-3000:]
    torchrun(tmp_path, *launch, "--max_iters=6", f"--out_dir={theirs}", cwd=cwd)
    mine, real = records(ours, 2, "losses{}.json"), records(theirs, 2, "losses{}.json")
    assert [r["losses"] for r in mine] == [r["losses"] for r in real]
    assert [(r["device"], r["world"]) for r in mine] == [("cpu", 2)] * 2
    assert re.findall(r"CPU0:iter \d: loss [\d.]+", run.stdout) == [f"CPU0:iter {i}: loss {loss:.4f}"
                                                                   for i, loss in enumerate(mine[0]["losses"])]
    if "-m" in launch:
        assert mine[0]["run_id"] == real[0]["run_id"] == "none"
        assert run.run_dir().name.endswith("-nano_train")


@pytest.mark.slow
def test_a_hugging_face_trainer_script_trains_as_under_torchrun(tmp_path):
    """transformers' Trainer, the loop many of the torchrun scripts people run are built on, finds its world in the
    supervisor's environment as in torchrun's (through accelerate): the same world, the same losses, its logs and its
    tqdm bar on the console prefixed by rank. In the slow tier: each launch imports all of Trainer on two ranks."""
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    program = str(PROGRAMS / "hf_trainer.py")
    run = supervise(tmp_path, "--nproc-per-node", "2", program, "--out", str(ours), timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    torchrun(tmp_path, "--nproc-per-node", "2", program, "--out", str(theirs))
    mine, real = records(ours, 2), records(theirs, 2)
    assert [(r["process_index"], r["world_size"]) for r in mine] == [(0, 2), (1, 2)]
    assert [r["losses"] for r in mine] == [r["losses"] for r in real] and len(mine[0]["losses"]) == 4
    assert len(re.findall(r"^CPU0:\{'loss': '[\d.]+', 'grad_norm'", run.stdout, re.M)) == 4, run.stdout[-3000:]
    assert re.search(r"^CPU0:100%\|.*\| 4/4 ", run.stderr, re.M), run.stderr[-3000:]


def test_an_abort_in_the_interpreter_exit_is_named_with_its_fix(tmp_path):
    """A rank aborted by libstdc++ as its process ends (gloo's group torn down in the exit) fails the run as under
    torchrun, and the headline says what the abort was and how to end the program cleanly."""
    run = supervise(tmp_path, "--nproc-per-node", "2", str(PROGRAMS / "teardown_abort.py"))
    assert run.returncode == 134, run.stderr[-3000:]
    assert re.search(r"run failed after [\d.]+ s: CPU1 \(rank 1\) failed: SIGABRT \(134\), C\+\+ threads still running "
                     r"as the process ended \(\"terminate called without an active exception\"\): most often a gloo "
                     r"process group torn down in the interpreter's exit \(a PyTorch race\); end the program with "
                     r"os\._exit\(0\) once its output is flushed$", run.stderr, re.M), run.stderr[-3000:]


def test_the_root_cause_of_a_recorded_exception_is_in_the_report(tmp_path):
    run = supervise(tmp_path, "--nproc-per-node", "2", str(PROGRAMS / "raises.py"))
    assert run.returncode == 1, run.stderr[-3000:]
    errors = run.run_dir() / "errors" / "cpu1.json"
    assert re.search(rf"root cause \(from {re.escape(str(errors))}\) at \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d: "
                     r"ValueError: corrupt batch at step 3 on rank 1", run.stderr)
    assert "  | Traceback (most recent call last):" in run.stderr
    assert re.search(r"  \|   File .*raises\.py\", line \d+, in load_batch", run.stderr)


@pytest.mark.parametrize("linger, code, failed, waited_for", [
    pytest.param(0.5, 3, 1, 0, id="the-peer-exits"),
    pytest.param(60, 1, 0, 1, id="the-peer-never-exits", marks=pytest.mark.slow),
])
def test_a_rank_that_leaves_is_the_failure_not_the_peer_that_lost_it(tmp_path, linger, code, failed, waited_for):
    """Rank 1 leaves at step 3 the way `sys.exit(3)` does: its sockets close first, its process ends `linger` s
    later. Rank 0's all-reduce fails on the lost peer and it exits first, with 1. The run waits for the peer: the
    failure and the exit code are rank 1's when its exit comes within the wait, else rank 0's."""
    run = supervise(tmp_path, "--nproc-per-node", "2", str(PROGRAMS / "allreduce_loop.py"), "--step-time", "0.02",
                    "--ready", str(tmp_path / "pids"), "--leave", "1:3:3", "--linger", str(linger))
    assert run.returncode == code, run.stderr[-3000:]
    assert re.search(r"CPU0 \(rank 0, pid \d+\) ended with exit 1 after losing a peer; waiting up to 3 s for the "
                     r"rank that left", run.stderr), run.stderr[-3000:]
    assert re.search(rf"run failed after [\d.]+ s: CPU{failed} \(rank {failed}\) failed: exit {code}$", run.stderr,
                     re.M), run.stderr[-3000:]
    endings = dict(re.findall(r"^supervisor:   CPU(\d) +\d +\d+ +.*?  (failed first|failed after the first failure|"
                              r"stopped by the supervisor) ", run.stderr, re.M))
    assert endings == {str(failed): "failed first", str(waited_for):
                       "failed after the first failure" if failed else "stopped by the supervisor"}, run.stderr[-3000:]
    assert len(run.pids()) == 2 and survivors(run.pids()) == []  # (the --ready files are the harness's pid files)


def test_a_rank_that_ignores_sigterm_is_killed_without_a_guess_of_where_it_was(tmp_path):
    """A program that reports nothing: a rank outliving SIGTERM is named, with no claim of a phase it never said."""
    script = "trap '' TERM; [ $RANK = 1 ] && exit 3; sleep 60"
    run = supervise(tmp_path, "--nproc-per-node", "2", "--shutdown-timeout", "1", "--no-python", "bash", "-c", script)
    assert run.returncode == 3, run.stderr[-3000:]
    assert "supervisor: CPU0 still running 1 s after SIGTERM; SIGKILL\n" in run.stderr, run.stderr[-3000:]


def test_any_failure_is_restarted_with_torchruns_restart_count(tmp_path):
    """Exit 2 is a failure like any other to a torchrun program: restarted, and told so."""
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    ours.mkdir(), theirs.mkdir()
    run = supervise(tmp_path, "--max-restarts=1", "--nproc-per-node=2", str(PROGRAMS / "flaky.py"), str(ours))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "restart 1 of 1 after CPU1 (rank 1) failed: exit 2; the ranks start again with " \
           "TORCHELASTIC_RESTART_COUNT=1" in run.stderr
    assert "checkpoint" not in run.stderr
    torchrun(tmp_path, "--max-restarts=1", "--nproc-per-node=2", str(PROGRAMS / "flaky.py"), str(theirs))
    attempts = sorted((ours / "attempts.txt").read_text().splitlines())
    assert attempts == sorted((theirs / "attempts.txt").read_text().splitlines()) == \
        [f"attempt {a} of 1 rank {r}" for a in (0, 1) for r in (0, 1)]


@pytest.mark.parametrize("isolate", [False, True], ids=["torchrun-view", "isolated"])
def test_each_rank_of_a_torchrun_program_gets_its_own_gpu(tmp_path, isolate):
    """Fake GPUs 0-7, --gpus 2,5,7: rank 1 is GPU5's, through cuda:LOCAL_RANK (torchrun's view) or cuda:0."""
    out = tmp_path / "env"
    out.mkdir()
    run = supervise(tmp_path, "--gpus", "2,5,7", *(["--isolate-gpus"] if isolate else []), "--no-python",
                    str(PROGRAMS / "env_dump.sh"), str(out), env=clean_env(SUPERVISOR_FAKE_GPUS="0,1,2,3,4,5,6,7"))
    assert run.returncode == 0, run.stderr[-3000:]
    for rank, gpu in enumerate((2, 5, 7)):
        env = dict(line.split("=", 1) for line in (out / f"rank{rank}.env").read_text().splitlines() if "=" in line)
        visible = env["CUDA_VISIBLE_DEVICES"].split(",")
        assert visible[0 if isolate else int(env["LOCAL_RANK"])] == str(gpu) == env["GPU_RANK"]
        assert visible == ([str(gpu)] if isolate else ["2", "5", "7"])
        assert f"GPU{gpu}:rank {rank} of 3 sees CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}" in run.stdout
    assert run.run_dir().name.endswith("-env_dump") and (run.run_dir() / "gpu5.log").exists()


def test_an_operators_pet_variables_launch_the_group(tmp_path):
    """What a PyTorchJob's pod runs: `torchrun PROGRAM` with the launch in PET_* variables."""
    out = tmp_path / "env"
    out.mkdir()
    run = supervise(tmp_path, "--no-python", str(PROGRAMS / "env_dump.sh"), str(out),
                    env=clean_env(PET_NPROC_PER_NODE="3", PET_STANDALONE="1", PET_ROLE="worker"))
    assert run.returncode == 0, run.stderr[-3000:]
    envs = [dict(line.split("=", 1) for line in (out / f"rank{rank}.env").read_text().splitlines() if "=" in line)
            for rank in range(3)]
    assert [(e["RANK"], e["WORLD_SIZE"], e["ROLE_NAME"], e["MASTER_ADDR"]) for e in envs] == [
        (str(rank), "3", "worker", "localhost") for rank in range(3)]


# -- the error file and the bars ----------------------------------------------------------------------------------

def test_error_files_in_either_of_torchs_shapes(tmp_path):
    path = tmp_path / "e.json"
    assert error_file.read(path) is None
    path.write_text(json.dumps({"message": {"message": "RuntimeError: boom", "extraInfo": {
        "py_callstack": "Traceback (most recent call last):\n  x\nRuntimeError: boom\n", "timestamp": "1700000000"}}}))
    cause = error_file.read(path)
    assert cause is not None and (cause.message, cause.timestamp) == ("RuntimeError: boom", 1700000000)
    assert cause.lines()[1:] == ["  | Traceback (most recent call last):", "  |   x", "  | RuntimeError: boom"]
    path.write_text(json.dumps({"message": "OSError: disk", "timestamp": 1700000001}))
    assert (error_file.read(path).message, error_file.read(path).timestamp) == ("OSError: disk", 1700000001)
    path.write_text("{not json")
    assert error_file.read(path).message.startswith("the error file cannot be read")


def test_a_bar_is_shown_once_a_second_and_its_end_once(tmp_path):
    from test_supervisor_pump import feed_pump

    updates = [f"\r{i / 10:.0f}% |{'#' * (i // 50)}".encode() for i in range(1000)]
    console, log, _ = feed_pump(tmp_path, [b"start\n", *updates, b"\r100% done\n", b"next\n"], step=0.01)
    lines = console.decode().splitlines()
    assert lines[0] == "GPU0:start" and lines[-2:] == ["GPU0:100% done", "GPU0:next"]
    shown = lines[1:-2]
    assert 8 <= len(shown) <= 11 and all(re.fullmatch(r"GPU0:\d+% \|#*", line) for line in shown), shown
    assert log.decode().splitlines() == [line.removeprefix("GPU0:") for line in lines]


def test_the_last_state_shown_is_not_repeated(tmp_path):
    from test_supervisor_pump import feed_pump

    console, _, _ = feed_pump(tmp_path, [b"\r1/3", b"\r2/3", b"\r3/3", b"\n"], step=2.0)
    assert console == b"GPU0:2/3\nGPU0:3/3\n", "the first state waits a second; the end is the last state shown"
