"""The shipped `train_slurm.sbatch` under a real Slurm (tier `slurm`: ``bash run_tests.sh -m slurm``).

munged, slurmctld and three slurmd (nodes n1, n2 and n3, all this host) on loopback (tests/slurm/slurm_cluster.py);
every job is the job script as a user submits it, with CPU ranks of the debug preset: ``sbatch --nodes=2
--gpus-per-node=0 --cpus-per-task=1 train_slurm.sbatch --debug ...`` (one rank per node, one thread per rank: the nodes
share this machine's cores), on n1 and n2 unless one is left out. Skipped, with the reason, where Slurm is not
installed or cannot start.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import psutil
import pytest
from slurm_cluster import Cluster, Job, missing

from rank_scripts.harness import ROOT, clean_env
from supervisor.control.wire import LOST_CODE

pytestmark = pytest.mark.slurm
SCRIPT = ROOT / "train_slurm.sbatch"
JOB_TIMEOUT = 300.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    reason = missing()
    if reason is not None:
        pytest.skip(reason)
    found = Cluster(tmp_path_factory.mktemp("slurm"))
    try:
        found.start()
    except RuntimeError as e:
        found.stop()
        pytest.skip(f"Slurm did not come up on loopback: {e}")
    yield found
    found.stop()


def submit(cluster: Cluster, tmp: Path, cache: Path, *flags: str, options: tuple[str, ...] = (),
           **env: str) -> Job:
    """The job script on two nodes, as a user submits it; the run's folders in `tmp`, the token cache shared."""
    return cluster.sbatch(
        SCRIPT, ["--nodes=2", "--gpus-per-node=0", "--cpus-per-task=1", *options],
        ["--debug", "--nproc", "1", "--master-addr", "127.0.0.1", "--log-dir", str(tmp / "logs"),
         "--set", f"checkpoint.dir={tmp / 'ckpt'}", "--set", f"data.cache_dir={cache}", *flags],
        output=tmp / "job.out", cwd=ROOT, env=clean_env(PYTHON=sys.executable, OMP_NUM_THREADS="1", **env))


