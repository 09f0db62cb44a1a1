"""Three node supervisors on three loopback addresses (127.0.0.1-3; Linux routes all of 127/8 to lo): a node that
freezes, dies or never joins is named on every other node, and every node stops with the code for a lost node.

Three variants are in the slow tier: node 0 frozen (the default suite freezes nodes 1 and 2, and kills node 0), a
node named by its silence after a stall (the default suite names a stall by the evidence), and a supervisor frozen
then resumed (the default suite's frozen nodes stay frozen)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
from test_supervisor_multinode import FakeNode

from rank_scripts.harness import CONTROL_SECRET, ROOT, Run, clean_env, free_port_pair, start, survivors
from supervisor.control.wire import LOST_CODE
from supervisor.gpus.exclusion import LOST_NODE_FILE
from supervisor.group.hangs import NOTHING_STALLED
from supervisor.group.stop import RENDEZVOUS_WAIT

NODES = 3
TIMEOUTS = ("--node-timeout", "3", "--join-timeout", "6", "--grace-period", "2")


def address(node: int) -> str:
    return f"127.0.0.{node + 1}"


def layout(port: int, rank: int) -> tuple[str, ...]:
    return ("--nnodes", str(NODES), "--node-rank", str(rank), "--master-addr", address(0), "--master-port", str(port),
            "--local-addr", address(rank))


def node(tmp_path, port: int, rank: int, *flags: str, secret: str = CONTROL_SECRET,
         entry_args: tuple[str, ...] = ()) -> Run:
    return start(tmp_path, "--nproc", "1", *layout(port, rank), *TIMEOUTS, *flags,
                 env=clean_env(SUPERVISOR_CONTROL_SECRET=secret), tag=str(rank), entry_args=entry_args)


def joined(tmp_path, *flags: str, entry_args: dict[int, tuple[str, ...]] | None = None) -> list[Run]:
    """All three nodes started, joined and training (`entry_args`: a node's rank program's arguments)."""
    port = free_port_pair()
    nodes = [node(tmp_path, port, rank, *flags, entry_args=(entry_args or {}).get(rank, ())) for rank in range(NODES)]
    for rank in range(1, NODES):
        nodes[0].wait_for_stderr(f"node {rank} joined from {address(rank)}")
    for run in nodes:
        run.wait_for_ranks(1)
    return nodes


def freeze(run: Run) -> list[int]:
    """SIGSTOP a node: its supervisor and its ranks. Returns the pids, to SIGKILL at the end."""
    pids = [run.proc.pid, *run.pids()]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    return pids


def thaw(pids: list[int]) -> None:
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
        os.kill(pid, signal.SIGCONT)


TRAINING = ("--gloo", "--on-term", "ignore", "--chatter", "1", "--fail-rank", "-1")  # one gloo group, a line a step


def training_until_step_3(run: Run, rank: int) -> None:
    """Wait until `run`'s rank has printed its step 3: every rank of the group has reported a step by then."""
    deadline = time.monotonic() + 60
    while f"rank {rank} step 3 " not in run.out_path.read_text():
        assert time.monotonic() < deadline and run.proc.poll() is None, run.err_path.read_text()[-3000:]
        time.sleep(0.05)


def held_line(node: int) -> str:
    return (f"CPU0 still training {RENDEZVOUS_WAIT:g} s after SIGTERM while node {node} is lost: its "
            f"collectives wait for that node's ranks, so it cannot reach a checkpoint; SIGKILL now rather than after "
            f"the 60 s grace period")


