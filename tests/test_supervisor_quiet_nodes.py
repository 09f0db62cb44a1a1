"""A program written for torchrun (it reports nothing) on several node supervisors on loopback (127.0.0.1-3), one rank
each, in one gloo group: the group is stalled only when no rank of any node made progress for the hang timeout and
the stacks show a stall. A rank computing on one node keeps the others, waiting for it, alive; a rank asleep in its
own code is quiet, said on every node, and the run goes on; ranks that all wait in collectives are a stall; a rank
frozen on one node is named on every node.

Each test has a longer variant in the slow tier, with the figures of issue 40 (30 s of computing at a 10 s hang
timeout, 40 s asleep at 8 s)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time

import pytest
from rank_scripts.harness import CONTROL_SECRET, ROOT, Run, clean_env, free_port_pair, start, survivors

PROGRAM = ROOT / "tests" / "torchrun_programs" / "quiet_rank.py"
QUIET_LINE = re.compile(r"^supervisor: CPU0 \(rank (\d), node (\d)\) is quiet in a sleep \(clock_nanosleep\) at quiet "
                        r"\(torchrun_programs/quiet_rank\.py:\d+\); the others wait for it in a collective; not a "
                        r"stall$", re.MULTILINE)


def address(node: int) -> str:
    return f"127.0.0.{node + 1}"


def nodes(tmp_path, count: int, hang_timeout: str, *program_args: str) -> list[Run]:
    """`count` node supervisors, one rank each, running ``quiet_rank.py PROGRAM_ARGS``."""
    port = free_port_pair()
    return [start(tmp_path, "--nnodes", str(count), "--node-rank", str(node), "--master-addr", address(0),
                  "--master-port", str(port), "--local-addr", address(node), "--nproc-per-node", "1",
                  "--hang-timeout", hang_timeout, "--node-timeout", "10", "--grace-period", "2", str(PROGRAM),
                  *program_args, entry=None, env=clean_env(SUPERVISOR_CONTROL_SECRET=CONTROL_SECRET), tag=str(node))
            for node in range(count)]


def finished(runs: list[Run], timeout: float) -> None:
    for run in runs:
        run.wait(timeout=timeout)
        assert run.returncode == 0, run.stderr[-3000:]
        assert "stalled" not in run.stderr, run.stderr[-3000:]


def computes_while_the_other_waits(tmp_path, hang_timeout: str, seconds: float) -> None:
    runs = nodes(tmp_path, 2, hang_timeout, "--rank", "0", "--seconds", str(seconds), "--how", "compute")
    finished(runs, timeout=seconds + 90)
    for rank, run in enumerate(runs):
        assert f"CPU0:rank {rank}: 4 steps" in run.stdout, run.stdout[-2000:]
        assert " is quiet in " not in run.stderr  # computing is progress: nobody needed to look


@pytest.mark.slow
def test_quiet_compute_on_one_node_keeps_the_other_node_waiting_for_it(tmp_path):
    """Node 0's rank computes for 12 s without a line while node 1's waits in its all-reduce, with a 5 s hang
    timeout: node 1's own rank shows no sign of life, but node 0 says its rank does, and both finish."""
    computes_while_the_other_waits(tmp_path, "5", 12)


@pytest.mark.slow
def test_thirty_seconds_of_quiet_compute_at_a_ten_second_hang_timeout(tmp_path):
    computes_while_the_other_waits(tmp_path, "10", 30)


def sleeps_on_node_2_of_3(tmp_path, hang_timeout: str, seconds: float) -> None:
    runs = nodes(tmp_path, 3, hang_timeout, "--rank", "2", "--seconds", str(seconds))
    finished(runs, timeout=seconds + 90)
    for run in runs:
        said = QUIET_LINE.findall(run.stderr)
        assert said == [("2", "2")], run.stderr[-3000:]  # the same line on every node, once


def test_a_rank_asleep_on_node_2_of_3_is_named_quiet_on_every_node(tmp_path):
    """Rank 2 (node 2) sleeps 12 s in its own code while ranks 0 and 1 wait for it in their all-reduce, with a 5 s
    hang timeout: no rank of any node made progress, every node reads its rank's stack, and node 2's finding (asleep
    in its own code) makes the group quiet, not stalled, on every node; all three finish."""
    sleeps_on_node_2_of_3(tmp_path, "5", 12)


@pytest.mark.slow
def test_forty_seconds_asleep_on_node_2_of_3_at_an_eight_second_hang_timeout(tmp_path):
    sleeps_on_node_2_of_3(tmp_path, "8", 40)


@pytest.mark.slow
def test_ranks_that_all_wait_in_collectives_on_two_nodes_are_a_stall(tmp_path):
    """Rank 1 (node 1) all-reduces on a group rank 0 never uses, and rank 0 on the default one: every rank of every
    node waits in a collective, nobody is in its own code. Each node's finding says so, and both stop, exit 124 (a
    node may hear the other's stall before its own finding is in: it reads its rank then, which waits as well). In
    the slow tier: the default suite names a stall across nodes in tests/test_supervisor_nodes.py."""
    runs = nodes(tmp_path, 2, "5", "--rank", "1", "--seconds", "0", "--how", "cross")
    for run in runs:
        run.wait(timeout=90)
    assert any(re.search(r"no rank has written output or used CPU time for [\d.]+ s and the stacks read from "
                         r"outside \(py-spy\) show a stall; stopping", run.stderr) for run in runs), runs[0].stderr
    for run in runs:
        assert run.returncode == 124, run.stderr[-3000:]
        assert re.search(r"run failed after .*: stalled \(no progress for (\d+)\.\d s\); the evidence singles out no "
                         r"rank", run.stderr), run.stderr[-3000:]
        assert int(re.search(r"run failed after .*no progress for (\d+)", run.stderr)[1]) >= 2  # silent, not 0.0 s
        assert " is quiet in " not in run.stderr


@pytest.mark.slow
def test_a_rank_frozen_on_node_2_of_3_is_named_on_every_node(tmp_path):
    """Rank 2 (node 2) is SIGSTOPped while it sleeps: a frozen rank is a stall. Node 2's rank is alone on its node,
    stopped, and the others run: every node's headline names it, by its process state."""
    ready = tmp_path / "ready"
    ready.mkdir()
    runs = nodes(tmp_path, 3, "5", "--rank", "2", "--step", "1", "--seconds", "600", "--ready", str(ready))
    deadline = time.monotonic() + 60
    while not (pid_file := ready / "rank2.pids").exists():
        assert time.monotonic() < deadline and all(r.proc.poll() is None for r in runs), runs[2].err_path.read_text()
        time.sleep(0.05)
    frozen = int(pid_file.read_text())
    time.sleep(0.5)  # into its sleep
    os.kill(frozen, signal.SIGSTOP)
    try:
        for run in runs:
            run.wait(timeout=90)
            assert run.returncode == 124, run.stderr[-3000:]
            assert re.search(r"run failed after .*: node 2: CPU0 \(rank 2\) stalled while its process is stopped "
                             r"\(SIGSTOP, or a debugger\) in quiet \(torchrun_programs/quiet_rank\.py:\d+\)",
                             run.stderr), run.stderr[-3000:]
        assert survivors([frozen], timeout=5) == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(frozen, signal.SIGKILL)
