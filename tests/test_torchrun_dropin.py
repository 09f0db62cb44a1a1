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
from supervisor.launch import cli, torchrun_args
from supervisor.diagnosis import error_file
from supervisor.plan import rendezvous
from trainer.errors import UserError

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


# -- the command line, in process ---------------------------------------------------------------------------------

def read(*argv: str) -> tuple:
    return cli.read_command_line(list(argv))


def test_torchruns_command_line_is_recognised_and_the_supervisors_is_not():
    own, theirs = cli.build_parser(), torchrun_args.build_parser(cli.add_torchrun_side_flags)
    for argv in (["prog.py"], ["--gpus", "1", "prog.py"], ["--standalone"], ["-m", "pkg"], ["--nproc_per_node=2"],
                 ["--no-python", "x"], ["--tee", "3"], ["--node_rank", "1"]):
        assert torchrun_args.recognised(argv, own, theirs), argv
    for argv in (["--debug"], ["--nproc", "2", "--entry", "w.py", "--", "prog.py"], ["--set", "a.b=1", "--gpus", "1"],
                 ["--max-restarts", "2", "--hang-timeout", "5"]):
        assert not torchrun_args.recognised(argv, own, theirs), argv


def test_torchruns_flags_become_the_supervisors_launch():
    script = str(PROGRAMS / "flaky.py")
    args, program_args, launch, notes = read("--nproc_per_node=3", "--max_restarts", "2", "--shutdown-timeout=5",
                                             "--role", "trainer", "--rdzv_id=job7", "--master_port=1234", script,
                                             "--nproc_per_node", "9", "--", "x")
    assert (args.nproc, args.max_restarts, args.grace_period, args.master_port) == (3, 2, 5.0, 1234)
    assert program_args == ["--nproc_per_node", "9", "--", "x"], "everything after the program is the program's"
    assert (launch.mode, launch.role, launch.run_id, notes) == ("script", "trainer", "job7", [])
    args, _, _, _ = read("--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--node-timeout", "7",
                         "--join-timeout", "60", script)
    assert (args.node_timeout, args.join_timeout) == (7.0, 60.0)  # the supervisor's own, beside torchrun's
    args, _, launch, _ = read("--standalone", "--master-port", "1234", script)
    assert (args.master_addr, args.master_port, args.nnodes) == ("localhost", None, 1)
    uuid.UUID(launch.run_id)
    args, _, launch, _ = read("--nnodes=2", "--node-rank=1", "--rdzv-backend=c10d", "--rdzv-endpoint=node0:29500",
                              "--nnodes", "2:2", script)
    assert (args.nnodes, args.node_rank, args.master_addr, args.master_port, launch.run_id) == \
        (2, 1, "node0", 29500, "none")
    args, _, _, _ = read("--nnodes=4", "--rdzv-backend=c10d", "--rdzv-endpoint=node0", script)  # as c10d users do
    assert (args.nnodes, args.node_rank, args.master_addr, args.master_port) == (4, None, "node0", 29400)
    args, _, _, _ = read("--nproc-per-node", "cpu", script)
    assert args.nproc is None and args.cpu_ranks >= 1 and "system.device=cpu" in args.set
    args, _, launch, _ = read("--gpus", "2,5", "-m", "pkg.train", "--lr=3")
    assert (args.gpus, args.nproc, launch.mode, str(launch.program)) == ("2,5", None, "module", "pkg.train")
    args, entry_args, launch, _ = read("--nproc-per-node", "2", "pretrain_main.py", "--debug", "--set", "a.b=1")
    assert launch is None and entry_args == [] and (args.nproc, args.debug, args.set) == (2, True, ["a.b=1"])


@pytest.mark.parametrize("release, addr", [((2, 11), "127.0.0.1"), ((2, 12), "localhost"), ((2, 13), "localhost")])
def test_a_single_node_without_an_endpoint_meets_where_the_installed_torchrun_would(monkeypatch, release, addr):
    """`torchrun --nproc-per-node 2 train.py`: torch 2.12's torchrun on runs it as --standalone (localhost, a fresh
    run id); 2.11's as a static rendezvous at --master-addr (127.0.0.1). MASTER_ADDR is what the program sees, so the
    installed torch decides, as for its own torchrun."""
    monkeypatch.setattr(torchrun_args, "torch_release", lambda: release)
    args, _, launch, _ = read("--nproc-per-node", "2", str(PROGRAMS / "flaky.py"))
    static = addr == "127.0.0.1"
    # no address given: the supervisor's single-node default, 127.0.0.1 (supervisor.launch.cli), torchrun's too
    assert (args.master_addr, args.master_port) == (None if static else "localhost", None)
    assert (launch.run_id == "none") == static
    args, _, _, _ = read("--standalone", str(PROGRAMS / "flaky.py"))  # --standalone itself: every release
    assert args.master_addr == "localhost"


