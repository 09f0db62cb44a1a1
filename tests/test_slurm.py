"""Launching under Slurm: the layout read from SLURM_* variables (host lists, the port, flags that win), and two
"nodes" faked on loopback through those variables — first with the light rank program, then with the real trainer,
stopped by Slurm's time-limit warning (SIGUSR1), checkpointed, and resumed as a requeued job would be."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import hostlist
import pytest

from rank_scripts.harness import CONTROL_SECRET, ROOT, Run, clean_env, start
from rank_support import TINY, merged, set_flags
from supervisor.control.wire import LOST_CODE, SECRET_ENV
from supervisor.gpus.exclusion import GPU_FAULT_FILE, LOST_NODE_FILE, LostNode, NodeFault
from supervisor.plan import slurm as slurm_layout
from trainer.checkpoint import layout
from trainer.errors import UserError

SCRIPT = ROOT / "train_slurm.sbatch"

# ---------------------------------------------------------------------------------------------------------------------
# The layout, unit by unit


@pytest.mark.parametrize("nodelist, first", [
    ("node[01-04,07]", "node01"),
    ("a[1-2],b3", "a1"),
    ("gpu-[009-011]", "gpu-009"),
    ("rack[2-3]-n[1-2]", "rack2-n1"),
    ("single", "single"),
    ("b7,a[1-2]", "b7"),  # scontrol keeps the list's order: the first named is node 0
])
def test_first_host_expands_slurm_host_lists(nodelist: str, first: str) -> None:
    assert slurm_layout.first_host(nodelist) == first


def test_a_broken_host_list_is_a_user_error() -> None:
    with pytest.raises(UserError, match=r"SLURM_JOB_NODELIST='node\[01-' is not a Slurm host list"):
        slurm_layout.first_host("node[01-")


def test_the_port_is_the_same_on_every_node_and_leaves_room_for_the_control_channel() -> None:
    ports = {job: slurm_layout.master_port(job) for job in (0, 1, 2, 12345, 10_999, 11_000, 2**31 - 1)}
    assert ports[12345] == slurm_layout.master_port(12345)
    assert ports[0] != ports[1] and abs(ports[0] - ports[1]) >= 2  # neighbouring jobs: disjoint port pairs
    assert ports[11_000] == ports[0]
    assert all(1024 < port and port + 1 < 32768 for port in ports.values())  # unprivileged, below ephemeral ports


def job_env(nodes: int = 2, node_id: int = 1, **extra: str) -> dict[str, str]:
    return {"SLURM_JOB_ID": "4242", "SLURM_NNODES": str(nodes), "SLURM_NODEID": str(node_id),
            "SLURM_JOB_NODELIST": "gpu[07-08]", **extra}


def no_flags(**given: object) -> argparse.Namespace:
    return argparse.Namespace(**{"nnodes": None, "node_rank": None, "master_addr": None, "master_port": None,
                                 **given})


def test_a_multi_node_job_gives_every_flag() -> None:
    args = no_flags()
    note = slurm_layout.apply(args, job_env())
    assert (args.nnodes, args.node_rank, args.master_addr, args.master_port) == (2, 1, "gpu07", slurm_layout.master_port(4242))
    assert note == ("Slurm job layout (SLURM_JOB_ID=4242, SLURM_NNODES=2, SLURM_NODEID=1, "
                    f"SLURM_JOB_NODELIST=gpu[07-08]): --nnodes 2 --node-rank 1 --master-addr gpu07 --master-port {slurm_layout.master_port(4242)}")


def test_flags_given_explicitly_win() -> None:
    args = no_flags(master_addr="10.0.0.1", master_port=29500)
    slurm_layout.apply(args, job_env())
    assert (args.nnodes, args.node_rank, args.master_addr, args.master_port) == (2, 1, "10.0.0.1", 29500)
    args = no_flags(nnodes=2, node_rank=0, master_addr="h", master_port=1)
    assert "not used" in str(slurm_layout.apply(args, job_env()))


def test_job_num_nodes_stands_in_for_nnodes() -> None:
    env = job_env()
    env["SLURM_JOB_NUM_NODES"] = env.pop("SLURM_NNODES")
    args = no_flags()
    slurm_layout.apply(args, env)
    assert args.nnodes == 2


@pytest.mark.parametrize("env", [{}, job_env(nodes=1, node_id=0), {"SLURM_NNODES": "2", "SLURM_NODEID": "1"}])
def test_no_layout_outside_a_multi_node_job(env: dict[str, str]) -> None:
    args = no_flags()
    assert slurm_layout.apply(args, env) is None
    assert (args.nnodes, args.master_port) == (None, None)


@pytest.mark.parametrize("env, message", [
    ({**job_env(), "SLURM_NTASKS": "16"}, "SLURM_NTASKS=16 on 2 nodes"),
    ({k: v for k, v in job_env().items() if k != "SLURM_NODEID"}, "SLURM_NODEID is not set"),
    (job_env(SLURM_NNODES="two"), "SLURM_NNODES='two' is not a number"),
])
def test_a_job_the_supervisor_cannot_read_is_a_user_error(env: dict[str, str], message: str) -> None:
    with pytest.raises(UserError, match=message):
        slurm_layout.layout(env)


# ---------------------------------------------------------------------------------------------------------------------
# The job script's side (supervisor/slurm/job.py), with srun and scontrol stood in for by scripts that record their call


@dataclass
class StandIn:
    """What a stand-in command does on every call: writes `files` (what the real command's work leaves behind),
    prints, and exits."""

    code: int = 0
    stdout: str = ""
    stderr: str = ""
    files: dict[str, str] = field(default_factory=dict)


STAND_IN = """\
import json, os, sys
with open({log!r}, "a") as f:
    f.write(json.dumps([sys.argv[1:], dict(os.environ)]) + "\\n")
for path, text in {files!r}.items():
    os.makedirs(os.path.dirname(path), exist_ok=True)
    open(path, "w").write(text)
print({stdout!r}, end="")
print({stderr!r}, end="", file=sys.stderr)
sys.exit({code})
"""


def fake_slurm_commands(folder: Path, srun_exit: int, **others: StandIn) -> dict[str, str]:
    """`srun`, `scontrol` and `sinfo` on PATH that append their arguments and environment to <folder>/<name>.jsonl."""
    folder.mkdir()
    for name, does in {"srun": StandIn(srun_exit), "scontrol": StandIn(), "sinfo": StandIn(), **others}.items():
        path = folder / name
        path.write_text(f"#!{sys.executable}\n" + STAND_IN.format(log=str(folder / f"{name}.jsonl"), **asdict(does)))
        path.chmod(0o755)
    return {"PATH": f"{folder}{os.pathsep}{os.environ['PATH']}"}


def run_job_script(tmp_path: Path, srun_exit: int, *flags: str, stand_ins: dict[str, StandIn] | None = None,
                   **env: str) -> subprocess.CompletedProcess:
    """`sbatch train_slurm.sbatch FLAGS` as the batch step runs it: the script itself, in the project folder."""
    full = clean_env(**{"PYTHON": sys.executable, "SLURM_JOB_ID": "4242", "SLURM_CPUS_PER_TASK": "16",
                        **fake_slurm_commands(tmp_path / "bin", srun_exit, **(stand_ins or {})), **env})
    return subprocess.run(["bash", str(ROOT / "train_slurm.sbatch"), *flags], cwd=ROOT, env=full,
                          capture_output=True, text=True, timeout=60)


def calls(tmp_path: Path, name: str) -> list[tuple[list[str], dict[str, str]]]:
    path = tmp_path / "bin" / f"{name}.jsonl"
    return [tuple(json.loads(line)) for line in path.read_text().splitlines()] if path.exists() else []


def recorded(tmp_path: Path, name: str) -> tuple[list[str], dict[str, str]]:
    """The command's last call."""
    return calls(tmp_path, name)[-1]


def test_the_job_script_passes_the_users_flags_and_a_fresh_secret(tmp_path: Path) -> None:
    out = run_job_script(tmp_path, 0, "--debug", "--max-steps", "5")
    assert out.returncode == 0, out.stderr
    argv, env = recorded(tmp_path, "srun")
    assert argv == ["--ntasks-per-node=1", "--cpus-per-task=16", "--kill-on-bad-exit=1", "bash",
                    str(ROOT / "run_training.sh"), "--resume", "auto", "--debug", "--max-steps", "5"]  # --debug works
    assert re.fullmatch(r"[0-9a-f]{64}", env[SECRET_ENV])
    assert calls(tmp_path, "scontrol") == []


def test_the_job_script_keeps_a_given_secret_and_requeues_after_the_time_limit_warning(tmp_path: Path) -> None:
    out = run_job_script(tmp_path, 138, SUPERVISOR_CONTROL_SECRET=CONTROL_SECRET)
    assert out.returncode == 138
    assert "requeueing job 4242" in out.stdout
    assert recorded(tmp_path, "srun")[1][SECRET_ENV] == CONTROL_SECRET
    assert recorded(tmp_path, "scontrol")[0] == ["requeue", "4242"]


# srun for a step that gets the time-limit warning: Slurm's --signal=B:USR1 goes to the batch step's process alone
# (the job script, srun's parent); the step's task (this stand-in, in the supervisor's place) exits 138 once the
# warning reaches it
WARNED_STEP = """\
import os, signal, sys, time
signal.signal(signal.SIGUSR1, lambda *_: sys.exit(138))
open({task!r}, "w").write(str(os.getpid()))
os.kill(os.getppid(), signal.SIGUSR1)
time.sleep(30)
sys.exit(1)
"""
# scontrol that records its calls as the other stand-ins do and, for listpids, lists the batch step's own process,
# the step's task (local id 0) and a rank below it (no task id)
LISTPIDS = """\
import json, sys
with open({log!r}, "a") as f:
    print(json.dumps([sys.argv[1:], {{}}]), file=f)
if sys.argv[1] == "listpids":
    task = int(open({task!r}).read())
    print("PID      JOBID    STEPID   LOCALID GLOBALID")
    print("1        4242     batch    0       0")
    print(f"{{task}}  4242     0        0       0")
    print(f"{{task + 1}}  4242     0        -       -")
"""


def test_the_time_limit_warning_goes_to_the_supervisor_alone(tmp_path: Path) -> None:
    """The job script gets SIGUSR1 (``#SBATCH --signal=B:USR1@120``) and passes it to its node's step task, the
    supervisor, found by ``scontrol listpids``; no rank gets it (a rank would dump its stacks). The step then exits
    138, and the job requeues."""
    bin_dir, task = tmp_path / "bin", tmp_path / "task.pid"
    path = fake_slurm_commands(bin_dir, 0)
    (bin_dir / "srun").write_text(f"#!{sys.executable}\n" + WARNED_STEP.format(task=str(task)))
    (bin_dir / "scontrol").write_text(f"#!{sys.executable}\n" + LISTPIDS.format(log=str(bin_dir / "scontrol.jsonl"),
                                                                                 task=str(task)))
    env = clean_env(PYTHON=sys.executable, SLURM_JOB_ID="4242", SLURMD_NODENAME="n1", **path)
    out = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 138, out.stderr
    assert out.stdout.splitlines()[0] == (f"time-limit warning: passing SIGUSR1 on to the supervisor on node n1 "
                                          f"(pid {int(task.read_text())})")
    assert [argv for argv, _ in calls(tmp_path, "scontrol")] == [["listpids", "4242", "n1"], ["requeue", "4242"]]


def test_the_job_script_asks_slurm_for_its_warning_alone() -> None:
    assert "#SBATCH --signal=B:USR1@120" in SCRIPT.read_text().splitlines()


SHOW_JOB = "JobId=4242 JobName=pretrain JobState=RUNNING Restarts=0 Partition=gpu ExcNodeList={excluded} NumNodes=2"


def gpu_fault_stand_ins(tmp_path: Path, *, job_id: str = "4242", allocation: int = 1, partition: str = "n[1-6]",
                        excluded: str = "n5", requeue: StandIn = StandIn()) -> dict[str, StandIn]:
    """srun leaves the record of a GPU fault on node n2, as its supervisor does (gpu_fault.json in its run folder);
    scontrol describes the job (n5 excluded already), sinfo lists the partition's nodes."""
    fault = NodeFault("n2", {"1": ["NVML: lost"]}, "2026-01-01T00:00:00", job_id, allocation)
    record = {str(tmp_path / "logs" / "20260101-000000-debug" / GPU_FAULT_FILE): json.dumps(asdict(fault))}
    show = SHOW_JOB.format(excluded=excluded)
    return {"srun": StandIn(1, files=record), "scontrol": replace(requeue, stdout=show),
            "sinfo": StandIn(stdout="\n".join(hostlist.expand_hostlist(partition)))}


def gpu_fault_job(tmp_path: Path, **kwargs: object) -> subprocess.CompletedProcess:
    env = {k: kwargs.pop(k) for k in list(kwargs) if k.isupper()}
    return run_job_script(tmp_path, 1, "--log-dir", str(tmp_path / "logs"),
                          stand_ins=gpu_fault_stand_ins(tmp_path, **kwargs), SLURM_JOB_NUM_NODES="2",
                          SLURM_RESTART_COUNT="1", **env)


def test_a_gpu_fault_requeues_the_job_without_its_node(tmp_path: Path) -> None:
    """The step's exit code stays the job's; Slurm takes a job's excluded nodes only once it is pending again, so the
    requeue comes first."""
    out = gpu_fault_job(tmp_path)
    assert out.returncode == 1, out.stderr
    assert [argv for argv, _ in calls(tmp_path, "scontrol")] == [
        ["show", "job", "-o", "4242"], ["requeue", "4242"], ["update", "JobId=4242", "ExcNodeList=n[2,5]"]]
    assert [argv for argv, _ in calls(tmp_path, "sinfo")] == [["-h", "-N", "-o", "%N", "-p", "gpu"]]
    assert out.stdout.splitlines() == [
        "GPU fault on node n2: GPU 1 (NVML: lost)",
        "requeued job 4242 without node n2 (ExcNodeList=n[2,5]); its next allocation resumes from the latest "
        "checkpoint"]


@pytest.mark.parametrize("kwargs, line", [
    ({"SUPERVISOR_NODE_EXCLUSION": "0"},
     "not requeueing job 4242: node exclusion is off (SUPERVISOR_NODE_EXCLUSION=0)"),
    ({"partition": "n[1-3]", "excluded": "n3"},
     "not requeueing job 4242: without node n2 partition gpu has 1 node(s) left, fewer than the job's 2"),
    ({"excluded": "n2"}, "not requeueing job 4242: node n2 was excluded already (ExcNodeList=n2)"),
    ({"requeue": StandIn(1, stderr="Requeue of JobId=4242 is not allowed\n")},
     "not requeueing job 4242: scontrol requeue refused (Requeue of JobId=4242 is not allowed)"),
], ids=["switched-off", "no-node-left", "excluded-already", "slurm-refuses"])
def test_a_gpu_fault_that_cannot_requeue_says_why_in_one_line(tmp_path: Path, kwargs: dict[str, object],
                                                             line: str) -> None:
    out = gpu_fault_job(tmp_path, **kwargs)
    assert out.returncode == 1, out.stderr
    assert out.stdout.splitlines() == ["GPU fault on node n2: GPU 1 (NVML: lost)", line]
    assert ["update", "JobId=4242", "ExcNodeList=n[2,5]"] not in [argv for argv, _ in calls(tmp_path, "scontrol")]


@pytest.mark.parametrize("kwargs", [{"job_id": "4241"}, {"allocation": 0}], ids=["another-job", "earlier-allocation"])
def test_a_program_fault_neither_excludes_nor_requeues(tmp_path: Path, kwargs: dict[str, object]) -> None:
    """No record of this allocation (those of another job or of this job's earlier allocation do not count): the
    job fails with the step's exit code, as before."""
    out = gpu_fault_job(tmp_path, **kwargs)
    assert (out.returncode, out.stdout) == (1, "")
    assert calls(tmp_path, "scontrol") == []


@pytest.mark.parametrize("exclusion", ["1", "0"])
def test_a_lost_node_ends_the_job_with_its_code_and_is_left_out_of_the_requeue(tmp_path: Path, exclusion: str) -> None:
    """n2 was frozen: n1's supervisor recorded it lost (node_lost.json, twice: a record of an earlier allocation does
    not count) and exited 125; Slurm then ended n2's task (--kill-on-bad-exit), whose supervisor, woken by the
    SIGCONT first, found n1 silent and recorded it lost in turn, later: that record does not count either. srun exits
    137. The job exits 125, names n2 and is requeued without it, unless node exclusion is off."""
    def lost(allocation: int, run: str, node: int = 1, seen_by: str = "n1", at: str = "05.120") -> dict[str, str]:
        record = LostNode(node, f"node {node} (10.0.0.{node + 1}) stopped answering 30.0 s ago", seen_by,
                          f"2026-01-01T00:00:{at}", "4242", allocation)
        return {str(tmp_path / "logs" / run / LOST_NODE_FILE): json.dumps(asdict(record))}

    woken = lost(1, "now-2", node=0, seen_by="n2", at="05.870")  # within the same second
    stand_ins = {"srun": StandIn(137, files={**lost(0, "earlier"), **lost(1, "now"), **woken}),
                 "scontrol": StandIn(stdout=SHOW_JOB.format(excluded="(null)")), "sinfo": StandIn(stdout="n1\nn2\nn3")}
    out = run_job_script(tmp_path, 137, "--log-dir", str(tmp_path / "logs"), SLURM_JOB_NODELIST="n[1-2]",
                         SLURM_JOB_NUM_NODES="2", SLURM_RESTART_COUNT="1", SUPERVISOR_NODE_EXCLUSION=exclusion,
                         stand_ins=stand_ins)
    assert out.returncode == LOST_CODE, out.stderr
    named = (f"node n2 (node 1 of the job) was lost: node 1 (10.0.0.2) stopped answering 30.0 s ago; the job ends "
             f"with exit code {LOST_CODE}")
    if exclusion == "0":
        assert out.stdout.splitlines() == [named, "not requeueing job 4242: node exclusion is off "
                                                  "(SUPERVISOR_NODE_EXCLUSION=0)"]
        assert calls(tmp_path, "scontrol") == []
        return
    assert out.stdout.splitlines() == [named, "requeued job 4242 without node n2 (ExcNodeList=n2); its next "
                                              "allocation resumes from the latest checkpoint"]
    assert [argv for argv, _ in calls(tmp_path, "scontrol")] == [
        ["show", "job", "-o", "4242"], ["requeue", "4242"], ["update", "JobId=4242", "ExcNodeList=n2"]]


def test_the_node_exclusion_switch_is_checked_before_the_step(tmp_path: Path) -> None:
    out = run_job_script(tmp_path, 0, SUPERVISOR_NODE_EXCLUSION="no")
    assert out.returncode == 2 and out.stderr == (
        "error: SUPERVISOR_NODE_EXCLUSION='no' must be 1 (the default: a node whose GPU failed, or that was lost, is "
        "left out of the job's next allocation) or 0 (the job fails instead)\n")
    assert calls(tmp_path, "srun") == []


def test_the_job_script_outside_a_job_is_one_line(tmp_path: Path) -> None:
    out = run_job_script(tmp_path, 0, SLURM_JOB_ID="")
    assert out.returncode == 2 and out.stderr.startswith("error: train_slurm.sbatch is a Slurm job script and "
                                                         "SLURM_JOB_ID is not set") and out.stderr.count("\n") == 1


def test_the_job_script_only_delegates() -> None:
    lines = [line for line in SCRIPT.read_text().splitlines() if line and not line.startswith("#")]
    assert lines == ["exec python3 supervisor/bootstrap.py -m supervisor.slurm.job \"$@\""]


# ---------------------------------------------------------------------------------------------------------------------
# Two nodes on loopback, described only by SLURM_* variables


def free_job_id() -> int:
    """A job id whose port pair (rendezvous, control channel) is free on loopback right now."""
    for job_id in range(os.getpid() % 10_000, 10**6, 7):
        port = slurm_layout.master_port(job_id)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            return job_id
        except OSError:
            continue
    raise RuntimeError("no job id with a free port pair")


def slurm_nodes(tmp_path: Path, *args: str, entry: Path | None, entry_args: tuple[str, ...] = (),
                tag: str = "") -> list[Run]:
    """One supervisor per fake node, with no multi-node flag: only what srun would put in its environment."""
    job_id = str(free_job_id())
    nodes = []
    for node in (0, 1):
        env = clean_env(SLURM_JOB_ID=job_id, SLURM_NNODES="2", SLURM_NODEID=str(node), SLURM_NTASKS="2",
                        SLURM_JOB_NODELIST="localhost,localhost", SUPERVISOR_CONTROL_SECRET=CONTROL_SECRET)
        nodes.append(start(tmp_path, "--grace-period", "20", *args, entry=entry, entry_args=entry_args, env=env,
                           tag=f"{tag}{node}"))
    return nodes


def test_two_slurm_nodes_find_each_other(tmp_path: Path) -> None:
    nodes = slurm_nodes(tmp_path, "--nproc", "2", entry=ROOT / "tests" / "rank_scripts" / "worker.py",
                        entry_args=("--steps", "5"))
    for node in nodes:
        node.wait()
    assert [n.returncode for n in nodes] == [0, 0], nodes[0].stderr + nodes[1].stderr
    for rank, node in enumerate(nodes):
        assert f"SLURM_NODEID={rank}, SLURM_JOB_NODELIST=localhost,localhost): --nnodes 2 --node-rank {rank} " \
               f"--master-addr localhost --master-port " in node.stderr
    ranks = sorted(int(r) for r in re.findall(r"rank (\d+) started", nodes[0].stdout + nodes[1].stdout))
    assert ranks == [0, 1, 2, 3]


def wait_for(path: Path, pattern: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not re.search(pattern, path.read_text(errors="replace")):
        if time.monotonic() > deadline:
            raise AssertionError(f"no {pattern!r} in {path} after {timeout} s:\n{path.read_text()[-3000:]}")
        time.sleep(0.1)


@pytest.mark.slow
def test_time_limit_warning_checkpoints_and_the_requeued_job_resumes(tmp_path: Path, token_cache_dir: Path) -> None:
    """SIGUSR1 to both node supervisors (Slurm's `--signal=USR1@...` without `B:`): every rank finishes its step, the
    group checkpoints, both exit 138; the same command again (`--resume auto`, as the requeued job runs) continues
    there. In the slow tier: the Slurm tier (tests/slurm) runs the same through a real Slurm's warning and requeue."""
    ckpt = tmp_path / "ckpt"
    layer = merged(TINY, {"data": {"cache_dir": str(token_cache_dir)}, "checkpoint": {"dir": str(ckpt)},
                          "training": {"max_steps": 60}, "logging": {"log_interval": 1}})
    args = ("--debug", "--nproc", "1", "--no-footer", *set_flags(layer), "--resume", "auto")
    first = slurm_nodes(tmp_path, *args, entry=None, tag="first")
    wait_for(first[0].out_path, r"CPU0:INFO \| \[GPU 0\] Step \[3/60\]")
    for node in first:
        os.kill(node.proc.pid, signal.SIGUSR1)
    for node in first:
        node.wait(timeout=120)
    assert [n.returncode for n in first] == [138, 138], first[0].stderr[-3000:] + first[1].stderr[-3000:]
    assert "SIGUSR1: stopping every rank" in first[0].stderr + first[1].stderr
    saved = layout.latest_checkpoint(ckpt)
    assert saved is not None, first[0].stdout[-3000:]
    stopped_at = layout.step_of(saved)
    assert stopped_at is not None
    assert 3 <= stopped_at < 60
    assert f"stopping after step {stopped_at - 1}: a stop was requested" in first[0].stdout

    again = slurm_nodes(tmp_path, *args, entry=None, tag="again")
    for node in again:
        node.wait(timeout=240)
    assert [n.returncode for n in again] == [0, 0], again[0].stderr[-3000:] + again[1].stderr[-3000:]
    assert re.search(rf"CPU0:INFO \| resumed from \S+{saved.name} at step {stopped_at} \(loaded in ", again[0].stdout)
    assert "step 60/60" in again[0].stderr