def test_frozen_nodes_are_named_and_the_rank_they_hold_is_not_given_the_grace_period(tmp_path):
    """The ranks train in one gloo group across the nodes; node 0's is a torchrun program that answers SIGTERM with a
    flag for its loop (reporting nothing: its stack is read from outside), with a 60 s grace period. Nodes 1 and 2
    freeze: node 0 names them, and its rank, waiting in an all-reduce for theirs, cannot reach a checkpoint: SIGKILL
    follows SIGTERM after the short wait, not the grace period."""
    port = free_port_pair()
    program = ROOT / "tests" / "torchrun_programs" / "allreduce_loop.py"
    nodes = [start(tmp_path, "--nproc-per-node", "1", *layout(port, 0), *TIMEOUTS, "--grace-period", "60",
                   str(program), "--save-on-term", "--step-time", "0.02", "--ready", str(tmp_path / "pids0"),
                   entry=None, env=clean_env(SUPERVISOR_CONTROL_SECRET=CONTROL_SECRET), tag="0"),
             *(node(tmp_path, port, rank, entry_args=TRAINING) for rank in (1, 2))]
    training_until_step_3(nodes[2], 2)
    frozen = freeze(nodes[1]) + freeze(nodes[2])
    try:
        run = nodes[0].wait(timeout=45)  # well within the grace period
        assert run.returncode == LOST_CODE, run.stderr[-3000:]
        lost = int(re.search(r"node (\d) \(127\.0\.0\.\d\) stopped answering", headline(run))[1])
        record = json.loads((run.run_dir() / LOST_NODE_FILE).read_text())  # for a job script (Slurm's)
        assert record["node"] == lost and headline(run).endswith(f": {record['why']}"), record
        before, after = held_line(lost).split(":", 1)  # py-spy's frame between: torch.distributed's, in the all-reduce
        assert re.search(rf"{re.escape(before)} \(CPU0 in .+ \(distributed/\S+\)\):{re.escape(after)}", run.stderr), \
            run.stderr[-3000:]
        assert re.search(r"CPU0 +\d+ +\d+ +SIGKILL \(137\) +killed \(SIGKILL\)", run.stderr), run.stderr[-3000:]
        assert len(run.pids()) == 1 and survivors(run.pids(), timeout=5) == []
    finally:
        thaw(frozen)


def test_ranks_held_by_another_nodes_failed_rank_are_killed_without_the_grace_period(tmp_path):
    """Node 2's rank is SIGKILLed; its node stops every node. Their ranks, whose collectives wait for it (SIGTERM
    ignored, as a rank waiting in NCCL never runs its handler), get SIGKILL 2 s after SIGTERM instead of at the end
    of the 60 s grace period."""
    held = ("--on-term", "ignore", "--fail-rank", "-1")
    nodes = joined(tmp_path, "--grace-period", "60",
                   entry_args={0: held, 1: held, 2: ("--fail", "sigkill", "--fail-rank", "2", "--fail-step", "20")})
    for run in nodes:
        run.wait(timeout=45)  # well within the grace period
        assert run.returncode == 137, run.stderr[-3000:]
    for run in nodes[:2]:
        assert (f"CPU0 still training {RENDEZVOUS_WAIT:g} s after SIGTERM while CPU0 of node 2 is gone: its "
                f"collectives wait for CPU0 of node 2, so it cannot reach a checkpoint; SIGKILL now rather than after "
                f"the 60 s grace period") in run.stderr, run.stderr[-3000:]
    assert survivors(nodes[0].pids() + nodes[1].pids(), timeout=5) == []


@pytest.mark.slow
def test_node_0_frozen_is_named_by_the_others(tmp_path):
    """The others' ranks, training in one gloo group with node 0's and slow to leave on SIGTERM (a 60 s grace period),
    are held by it: the first node to kill its rank breaks the other's collective, so each rank ends within the short
    wait, by SIGKILL or by the error of its broken all-reduce."""
    nodes = joined(tmp_path, "--grace-period", "60", entry_args=dict.fromkeys(range(NODES), TRAINING))
    training_until_step_3(nodes[2], 2)
    frozen = freeze(nodes[0])
    try:
        for run in nodes[1:]:
            run.wait(timeout=45)  # well within the grace period
            assert run.returncode == LOST_CODE, run.stderr[-3000:]
            assert "node 0 (127.0.0.1) stopped answering" in run.stderr, run.stderr[-3000:]
            assert "one still training in 2 s (it cannot reach a checkpoint while node 0 is lost)" in run.stderr
        assert any(held_line(0) in run.stderr for run in nodes[1:]), nodes[1].stderr[-3000:]
        assert survivors(nodes[1].pids() + nodes[2].pids(), timeout=5) == []
    finally:
        thaw(frozen)


