"""torchrun's multi-node command lines as their users give them, on node supervisors on loopback: the same command on
every node with nothing else set (no --node-rank, no secret), a stranger on the control port, the environment an
operator gives its pods (Kubeflow's PyTorchJob), and nodes that disagree on --nnodes."""

from __future__ import annotations

import re
import signal
import socket
import threading
import time
from pathlib import Path

import pytest

from rank_scripts.harness import CONTROL_SECRET, Run, clean_env, free_port_pair, start, survivors
from supervisor.control.server import listen
from supervisor.control.wire import LOST_CODE, ControlKey, hello_line, new_nonce

PROGRAM = Path(__file__).resolve().parent / "torchrun_programs" / "allreduce_loop.py"


def c10d_node(tmp_path, port: int, tag: str, *program_args: str, nnodes: int = 2, nproc: int = 1,
              env: dict[str, str] | None = None, program: Path = PROGRAM) -> Run:
    """torchrun's c10d command line as its users give it, the same on every node: no --node-rank (and nothing else
    set, unless `env` says so)."""
    return start(tmp_path, f"--nnodes={nnodes}", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
                 f"--rdzv-endpoint=127.0.0.1:{port}", "--grace-period", "5", str(program), *program_args, entry=None,
                 env=env or clean_env(), tag=tag)


def test_no_node_starts_its_ranks_before_every_node_has_joined(tmp_path):
    """A program that never joins a process group (it only reads its environment) on two nodes, the second started
    seconds late: node 0 holds its ranks until node 1 has joined, as torchrun's rendezvous holds its workers, and
    the two ranks are one world of 2. (Node 0 used to run its rank alone, exit 0, and leave the late node to make
    itself node 0 of a run of its own.)"""
    port = free_port_pair()
    program = PROGRAM.parent / "whoami.py"
    node0 = c10d_node(tmp_path, port, "a", str(tmp_path), program=program)
    node0.wait_for_stderr("waiting for all 2 nodes to join before starting the ranks (at most --join-timeout, 300 s)")
    time.sleep(2.0)
    assert node0.proc.poll() is None and not list(tmp_path.glob("rank*.json")), node0.stderr[-2000:]
    node1 = c10d_node(tmp_path, port, "b", str(tmp_path), program=program)
    for run in (node0, node1):
        run.wait(timeout=60)
        assert run.returncode == 0, run.stderr[-3000:]
    assert "node 1 of 2 (given by node 0 at 127.0.0.1 as the nodes joined): ranks 1-1 of 2" in node1.stderr
    assert sorted(p.name for p in tmp_path.glob("rank*.json")) == ["rank0.json", "rank1.json"]
    assert "rank 0 here" in node0.stdout and "rank 1 here" in node1.stdout


def test_nodes_with_different_rank_counts_form_one_world(tmp_path):
    """--nproc-per-node 2 on node 0 and 1 on node 1, as torchrun allows: ranks 0-1 on node 0 and rank 2 on node 1,
    one gloo world of 3 whose all-reduces sum to 3 on every rank."""
    port = free_port_pair()
    args = ("--steps", "5", "--step-time", "0.02")
    node0 = c10d_node(tmp_path, port, "a", *args, nproc=2)
    node0.wait_for_stderr("node 0 of 2 (this node opened the control port at 127.0.0.1)")
    node1 = c10d_node(tmp_path, port, "b", *args, nproc=1)
    for run in (node0, node1):
        run.wait(timeout=60)
        assert run.returncode == 0, run.stderr[-3000:]
    assert "control port: node 1 joined from 127.0.0.1 with 1 rank" in node0.stderr
    for run, ranks in ((node0, "0-1"), (node1, "2-2")):
        assert (f"the nodes' rank counts differ (node 0: 2, node 1: 1): this node's ranks are {ranks} of 3"
                in run.stderr), run.stderr[-3000:]
    out = node0.stdout + node1.stdout
    finished = sorted(re.findall(r"rank (\d) of (\d): 5 all-reduces, the last summing to (\d)", out))
    assert finished == [("0", "3", "3"), ("1", "3", "3"), ("2", "3", "3")], out


@pytest.mark.slow
def test_two_nodes_given_no_address_meet_at_torchruns_default(tmp_path):
    """`--nnodes 2 --nproc-per-node 1 whoami.py` twice on one host, nothing else: node 0 is 127.0.0.1:29500, as
    torchrun's static rendezvous defaults to, each node says so, and the two ranks are one world of 2."""
    for port in (29500, 29501):  # the store's, and the control port after it
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                pytest.skip(f"port {port} is taken on this machine")
    program = PROGRAM.parent / "whoami.py"
    nodes = [start(tmp_path, "--nnodes", "2", "--nproc-per-node", "1", str(program), str(tmp_path), entry=None,
                   env=clean_env(), tag=tag) for tag in "ab"]
    for run in nodes:
        run.wait(timeout=60)
        assert run.returncode == 0, run.stderr[-3000:]
        assert ("--master-addr not given: node 0 is 127.0.0.1:29500, as under torchrun (every node on this host; "
                "--master-addr HOST names node 0 elsewhere)") in run.stderr
    assert sorted(p.name for p in tmp_path.glob("rank*.json")) == ["rank0.json", "rank1.json"]