def test_flags_left_off_the_command_line_come_from_pet_variables(monkeypatch, tmp_path, capsys):
    """As torchrun reads them (what Kubeflow's PyTorchJob sets before a plain `torchrun script.py`); the command line
    wins; a value the flag would refuse is one line naming the variable."""
    script = str(PROGRAMS / "flaky.py")
    for name, value in {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "3", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "node0",
                        "PET_MASTER_PORT": "23456", "PET_MAX_RESTARTS": "2", "PET_RDZV_ID": "job7"}.items():
        monkeypatch.setenv(name, value)
    args, _, launch, _ = read(script)
    assert (args.nnodes, args.nproc, args.node_rank, args.master_addr, args.master_port, args.max_restarts,
            launch.run_id) == (2, 3, 1, "node0", 23456, 2, "job7")
    args, _, _, _ = read("--node-rank", "0", "--nproc_per_node=1", script)
    assert (args.node_rank, args.nproc, args.nnodes) == (0, 1, 2)
    monkeypatch.delenv("PET_NNODES")
    monkeypatch.setenv("PET_STANDALONE", "1")
    args, _, launch, _ = read(script)
    assert (args.master_addr, args.master_port, args.nnodes) == ("localhost", None, 1)
    uuid.UUID(launch.run_id)
    assert read("--debug")[2] is None  # the supervisor's own command line does not read them
    monkeypatch.setenv("PET_NODE_RANK", "one")
    assert cli.main(["--log-dir", str(tmp_path / "logs"), script]) == 2
    err = capsys.readouterr().err
    assert err == ("error: PET_NODE_RANK='one': expected a value for --node-rank (torchrun reads it as --node-rank "
                   "when the command line leaves that out); fix or unset it\n"), err


def test_abbreviations_and_a_program_after_a_double_dash_are_read_as_torchrun_reads_them():
    """torchrun's parser takes a flag's unambiguous prefix and ``--`` before the program; what follows the program
    is the program's, even where it looks like one of torchrun's flags abbreviated (torchrun itself refuses a
    program's ``--max 1`` as ambiguous)."""
    script = str(PROGRAMS / "flaky.py")
    args, program_args, launch, _ = read("--nproc_per", "3", "--max_r=2", "--", script, "--max", "1", "--", "x")
    assert (args.nproc, args.max_restarts, launch.program, program_args) == (3, 2, script, ["--max", "1", "--", "x"])
    own = read("--nproc", "2", "--gpu", "1", "--debug")  # the supervisor's own, abbreviated: still its own
    assert own[2] is None and (own[0].nproc, own[0].gpus) == (2, "1")
    own = read("--nproc", "2", "--entry", script, "--", "run.py")  # after --: --entry's arguments
    assert own[2] is None and own[1] == ["run.py"]


def test_several_nodes_without_an_address_meet_where_torchrun_would():
    """torchrun's static rendezvous defaults to 127.0.0.1:29500, its c10d one to localhost:29400: the same here,
    saying so (every node on one host, or the address named)."""
    script = str(PROGRAMS / "flaky.py")
    args, _, _, notes = read("--nnodes", "2", "--node-rank", "1", script)
    assert (args.master_addr, args.master_port) == ("127.0.0.1", 29500)
    assert notes == ["--master-addr not given: node 0 is 127.0.0.1:29500, as under torchrun (every node on this host; "
                     "--master-addr HOST names node 0 elsewhere)"]
    args, _, _, notes = read("--nnodes", "2", "--master-addr", "node0", script)
    assert (args.master_addr, args.master_port) == ("node0", 29500)
    assert notes == ["--master-port not given: node 0's port is 29500, as under torchrun"]
    args, _, _, notes = read("--nnodes", "2", "--rdzv-backend", "c10d", script)
    assert (args.master_addr, args.master_port) == ("localhost", 29400) and "localhost:29400" in notes[0]
    args, _, _, notes = read("--master-port", "65535", script)  # one node: no control port after it
    assert (args.master_port, notes) == (65535, [])
    cli.node_layout(args, notes)
    cli.check_flags(args)  # refused on several nodes only


def test_flags_without_a_use_here_are_accepted_with_one_line_each():
    flags = ["--tee", "3", "-r", "3", "--log_dir=/tmp/x", "--monitor-interval", "1", "--start_method=fork",
             "--rdzv-conf", "join_timeout=5", "--local-addr", "h", "--local-ranks-filter", "0", "--run-path",
             "--numa-binding", "node", "--signals-to-handle", "SIGUSR1", "--event-log-handler", "x",
             "--logs-specs", "x", "--duplicate-stdout-filters", "a", "--duplicate-stderr-filters", "b"]
    args, _, launch, notes = read(*flags, str(PROGRAMS / "flaky.py"))
    assert args.log_dir == "/tmp/x" and args.local_addr == "h"  # honoured: where this node connects from
    assert launch.console_ranks == {0} and launch.signals_to_handle == "SIGUSR1"  # honoured too
    named = [note.split(":", 1)[0] for note in notes]
    assert sorted(named) == sorted(["--tee 3", "--redirects 3", "--log-dir /tmp/x", "--monitor-interval 1",
                                    "--start-method fork", "--rdzv-conf join_timeout=5",
                                    "--run-path", "--numa-binding node",
                                    "--signals-to-handle SIGUSR1", "--event-log-handler x", "--logs-specs x",
                                    "--duplicate-stdout-filters a", "--duplicate-stderr-filters b"])
    assert all("\n" not in note for note in notes)