def test_node_0_killed_is_named_by_the_others(tmp_path):
    nodes = joined(tmp_path, entry_args={1: ("--on-term", "ignore")})
    os.kill(nodes[0].proc.pid, signal.SIGKILL)
    for run in nodes[1:]:
        run.wait(timeout=60)
        assert run.returncode == LOST_CODE, run.stderr[-3000:]
        assert "lost contact with node 0's supervisor (127.0.0.1): its connection closed" in run.stderr
    assert "CPU0 still running 2 s after SIGTERM; SIGKILL" in nodes[1].stderr  # said, not silent
    assert survivors(nodes[0].pids() + nodes[1].pids() + nodes[2].pids(), timeout=5) == []


def test_a_node_with_another_secret_is_named_at_once_and_the_join_is_bounded(tmp_path):
    port = free_port_pair()
    nodes = [node(tmp_path, port, 0), node(tmp_path, port, 1)]
    nodes[0].wait_for_stderr("node 1 joined from 127.0.0.2")
    nodes.append(node(tmp_path, port, 2, secret="another-secret-0123456789"))
    nodes[0].wait_for_stderr("refused a hello as node 2 from 127.0.0.3")  # at once: node 0 is still waiting for node 2
    nodes[2].wait(timeout=30)
    assert nodes[2].returncode == LOST_CODE
    assert "node 0's control server refused this node's hello: SUPERVISOR_CONTROL_SECRET differs" in nodes[2].stderr
    for run in nodes[:2]:  # their ranks wait for every node: none started
        run.wait(timeout=60)
        assert run.returncode == LOST_CODE, run.stderr[-3000:]
        assert re.search(r"supervisor: node 2 never joined: .* within 6 s \(--join-timeout\); a hello as node 2 from "
                         r"127\.0\.0\.3 was refused \(.*\); no rank was started; exit code 125$", run.stderr, re.M), \
            run.stderr[-3000:]
        assert "CPU0:" not in run.stdout + run.stderr


def headline(run: Run) -> str:
    """The report's first line: ``run stopped after ...: <why>`` (or ``run failed after``)."""
    return next(line for line in run.stderr.splitlines() if re.match(r"supervisor: run \w+ after ", line))


def test_a_stall_is_named_on_every_node_by_the_node_whose_evidence_names_it(tmp_path):
    """Node 1's rank hangs in its own code: node 1's watchdog trips, the others read their own ranks' evidence
    (still making progress: nothing of theirs stalled), and every node's headline names node 1's rank."""
    nodes = joined(tmp_path, "--hang-timeout", "3",
                   entry_args={1: ("--fail", "hang", "--fail-rank", "1", "--fail-step", "10")})
    for run in nodes:
        run.wait(timeout=60)
    for rank, run in enumerate(nodes):
        assert run.returncode == 124, run.stderr[-3000:]
        assert "node 1: CPU0 (rank 1) stalled at step" in headline(run), run.stderr[-3000:]
        said = verdicts(run)  # every node's report: what each node's evidence said, its own and the others'
        assert sorted(said) == [f"node {n}{' (this node)' if n == rank else ''}" for n in range(NODES)], said
        for n, (node_name, text) in enumerate(sorted(said.items())):
            assert text.startswith("CPU0 (rank 1) stalled at step" if n == 1 else NOTHING_STALLED), (node_name, text)


def test_a_rank_in_its_own_code_is_named_on_every_node_while_the_others_wait_for_it(tmp_path):
    """The ranks train in one gloo group across the three nodes, reporting progress: rank 2 (node 2) hangs in its own
    code before its all-reduce of step 8 while ranks 0 and 1 wait in theirs. Every node's watchdog trips at about the
    same moment, and the node whose rank merely waits (and tripped first) names nobody: every node's headline names
    node 2's rank, from node 2's evidence."""
    nodes = joined(tmp_path, "--hang-timeout", "3",
                   entry_args={n: ("--gloo", "--fail", "hang", "--fail-rank", "2", "--fail-step", "8")
                               for n in range(NODES)})
    for run in nodes:
        run.wait(timeout=60)
    for rank, run in enumerate(nodes):
        assert run.returncode == 124, run.stderr[-3000:]
        assert re.search(r"run \w+ after [\d:.]+ s?: node 2: CPU0 \(rank 2\) stalled at step 7 in fault "
                         r"\(rank_scripts/worker\.py:\d+\)", headline(run)), run.stderr[-3000:]
        said = verdicts(run)
        for n in (0, 1):  # they wait in the all-reduce: nothing of theirs is named
            assert "singles out no rank" in said[f"node {n}{' (this node)' if n == rank else ''}"], said