def test_nodes_started_without_a_node_rank_are_numbered_as_they_join(tmp_path):
    """torchrun's c10d command line as its users give it, the same on every node (no --node-rank; the third node
    with the supervisor's own flags, also without one): the node that opens the control port at the endpoint is node
    0, the others get 1 and 2 in the order they join, and each rank its global rank in one world (the all-reduce
    forms); a fourth node is one too many, told so at once."""
    port = free_port_pair()
    env = clean_env(SUPERVISOR_CONTROL_SECRET=CONTROL_SECRET)

    def node(tag: str) -> Run:
        program_args = ("--step-time", "0.05", "--save-on-term", "--ready", str(tmp_path / f"pids{tag}"))
        if tag == "c":
            return start(tmp_path, "--nnodes", "3", "--nproc", "1", "--master-addr", "127.0.0.1", "--master-port",
                         str(port), "--grace-period", "5", entry=PROGRAM, entry_args=program_args, env=env, tag=tag)
        return c10d_node(tmp_path, port, tag, *program_args, nnodes=3, env=env)

    nodes = []
    for tag, said in [("a", "node 0 of 3 (this node opened the control port at 127.0.0.1): ranks 0-0 of 3"),
                      ("b", "node 1 of 3 (given by node 0 at 127.0.0.1 as the nodes joined): ranks 1-1 of 3"),
                      ("c", "node 2 of 3 (given by node 0 at 127.0.0.1 as the nodes joined): ranks 2-2 of 3")]:
        nodes.append(node(tag))
        nodes[-1].wait_for_stderr(said)
    deadline = time.monotonic() + 60  # the world forms: each node's rank all-reduces under its global rank
    while not all((run.pid_dir / f"rank{rank}.pids").exists() for rank, run in enumerate(nodes)):
        assert time.monotonic() < deadline and all(run.proc.poll() is None for run in nodes), "no world formed"
        time.sleep(0.05)
    nodes[0].wait_for_stderr("control port: node 2 joined")
    extra = node("d").wait(timeout=30)
    assert extra.returncode == LOST_CODE, extra.stderr[-2000:]
    assert ("node 0's control server refused this node: all 3 nodes of the run (--nnodes 3) have joined already; "
            "no rank was started; exit code 125") in extra.stderr
    nodes[0].proc.send_signal(signal.SIGTERM)
    for run in nodes:
        run.wait(timeout=30)
    assert [run.returncode for run in nodes] == [143] * 3, [run.stderr[-1500:] for run in nodes]
    assert "refused a node without --node-rank from 127.0.0.1" in nodes[0].stderr
    assert survivors([*nodes[0].pids(), *nodes[1].pids(), *nodes[2].pids()]) == []


class Impostor:
    """Whoever holds the control port before node 0 does (a process of an earlier run, a stranger): it answers every
    hello with a bare ``refused``, which proves nothing."""

    def __init__(self, port: int) -> None:
        self.listener = listen(port)  # as node 0 would: every address of the host
        self.listener.settimeout(0.1)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        while not self.done.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(5)
                conn.sendall(f"challenge {new_nonce()}\n".encode())
                conn.recv(4096)
                conn.sendall(b"refused\n")

    def close(self) -> None:
        self.done.set()
        self.thread.join()
        self.listener.close()


def test_torchruns_canonical_two_node_command_needs_nothing_else(tmp_path):
    """``python -m supervisor --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:PORT train.py``,
    the same on both nodes with nothing else set, as torchrun takes it: the world of 2 forms and both nodes exit 0,
    each saying once that its control channel is unauthenticated. Nothing a stranger sends ends it: a bare
    ``refused`` from whoever held the control port before node 0 only delays node 1's join, and garbage, a
    ``refused`` and a hello under another run's key sent to node 0 are dropped."""
    port = free_port_pair()
    impostor = Impostor(port + 1)
    try:
        node1 = c10d_node(tmp_path, port, "b", "--steps", "20", "--step-time", "0.05")
        node1.wait_for_stderr("control port: node 0's control server refused this node's hello: the nodes differ in "
                              "--rdzv-id, or only some have SUPERVISOR_CONTROL_SECRET")
    finally:
        impostor.close()
    node0 = c10d_node(tmp_path, port, "a", "--steps", "20", "--step-time", "0.05")
    node0.wait_for_stderr("control port: node 1 joined from 127.0.0.1")
    for garbage in (b"refused\n", b"\x00\xff garbage \x1b[2J\n"):
        with socket.create_connection(("127.0.0.1", port + 1), timeout=5) as sock:
            sock.sendall(garbage)
    with socket.create_connection(("127.0.0.1", port + 1), timeout=5) as forged:
        challenge = forged.recv(4096).decode().split()[1]
        other_run = ControlKey.of(None, "another-run", port).key
        forged.sendall(f"{hello_line(other_run, 1, 2, 1, challenge, new_nonce())}\n".encode())
        assert forged.recv(4096) == b"refused\n"
    expect_world_of_two(node0, node1)
    for run in (node0, node1):
        assert run.stderr.count("control channel: unauthenticated (SUPERVISOR_CONTROL_SECRET is not set)") == 1
    assert "node 1 of 2 (given by node 0 at 127.0.0.1 as the nodes joined)" in node1.stderr
    assert "refused a hello from 127.0.0.1" in node0.stderr and "is not a hello" in node0.stderr