def job_processes(job: Job) -> list[psutil.Process]:
    """The job's own processes (job script, supervisors, ranks): those with its SLURM_JOB_ID in their environment."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("SLURM_JOB_ID") == job.id:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def wait_for_output(job: Job, pattern: str, timeout: float = JOB_TIMEOUT) -> re.Match:
    deadline = time.monotonic() + timeout
    while not (found := re.search(pattern, job.text())):
        if time.monotonic() > deadline:
            raise AssertionError(f"no {pattern!r} in job {job.id}'s output after {timeout:g} s:\n{job.text()[-4000:]}")
        time.sleep(0.5)
    return found


def said_at(log: Path, text: str) -> datetime:
    """When supervisor.log recorded `text` (its time stamps have whole seconds)."""
    line = next(line for line in log.read_text().splitlines() if text in line)
    return datetime.strptime(line[:19], "%Y-%m-%d %H:%M:%S")


def test_both_nodes_train_to_the_end(cluster: Cluster, tmp_path: Path, token_cache_dir: Path) -> None:
    job = submit(cluster, tmp_path, token_cache_dir, "--max-steps", "6")
    info = cluster.wait(job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), JOB_TIMEOUT)
    out = job.text()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), out[-4000:]
    for node in (0, 1):
        assert f"SLURM_NODEID={node}, SLURM_JOB_NODELIST=n[1-2]): --nnodes 2 --node-rank {node} --master-port" in out
    assert out.count("run finished") == 2 and "step 6/6" in out
    assert "world size: 2 (gloo)" in out


def test_the_time_limit_warning_checkpoints_requeues_and_resumes(cluster: Cluster, tmp_path: Path,
                                                                 token_cache_dir: Path) -> None:
    """``--time=3 --signal=B:USR1@90``: the warning comes while the ranks train (Slurm sends it up to a minute early,
    so between 30 and 90 s into the job; each step is paced to at least 0.5 s, so the 160 steps cannot end first); the
    job script passes it to node 0's supervisor, which stops node 1's through the control channel; every rank
    checkpoints, without a stack dump (no rank got the signal), both supervisors exit 138 and the job requeues itself.
    The test then gives the requeued job room to finish (a longer time limit); its next allocation resumes from that
    checkpoint and trains to the end."""
    job = submit(cluster, tmp_path, token_cache_dir, "--max-steps", "160", "--set", "debug.inject_fault=slow",
                 "--set", "debug.inject_fault_step=1", "--set", "debug.inject_fault_delay_s=0.5",
                 options=("--time=3", "--signal=B:USR1@90"))
    cluster.wait(job, ("PENDING",), JOB_TIMEOUT, restarts=1)
    assert psutil.wait_procs(job_processes(job), timeout=60)[1] == []  # the first allocation is over
    first = job.text()
    assert "time-limit warning: passing SIGUSR1 on to the supervisor on node n1 (pid " in first, first[-4000:]
    assert "supervisor: SIGUSR1: stopping every rank" in first and "requeueing job" in first, first[-4000:]
    assert "node 0: its supervisor stopped with SIGUSR1 (138); stopping this node's ranks" in first, first[-4000:]
    rank_logs = list((tmp_path / "logs").glob("*/cpu*.log"))
    assert len(rank_logs) == 2  # the first allocation's two ranks
    for log in rank_logs:  # faulthandler's header: a rank that got SIGUSR1 would have dumped its stacks here
        assert "most recent call first" not in log.read_text(), log
    saves = re.findall(r"checkpoint saved: \S+/(step_\d+)", first)
    assert saves, f"the warning came before the first checkpoint:\n{first[-4000:]}"
    saved = saves[-1]
    cluster.run("scontrol", "update", f"JobId={job.id}", "TimeLimit=15")
    info = cluster.wait(job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), JOB_TIMEOUT)
    out = job.text()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), (info, out[-4000:])
    assert f"resumed from {tmp_path / 'ckpt' / saved} at step {int(saved[5:])}" in out[len(first):]
    assert "step 160/160" in out[len(first):]


def test_scancel_leaves_no_process(cluster: Cluster, tmp_path: Path, token_cache_dir: Path) -> None:
    job = submit(cluster, tmp_path, token_cache_dir, "--max-steps", "100000")
    wait_for_output(job, r"Step \[2/")
    processes = job_processes(job)
    assert len(processes) >= 4  # the job script, srun, two supervisors, two ranks (and their shells)
    cluster.run("scancel", job.id)
    cluster.wait(job, ("CANCELLED",), 60)
    gone, alive = psutil.wait_procs(processes, timeout=60)
    assert alive == [] and job_processes(job) == [], [p.cmdline() for p in alive]


def test_a_failing_rank_fails_the_job_naming_it(cluster: Cluster, tmp_path: Path, token_cache_dir: Path) -> None:
    """Rank 1 (node 1's CPU0) exits 7 at step 3: node 1's supervisor names it, node 0's stops its rank within
    seconds on hearing it, and the job fails with that exit code."""
    job = submit(cluster, tmp_path, token_cache_dir, "--max-steps", "1000", "--set", "debug.inject_fault=exit",
                 "--set", "debug.inject_fault_step=3", "--set", "debug.inject_fault_rank=1",
                 "--set", "debug.inject_fault_code=7")
    info = cluster.wait(job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), JOB_TIMEOUT)
    out = job.text()
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "7:0"), out[-4000:]
    assert "CPU0 (rank 1, pid" in out and "failed with exit 7; stopping the other ranks" in out
    assert "node 1: CPU0 failed with exit 7; stopping this node's ranks" in out
    logs = {path.read_text().count("--node-rank 1"): path for path in (tmp_path / "logs").glob("*/supervisor.log")}
    failed = said_at(logs[1], "failed with exit 7; stopping the other ranks")
    heard = said_at(logs[0], "node 1: CPU0 failed with exit 7")
    assert (heard - failed).total_seconds() <= 2


def test_a_gpu_fault_requeues_the_job_without_its_node(cluster: Cluster, tmp_path: Path,
                                                       token_cache_dir: Path) -> None:
    """n2 has a fake GPU (the others CPU ranks); its rank (rank 1) loses it at step 3, after the checkpoint of step 2.
    n2's supervisor finds the GPU lost and records the fault; the job script requeues the job with n2 in ExcNodeList.
    The test then takes the fault out of the job's --config file (the next allocation's ranks would fire it again on
    a CPU rank), and the job runs again on n1 and n3, resumes from step 2 and trains to the end."""
    fault = tmp_path / "fault.json"
    fault.write_text(json.dumps({"debug": {"inject_fault": "gpu_lost", "inject_fault_step": 3,
                                           "inject_fault_rank": 1}}))
    job = submit(cluster, tmp_path, token_cache_dir, "--max-steps", "6", "--set", "checkpoint.interval=2",
                 "--config", str(fault), FAKE_GPU_NODE="n2", FAKE_GPU_STATE=str(tmp_path / "gpu_state.json"))
    cluster.wait(job, ("PENDING",), JOB_TIMEOUT, restarts=1)
    fault.write_text("{}")
    assert cluster.job(job)["ExcNodeList"] == "n2"
    assert psutil.wait_procs(job_processes(job), timeout=60)[1] == []  # the first allocation is over
    first = job.text()
    assert "GPU0 (rank 1" in first and "GPU fault: GPU 0 (NVML: lost, its error: " in first, first[-4000:]
    assert "GPU fault on node n2: GPU 0 (NVML: lost, its error: " in first
    assert f"requeued job {job.id} without node n2 (ExcNodeList=n2); its next allocation resumes from the latest " \
           f"checkpoint" in first
    [record] = [json.loads(path.read_text()) for path in (tmp_path / "logs").glob("*/gpu_fault.json")]
    assert (record["node"], list(record["gpus"]), record["slurm_job_id"], record["slurm_restart_count"]) == \
           ("n2", ["0"], job.id, 0)
    info = cluster.wait(job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), JOB_TIMEOUT)
    second = job.text()[len(first):]
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), (info, second[-4000:])
    assert "SLURM_JOB_NODELIST=n[1,3]" in second
    assert f"resumed from {tmp_path / 'ckpt' / 'step_000002'} at step 2" in second
    assert "step 6/6" in second


def test_a_frozen_node_is_named_left_out_and_the_job_resumes_without_it(cluster: Cluster, tmp_path: Path,
                                                                         token_cache_dir: Path) -> None:
    """Every process of the job on n2 (its supervisor and its rank) is frozen (SIGSTOP) while the job trains, after
    the checkpoint of step 2: n1's supervisor names node 1 once it has been silent for --node-timeout, stops its own
    rank and exits with the lost node's code; the step ends (srun --kill-on-bad-exit: Slurm kills the frozen task),
    nothing of it is left running, and the job script names n2 and requeues the job without it. The next allocation
    (n1 and n3) resumes from the checkpoint and trains to the end. Rank 0 sleeps 0.3 s a step in the first allocation
    (the --config file, emptied before the freeze), so the freeze comes while it trains."""
    slow = tmp_path / "slow.json"
    slow.write_text(json.dumps({"debug": {"inject_fault": "slow", "inject_fault_step": 0, "inject_fault_rank": 0,
                                          "inject_fault_delay_s": 0.3}}))
    job = submit(cluster, tmp_path, token_cache_dir, "--max-steps", "10", "--set", "checkpoint.interval=2",
                 "--node-timeout", "5", "--grace-period", "5", "--config", str(slow))
    wait_for_output(job, r"Step \[3/")
    slow.write_text("{}")
    frozen = [p for p in job_processes(job) if p.environ().get("SLURMD_NODENAME") == "n2"]
    assert len(frozen) >= 2, [p.cmdline() for p in frozen]  # the supervisor (and its sentinel), the rank
    for proc in frozen:
        proc.suspend()
    cluster.wait(job, ("PENDING",), JOB_TIMEOUT, restarts=1)
    assert cluster.job(job)["ExcNodeList"] == "n2"
    alive = psutil.wait_procs(frozen, timeout=60)[1]
    assert alive == [], [p.cmdline() for p in alive]  # the first allocation is over, nothing of it left
    first = job.text()
    assert "node 1 (127.0.0.1) stopped answering" in first, first[-4000:]
    assert "node n2 (node 1 of the job) was lost: " in first and f"exit code {LOST_CODE}" in first, first[-4000:]
    assert f"requeued job {job.id} without node n2 (ExcNodeList=n2); its next allocation resumes from the latest " \
           f"checkpoint" in first, first[-4000:]
    info = cluster.wait(job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), JOB_TIMEOUT)
    second = job.text()[len(first):]
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), (info, second[-4000:])
    assert "SLURM_JOB_NODELIST=n[1,3]" in second
    resumed = rf"resumed from {re.escape(str(tmp_path / 'ckpt'))}/step_\d+ at step [2-9]"
    assert re.search(resumed, second), second[-4000:]
    assert "step 10/10" in second
    assert job_processes(job) == []