def verdicts(run: Run) -> dict[str, str]:
    """The report's list of what each node said of its own ranks: ``node 2`` (``node 0 (this node)``) → headline."""
    lines = run.stderr.splitlines()
    start = lines.index("supervisor: what each node's evidence says of its own ranks:") + 1
    found = {}
    for line in lines[start:start + NODES]:
        name, _, text = line.removeprefix("supervisor:   ").partition(": ")
        found[name] = text
    return found


@pytest.mark.slow
def test_a_node_that_gives_no_stall_verdict_is_the_culprit_by_silence(tmp_path):
    """Node 2 (the test) reports a stall and then says nothing: nodes 0 and 1, whose ranks name no culprit of their
    own, name node 2."""
    port = free_port_pair()
    nodes = [node(tmp_path, port, rank) for rank in range(2)]
    nodes[0].wait_for_stderr("node 1 joined from 127.0.0.2")
    fake = FakeNode(port + 1, node=2, ranks=1)
    for run in nodes:
        run.wait_for_ranks(1)
    fake.send("abort 2 CPU0 124")
    for run in nodes:
        run.wait(timeout=60)
        assert run.returncode == 124, run.stderr[-3000:]
        assert "node 2 sent no stall verdict within 5 s" in headline(run) and "the culprit by silence" in \
            headline(run), run.stderr[-3000:]
        assert verdicts(run)["node 2"] == "no verdict within 5 s"



def in_rendezvous_store(rank: int, pid: int, port: int) -> bool:
    """Rank 0 listens on the rendezvous port (the store it hosts), another rank is connected to it."""
    import psutil

    try:
        connections = psutil.Process(pid).net_connections("tcp")
    except psutil.Error:
        return False
    if rank == 0:
        return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in connections)
    return any(c.status == psutil.CONN_ESTABLISHED and c.raddr and c.raddr.port == port for c in connections)


def rank_pid(run: Run, program: Path) -> int:
    """The pid of the rank running ``python <program>`` under `run`'s supervisor, once it has started."""
    import psutil

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for child in psutil.Process(run.proc.pid).children():
            with contextlib.suppress(psutil.Error):
                if child.cmdline()[1:2] == [str(program)]:
                    return child.pid
        time.sleep(0.02)
    raise AssertionError(f"no rank of {program}: {run.err_path.read_text()[-2000:]}")


def test_ranks_waiting_in_the_rendezvous_for_a_node_that_never_came_are_not_given_the_grace_period(tmp_path):
    """Nodes 0 and 1 have a 60 s grace period and ranks that do not leave on SIGTERM: node 0's a torchrun program
    that sets a flag for its loop (reporting nothing: its stack is read from outside), node 1's a rank that reports
    it is joining its process group. Node 2 (the test) joins the control channel, and once both ranks wait in the
    rendezvous for its rank, which never comes, its supervisor vanishes. The ranks have nothing to save: SIGKILL
    follows SIGTERM after the short wait, not the grace period, and the console says why."""
    port = free_port_pair()
    flags = ("--node-timeout", "600", "--join-timeout", "600", "--grace-period", "60")  # the test's node never beats
    program = ROOT / "tests" / "torchrun_programs" / "allreduce_loop.py"
    nodes = [start(tmp_path, "--nproc-per-node", "1", *layout(port, 0), *flags, str(program), "--save-on-term",
                   entry=None, env=clean_env(SUPERVISOR_CONTROL_SECRET=CONTROL_SECRET), tag="0"),
             node(tmp_path, port, 1, *flags, entry_args=("--gloo", "--on-term", "ignore"))]
    nodes[0].wait_for_stderr("node 1 joined from 127.0.0.2")
    fake = FakeNode(port + 1, node=2, ranks=1)
    ranks = [rank_pid(nodes[0], program), nodes[1].wait_for_ranks(1)[0]]
    deadline = time.monotonic() + 60
    while not all(in_rendezvous_store(rank, pid, port) for rank, pid in enumerate(ranks)):
        assert time.monotonic() < deadline, "the ranks never reached the rendezvous"
        time.sleep(0.05)
    fake.sock.close()  # node 2's supervisor is gone before its rank ever started
    for run in nodes:
        run.wait(timeout=45)  # well within the grace period
        assert run.returncode == LOST_CODE, run.stderr[-3000:]
        assert "lost contact with node 2's supervisor" in headline(run), run.stderr[-3000:]
        assert f"one still in the rendezvous in {RENDEZVOUS_WAIT:g} s (it has nothing to save)" in run.stderr
        assert f"CPU0 still in the rendezvous {RENDEZVOUS_WAIT:g} s after SIGTERM" in run.stderr, run.stderr[-3000:]
        assert "SIGKILL now rather than after the 60 s grace period" in run.stderr
        assert re.search(r"CPU0 +\d+ +\d+ +SIGKILL \(137\) +killed \(SIGKILL\)", run.stderr), run.stderr[-3000:]
    assert "(CPU0 in _create_c10d_store (distributed/rendezvous.py:" in nodes[0].stderr  # where py-spy found it
    assert survivors(ranks, timeout=5) == []