def expect_world_of_two(*runs: Run) -> None:
    """Each run exited 0 and their ranks were one world of 2: each did its 20 all-reduces, each summing to 2."""
    for run in runs:
        run.wait(timeout=60)
        assert run.returncode == 0, run.stderr[-3000:]
    out = "".join(run.stdout for run in runs)
    finished = sorted(re.findall(r"rank (\d) of (\d): 20 all-reduces, the last summing to (\d)", out))
    assert finished == [("0", "2", "2"), ("1", "2", "2")], out


@pytest.mark.slow
def test_the_canonical_command_with_a_secret_file_on_every_node(tmp_path):
    """With SUPERVISOR_CONTROL_SECRET_FILE (a Kubernetes Secret mounted in every pod) the same command authenticates
    the nodes, and nothing is said of an unauthenticated channel."""
    secret = tmp_path / "secret"
    secret.write_text(CONTROL_SECRET + "\n")
    env, port = clean_env(SUPERVISOR_CONTROL_SECRET_FILE=str(secret)), free_port_pair()
    node0 = c10d_node(tmp_path, port, "a", "--steps", "20", "--step-time", "0.05", env=env)
    node0.wait_for_stderr("node 0 of 2 (this node opened the control port at 127.0.0.1)")
    node1 = c10d_node(tmp_path, port, "b", "--steps", "20", "--step-time", "0.05", env=env)
    expect_world_of_two(node0, node1)
    assert "unauthenticated" not in node0.stderr + node1.stderr


def test_nodes_that_disagree_on_nnodes_both_stop_naming_both_values(tmp_path):
    """A node started with --nnodes 3 beside node 0's 2 would be a node that does not exist to the others (a stall
    would blame it): node 0's answer to its hello, proven, stops both, each with one line that names both values."""
    port = free_port_pair()
    node0 = c10d_node(tmp_path, port, "a", "--steps", "5", nnodes=2)
    node0.wait_for_stderr("node 0 of 2 (this node opened the control port at 127.0.0.1)")
    node1 = c10d_node(tmp_path, port, "b", "--steps", "5", nnodes=3)
    for run in (node1, node0):
        run.wait(timeout=60)
        assert run.returncode == 2, run.stderr[-3000:]
    assert ("supervisor: the nodes disagree on --nnodes: this node was started with --nnodes 3, node 0 (127.0.0.1) "
            "with --nnodes 2; start every node with the same --nnodes; no rank was started; exit code 2"
            in node1.stderr), node1.stderr[-3000:]
    assert ("the nodes disagree on --nnodes: this node was started with --nnodes 2, the node at 127.0.0.1 with "
            "--nnodes 3; start every node with the same --nnodes" in node0.stderr), node0.stderr[-3000:]
    assert survivors(node0.pids() + node1.pids()) == []


def test_a_pytorchjobs_pods_form_the_world_from_the_operators_environment(tmp_path):
    """Two pods of a Kubeflow PyTorchJob (docs/kubernetes.md): the container command is ``python -m supervisor
    train.py``, and the launch comes from the variables the training operator sets in every pod (MASTER_ADDR and
    PET_MASTER_ADDR name the master pod's service, RANK and PET_NODE_RANK the pod's index, WORLD_SIZE the ranks of
    the job)."""
    port = free_port_pair()
    pods = [start(tmp_path, str(PROGRAM), "--steps", "20", "--step-time", "0.05", entry=None, tag=str(index),
                  env=clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(index),
                                PET_MASTER_ADDR="127.0.0.1", PET_MASTER_PORT=str(port), PET_NNODES="2",
                                PET_NPROC_PER_NODE="1", PET_NODE_RANK=str(index), PYTHONUNBUFFERED="0"))
            for index in (0, 1)]
    expect_world_of_two(*pods)
