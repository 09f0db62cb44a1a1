"""Two node supervisors on loopback: a failure on either node stops the ranks of both, through the control channel."""

from __future__ import annotations

import os
import re
import signal
import socket
import time

from rank_scripts.harness import CONTROL_SECRET, Run, clean_env, start, survivors


def free_port_pair() -> int:
    """A port P such that P and P+1 (the control channel) are both free right now."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 65534:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + 1))
                    return port
                except OSError:
                    continue
    raise RuntimeError("no free port pair")


def two_nodes(tmp_path, node0_args=(), node1_args=(), node1_delay: float = 0.0) -> tuple[Run, Run]:
    port = str(free_port_pair())
    common = ("--nproc", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", port,
              "--grace-period", "5")
    env = clean_env(SUPERVISOR_CONTROL_SECRET=CONTROL_SECRET)
    node0 = start(tmp_path, *common, "--node-rank", "0", entry_args=node0_args, env=env, tag="0")
    time.sleep(node1_delay)
    node1 = start(tmp_path, *common, "--node-rank", "1", entry_args=node1_args, env=env, tag="1")
    return node0, node1


def test_failure_on_node1_stops_node0(tmp_path):
    node0, node1 = two_nodes(tmp_path, node1_args=("--fail", "exit", "--fail-rank", "3", "--code", "7",
                                                   "--fail-step", "20", "--children", "1"))
    node1.wait()
    node0.wait(timeout=20)
    assert node1.returncode == 7, node1.stderr[-2000:]
    assert node0.returncode == 7, node0.stderr[-2000:]
    assert "node 1: CPU1 failed with exit 7" in node0.stderr
    assert "rank 3" in node1.stderr and "failed first" in node1.stderr
    assert survivors(node0.pids() + node1.pids(), timeout=0.5) == []


def test_failure_on_node0_stops_node1(tmp_path):
    node0, node1 = two_nodes(tmp_path, node0_args=("--fail", "sigkill", "--fail-rank", "0", "--fail-step", "20"))
    node0.wait()
    node1.wait(timeout=20)
    assert (node0.returncode, node1.returncode) == (137, 137), node1.stderr[-2000:]
    assert "node 0: CPU0 failed with SIGKILL (137)" in node1.stderr


def test_a_node_that_connects_after_the_failure_still_hears_of_it(tmp_path):
    """Node 0 fails before node 1 has even started: node 0 waits (within its grace period) to hand over the abort."""
    node0, node1 = two_nodes(tmp_path, node0_args=("--fail", "exit", "--fail-rank", "0", "--fail-step", "1",
                                                   "--code", "5"), node1_delay=1.0)
    node1.wait(timeout=20)
    node0.wait(timeout=20)
    assert (node0.returncode, node1.returncode) == (5, 5), node1.stderr[-2000:]
    assert "node 0: CPU0 failed with exit 5" in node1.stderr


def test_a_vanished_node_supervisor_stops_the_others(tmp_path):
    node0, node1 = two_nodes(tmp_path)
    pids1 = node1.wait_for_ranks(2)
    node0.wait_for_ranks(2)
    time.sleep(0.3)  # connected by now (the client retries every 0.2 s)
    os.kill(node1.proc.pid, signal.SIGKILL)
    node0.wait(timeout=20)
    assert node0.returncode == 1, node0.stderr[-2000:]
    assert "lost contact with node 1's supervisor" in node0.stderr
    assert survivors(node0.pids() + pids1, timeout=3.0) == []


def test_both_nodes_finish(tmp_path):
    node0, node1 = two_nodes(tmp_path, node0_args=("--steps", "5"), node1_args=("--steps", "5"))
    node0.wait()
    node1.wait()
    assert (node0.returncode, node1.returncode) == (0, 0), node0.stderr + node1.stderr
    ranks = sorted(int(r) for r in re.findall(r"rank (\d+) started", node0.stdout + node1.stdout))
    assert ranks == [0, 1, 2, 3]  # global rank = node rank × ranks per node + local rank