def building(tmp_path, port: int) -> tuple[Run, int]:
    """Node 1 running the trainer, whose token cache it builds before starting its rank, with that build frozen
    (SIGSTOP: it would never end). Returns the node and the build's pid."""
    run = start(tmp_path, "--nproc", "1", *layout(port, 1), *TIMEOUTS, "--debug", "--set",
                f"data.cache_dir={tmp_path / 'cache'}", "--set", "data.vocab_size=300", "--set", "data.max_samples=400",
                entry=None, env=clean_env(SUPERVISOR_CONTROL_SECRET=CONTROL_SECRET), tag="1")
    build = rank_pid(run, ROOT / "prepare_dataset.py")
    os.kill(build, signal.SIGSTOP)
    return run, build


def test_a_node_still_building_its_dataset_stops_as_soon_as_another_node_is_lost(tmp_path):
    """Node 1 is still building its dataset when node 2's supervisor is killed: node 0 names node 2 to node 1, which
    kills its build, starts no rank and exits with the lost-node code, naming node 2."""
    import psutil

    port = free_port_pair()
    nodes = [node(tmp_path, port, 0), *building(tmp_path, port), node(tmp_path, port, 2)]
    (node0, (node1, build), node2) = nodes[0], nodes[1:3], nodes[3]
    for rank in (1, 2):
        node0.wait_for_stderr(f"node {rank} joined from {address(rank)}")
    node2.wait_for_ranks(1)
    os.kill(node2.proc.pid, signal.SIGKILL)
    node1.wait(timeout=30)
    assert node1.returncode == LOST_CODE, node1.stderr[-3000:]
    assert (f"lost contact with node 2's supervisor (127.0.0.3): its connection closed; stopped this node's dataset "
            f"preparation (prepare_dataset.py, pid {build}, after ") in node1.stderr, node1.stderr[-3000:]
    assert f"no rank was started; exit code {LOST_CODE}" in node1.stderr
    assert "CPU0:" not in node1.stderr + node1.stdout  # no rank ever ran there
    assert not psutil.pid_exists(build) or psutil.Process(build).status() == psutil.STATUS_ZOMBIE
    node0.wait(timeout=30)
    assert node0.returncode == LOST_CODE, node0.stderr[-3000:]


def test_a_stall_elsewhere_names_the_node_still_building_its_dataset(tmp_path):
    """Node 2 (the test) reports a stall while node 1 still builds its dataset: node 1 stops its build and answers
    with its verdict, which names it (the other nodes' ranks wait for its, which never started)."""
    port = free_port_pair()
    node0 = node(tmp_path, port, 0)
    node1, _ = building(tmp_path, port)
    node0.wait_for_stderr("node 1 joined from 127.0.0.2")
    fake = FakeNode(port + 1, node=2, ranks=1)
    node0.wait_for_ranks(1)
    fake.send("abort 2 CPU0 124")
    fake.send("verdict 2 0 no rank of this node had stalled")  # every verdict in: nobody waits for the rest
    for run in (node0, node1):
        run.wait(timeout=30)
        assert run.returncode == 124, run.stderr[-3000:]
    assert "node 2: CPU0 stalled; stopped this node's dataset preparation" in node1.stderr, node1.stderr[-3000:]
    assert "node 1: no rank of this node has started: it is still preparing its dataset (prepare_dataset.py, for " \
           in headline(node0), node0.stderr[-3000:]