@pytest.mark.parametrize("argv, message", [
    (("--nnodes", "1:4", "P"), "--nnodes 1:4: elastic node ranges are not supported"),
    (("--rdzv-backend", "etcd", "P"), "--rdzv-backend etcd: only static and c10d rendezvous are supported"),
    (("--nproc-per-node", "xpu", "P"), "--nproc-per-node xpu: expected a number, gpu, cpu or auto"),
    (("--nproc-per-node", "gpu", "P"), "--nproc-per-node gpu: no usable GPU on this machine"),
    (("--no-python", "-m", "P"), "--no-python and -m/--module cannot be used together"),
    (("--nproc-per-node", "2", "missing.py"), "missing.py: no such file"),
    (("--no-python", "no-such-program-here"), "--no-python no-such-program-here: no such executable on PATH"),
    (("--standalone", "--nnodes", "2", "P"), "--standalone is a single-node run"),
    (("--nproc-per-node", "2"), "no program to run; torchrun's command line: python -m supervisor"),
    (("--debug", "P"), "unrecognized arguments: --debug"),
    # what would have the ranks retry until the store's 30-minute timeout, or fail in a traceback
    (("--rdzv-backend=c10d", "--rdzv-endpoint=node 0:29400", "P"), "--rdzv-endpoint 'node 0:29400': expected HOST"),
    (("--rdzv-backend=c10d", "--rdzv-endpoint=localhost:-5", "P"), "--rdzv-endpoint 'localhost:-5': expected HOST"),
    (("--rdzv-backend=c10d", "--rdzv-endpoint=no-such-host.invalid:29400", "P"),
     "node 0's address no-such-host.invalid (--master-addr, or the host of --rdzv-endpoint) does not resolve"),
    (("--master-addr", "999.999.999.999", "--master-port", "29400", "P"),
     "node 0's address 999.999.999.999 (--master-addr, or the host of --rdzv-endpoint) does not resolve"),
    (("--nproc-per-node", "²", "P"), "--nproc-per-node ²: expected a number, gpu, cpu or auto"),
    (("--local-ranks-filter", "0,x", "P"), "--local-ranks-filter 0,x: expected local ranks separated by commas"),
    (("-m", "P"), "-m {P}: -m takes a module's name (-m pkg.train); give a script's path without -m"),
    # what torchrun's parser refuses, and torchrun's names in the supervisor's checks
    (("--start-method", "bogus", "P"), "argument --start-method/--start_method: invalid choice: 'bogus'"),
    (("--ma", "1", "P"), "--ma is ambiguous: it could be --master-addr, --master-port, --max-restarts"),
    (("--nproc-per-node", "5000", "P"), "--nproc-per-node must be within 1-1,024 (ranks on this node), got 5000"),
    (("--shutdown-timeout", "-1", "P"), "--shutdown-timeout must be a number of seconds within 0-2,592,000"),
    (("--nnodes", "2", "--node-rank", "0", "--master-port", "65535", "P"),
     "--master-port must be within 1-65534 on several nodes (the nodes' control port is the next one"),
    (("--rdzv-backend=c10d", "--rdzv-endpoint=::1", "--nnodes=2", "P"),
     "--rdzv-endpoint ::1: an IPv6 address goes in brackets, before the port ([::1]:29400, or [::1] for port"),
])
def test_what_cannot_be_honoured_is_one_error_line(tmp_path, capsys, argv, message):
    program = str(PROGRAMS / "flaky.py")
    argv = [program if arg == "P" else arg for arg in argv]
    assert cli.main(["--log-dir", str(tmp_path / "logs"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message.replace('{P}', program)}") and err.count("\n") == 1, err
    assert not (tmp_path / "logs").exists()


def test_a_joining_node_waits_for_node_0s_name_to_resolve(monkeypatch):
    """On Kubernetes a worker pod can start before the master's service name is published: a node that joins looks
    the name up again until its --join-timeout, node 0 (patience 0) is refused at once."""
    answers = iter(["Name or service not known", "Name or service not known", None])
    monkeypatch.setattr(rendezvous, "RESOLVE_RETRY", 0.05)
    monkeypatch.setattr(rendezvous, "look_up", lambda host: next(answers))
    rendezvous.check_host("master-0.job.svc", patience=5.0)  # the third look-up answers
    monkeypatch.setattr(rendezvous, "look_up", lambda host: "Name or service not known")
    started = time.monotonic()
    with pytest.raises(UserError, match=r"does not resolve \(Name or service not known\) for 0.3 s \(--join-timeout\)"):
        rendezvous.check_host("master-0.job.svc", patience=0.3)
    assert 0.2 < time.monotonic() - started < 2.0
    with pytest.raises(UserError, match=r"does not resolve \(Name or service not known\); give a host name"):
        rendezvous.check_host("master-0.job.svc")


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