@pytest.mark.slow
def test_a_supervisor_frozen_then_resumed_names_itself_not_its_peers(tmp_path):
    """Node 1's supervisor alone is frozen (its rank trains on) for longer than --node-timeout: the others name node 1
    and stop; once resumed, node 1 says that it was the one not running, instead of blaming node 0's silence or the
    fallout its rank met meanwhile (its rank is stopped, not its failure)."""
    nodes = joined(tmp_path, entry_args=dict.fromkeys(range(NODES), TRAINING))
    training_until_step_3(nodes[2], 2)
    os.kill(nodes[1].proc.pid, signal.SIGSTOP)
    try:
        for run in (nodes[0], nodes[2]):
            run.wait(timeout=45)
            assert run.returncode == LOST_CODE and "node 1 (127.0.0.2) stopped answering" in headline(run), \
                run.stderr[-3000:]
    finally:
        os.kill(nodes[1].proc.pid, signal.SIGCONT)
    run = nodes[1].wait(timeout=45)
    assert run.returncode == LOST_CODE, run.stderr[-3000:]
    assert re.search(r"run stopped after .*: this node's supervisor did not run for [\d.]+ s or more \(frozen: SIGSTOP, "
                     r"or its host suspended\), longer than --node-timeout 3 s: the other nodes have taken node 1 for "
                     r"lost", run.stderr), run.stderr[-3000:]
    assert "stopped answering" not in run.stderr and "failed first" not in run.stderr, run.stderr[-3000:]


@pytest.mark.parametrize("rank", [0, 1])
def test_a_stop_before_the_nodes_met_waits_for_them_until_a_second_ctrl_c(tmp_path, rank):
    """Ctrl-C on a node alone (node 0 waiting for the others, or node 1 that never reached node 0): the stop would
    reach the other nodes if they came within the grace period, the console says so, and a second Ctrl-C leaves at
    once."""
    run = start(tmp_path, "--nproc", "1", *layout(free_port_pair(), rank), "--node-timeout", "3", "--join-timeout",
                "60", "--grace-period", "60", env=clean_env(SUPERVISOR_CONTROL_SECRET=CONTROL_SECRET), tag=str(rank))
    run.wait_for_stderr(f"waiting for all {NODES} nodes to join before starting the ranks")
    run.proc.send_signal(signal.SIGINT)
    who = "the nodes that have not joined" if rank == 0 else "node 0, not reached so far,"
    run.wait_for_stderr(f"telling {who} that this run stopped: up to the grace period (60 s); Ctrl-C again to leave "
                        f"now")
    asked = time.monotonic()
    run.proc.send_signal(signal.SIGINT)
    run.wait(timeout=30)
    assert time.monotonic() - asked < 5
    assert run.returncode == 128 + signal.SIGINT, run.stderr[-3000:]
    assert "SIGINT: interrupted while waiting for the other nodes; no rank was started" in run.stderr


def test_a_second_node_given_a_taken_node_rank_stops_at_once_and_is_named(tmp_path):
    """Nodes 0 and 1, and a third node started as node 1 too (meant to be node 2): it is refused at once, saying
    why; the others stop at the join timeout naming node 2 as missing and the second node 1 as the likely reason."""
    port = free_port_pair()
    nodes = [node(tmp_path, port, 0), node(tmp_path, port, 1)]
    nodes[0].wait_for_stderr("node 1 joined from 127.0.0.2")
    twin = start(tmp_path, "--nproc", "1", *layout(port, 1)[:-1], address(2), *TIMEOUTS,
                 env=clean_env(SUPERVISOR_CONTROL_SECRET=CONTROL_SECRET), tag="twin")
    twin.wait(timeout=15)
    assert twin.returncode == LOST_CODE, twin.stderr[-3000:]
    assert ("node 0's control server refused this node: node 1 has joined already (two nodes were given --node-rank "
            "1: give each its own, within 1-2)") in twin.stderr
    nodes[0].wait_for_stderr("refused a second node 1 from 127.0.0.3: node 1 joined already (two nodes were given "
                             "--node-rank 1)")
    for run in nodes:
        run.wait(timeout=60)
        assert run.returncode == LOST_CODE, run.stderr[-3000:]
        assert ("; a second node 1 came from 127.0.0.3 (two nodes were given --node-rank 1; one of them was meant to "
                "be node 2?)") in run.stderr, run.stderr[-3000:]
