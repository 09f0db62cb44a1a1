"""Two node supervisors on loopback: a failure on either node stops the ranks of both, through the control channel."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from rank_scripts.harness import CONTROL_SECRET, Run, clean_env, free_port_pair, start, survivors
from supervisor.control.channel import remote_failure
from supervisor.control.server import ControlServer, listen, names_this_machine
from supervisor.control.wire import (
    LOST_CODE,
    SECRET_ENV,
    SECRET_FILE_ENV,
    ControlKey,
    LineReader,
    Session,
    Timing,
    answer_proof,
    hello_line,
    new_nonce,
    read_secret,
)
from supervisor.plan.spec import Plan, node_ranks
from trainer.errors import UserError


def two_nodes(tmp_path, node0_args=(), node1_args=(), node1_delay: float = 0.0,
              node1_secret: str = CONTROL_SECRET, flags: tuple[str, ...] = ()) -> tuple[Run, Run]:
    port = str(free_port_pair())
    common = ("--nproc", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", port,
              "--grace-period", "5")
    node0 = start(tmp_path, *common, "--node-rank", "0", *flags, entry_args=node0_args,
                  env=clean_env(SUPERVISOR_CONTROL_SECRET=CONTROL_SECRET), tag="0")
    time.sleep(node1_delay)
    node1 = start(tmp_path, *common, "--node-rank", "1", *flags, entry_args=node1_args,
                  env=clean_env(SUPERVISOR_CONTROL_SECRET=node1_secret), tag="1")
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
    node0.wait_for_stderr("control port: node 1 joined")
    os.kill(node1.proc.pid, signal.SIGKILL)
    node0.wait(timeout=20)
    assert node0.returncode == LOST_CODE, node0.stderr[-2000:]
    assert "lost contact with node 1's supervisor (127.0.0.1): its connection closed" in node0.stderr
    assert survivors(node0.pids() + pids1, timeout=3.0) == []


def test_a_node_with_another_secret_is_refused_and_told_why(tmp_path):
    """Node 1 says the refusal at once, but a refusal proves nothing: it tries again until its join timeout. Node 0,
    whose ranks wait for every node, names node 1 as never joined, with the refused hello in its name."""
    node0, node1 = two_nodes(tmp_path, node0_args=("--steps", "20"), node1_secret="another-secret-0123456789",
                             flags=("--join-timeout", "3"))
    node1.wait_for_stderr("control port: node 0's control server refused this node's hello: "
                          "SUPERVISOR_CONTROL_SECRET differs between the nodes")
    node1.wait(timeout=20)
    node0.wait(timeout=20)
    assert node1.returncode == LOST_CODE, node1.stderr[-2000:]
    assert re.search(r"could not join node 0's control server at 127\.0\.0\.1:\d+ within 3 s \(--join-timeout\): .*"
                     r"node 0's control server refused this node's hello: SUPERVISOR_CONTROL_SECRET differs",
                     node1.stderr), node1.stderr[-2000:]
    assert "refused a hello as node 1 from 127.0.0.1" in node0.stderr  # a refusal is no abort: node 0 waits on
    assert node0.returncode == LOST_CODE, node0.stderr[-2000:]
    assert re.search(r"node 1 never joined: no supervisor of it connected to node 0 and proved this run's key within "
                     r"3 s \(--join-timeout\); a hello as node 1 from 127\.0\.0\.1 was refused \(.*\); no rank was "
                     r"started", node0.stderr), node0.stderr[-2000:]


def test_both_nodes_finish(tmp_path):
    node0, node1 = two_nodes(tmp_path, node0_args=("--steps", "5", "--dump-env", str(tmp_path)),
                             node1_args=("--steps", "5"))
    node0.wait()
    node1.wait()
    assert (node0.returncode, node1.returncode) == (0, 0), node0.stderr + node1.stderr
    assert SECRET_ENV not in json.loads((tmp_path / "rank0.json").read_text())["env"]  # the supervisors' alone
    ranks = sorted(int(r) for r in re.findall(r"rank (\d+) started", node0.stdout + node1.stdout))
    assert ranks == [0, 1, 2, 3]  # global rank = node rank × ranks per node + local rank


def test_node_0_listens_on_every_address_of_its_host():
    """--master-addr may name node 0 by an address the other nodes do not reach it by (a hostname that node 0's
    /etc/hosts maps to 127.0.1.1): its control port answers on all of them, as torch's TCPStore does. A node
    without --node-rank is node 0 only where --master-addr names its own machine."""
    port = free_port_pair() + 1
    server = ControlServer(2, 1, listen(port), ControlKey(CONTROL_SECRET.encode(), True), Timing(), lambda line: None)
    try:
        for address in ("127.0.0.1", "127.0.1.1", "127.0.0.7"):
            with socket.create_connection((address, port), timeout=5) as sock:
                assert sock.recv(4096).startswith(b"challenge "), address
    finally:
        server.close(wait=0)
    assert names_this_machine("127.0.0.1") and names_this_machine("localhost")
    assert not names_this_machine("192.0.2.1") and not names_this_machine("no-such-host.invalid")


def test_the_node_rank_node_0_gives_moves_the_global_ranks():
    """Global rank = node rank × ranks per node + local rank, once the node knows its node rank."""
    plan = Plan(entry=Path("train.py"), entry_args=[], run_dir=Path(), ranks=node_ranks([3, 5], 0, 0), nnodes=4,
                node_rank_assigned=True)
    moved = plan.as_node(2)
    assert moved.node_rank == 2 and [(s.rank, s.local_rank, s.gpu) for s in moved.ranks] == [(4, 0, 3), (5, 1, 5)]
    assert [s.rank for s in replace(plan, ranks=node_ranks([], 3, 0)).as_node(1).ranks] == [3, 4, 5]


# -- the control port against strangers and bad messages ----------------------------------------------------------


class FakeNode:
    """The test as one more node of the run: it holds the secret, so what it sends is authenticated."""

    def __init__(self, port: int, node: int, nnodes: int = 3, key: bytes = CONTROL_SECRET.encode(),
                 ranks: int = 2) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.reader = LineReader()
        self.pending: list[str] = []  # lines that came in one read with the one asked for (`line`)
        challenge = self.line()
        server_nonce, nonce = challenge.split()[1], new_nonce()
        self.sock.sendall(f"{hello_line(key, node, nnodes, ranks, server_nonce, nonce)}\n".encode())
        answer = self.line()  # what node 0 sends right after its welcome (a heartbeat) may come in the same read
        assert answer == f"welcome {node} {answer_proof(key, f'welcome {node}', server_nonce, nonce)}", answer
        self.session = Session.derive(key, server_nonce, nonce, server=False)

    def line(self) -> str:
        while not self.pending:
            self.pending = self.lines()
        return self.pending.pop(0)

    def lines(self) -> list[str]:
        if self.pending:
            kept, self.pending = self.pending, []
            return kept
        lines: list[str] | None = []
        while not lines:
            lines = self.reader.feed(self.sock.recv(4096))
            assert lines is not None
        return lines

    def news(self) -> list[str]:
        """The next lines that are not heartbeats, progress reports, nor node 0's word that every node joined."""
        while not (lines := [line for line in self.lines()
                             if not line.startswith(("beat ", "assembled ", "progress "))]):
            pass
        return lines

    def send(self, message: str) -> bytes:
        line = self.session.seal(message)
        self.sock.sendall(line)
        return line


def closed_by_peer(sock: socket.socket, timeout: float) -> float:
    """Seconds until the other end closes `sock` (whatever it sends first is read and ignored)."""
    started = time.monotonic()
    sock.settimeout(timeout)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    return time.monotonic() - started


def stranger(port: int, send: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    if send:
        sock.sendall(send)
    return sock


def rank0_step(run: Run) -> int:
    steps = re.findall(r"CPU0:rank 0 step (\d+) ", run.out_path.read_text(errors="replace"))
    return int(steps[-1]) if steps else 0


def three_nodes(tmp_path) -> tuple[Run, Run, int]:
    """Node 0 and node 1 as supervisors (CPU1 of each prints a line per step), node 1 joined; the test is node 2,
    whose joining (`FakeNode`, then `ranks_started`) lets their ranks start."""
    port = free_port_pair()
    common = ("--nproc", "2", "--nnodes", "3", "--master-addr", "127.0.0.1", "--master-port", str(port),
              "--grace-period", "5", "--node-timeout", "600")  # the test's node sends no heartbeats
    env = clean_env(SUPERVISOR_CONTROL_SECRET=CONTROL_SECRET)
    node0, node1 = (start(tmp_path, *common, "--node-rank", str(n), entry_args=("--chatter", "1"), env=env,
                          tag=str(n)) for n in (0, 1))
    node0.wait_for_stderr("control port: node 1 joined")  # a hello as node 1 is a stranger's from here on
    return node0, node1, port + 1


def ranks_started(*nodes: Run) -> None:
    for node in nodes:
        node.wait_for_ranks(2)


def test_strangers_and_bad_messages_neither_stop_nor_slow_the_run(tmp_path):
    node0, node1, control = three_nodes(tmp_path)
    flood = [stranger(control) for _ in range(300)]  # and keeps them open
    me = FakeNode(control, node=2)  # a real node still gets in during the flood
    supervisor_fds = psutil.Process(node0.proc.pid).num_fds()
    for sock in flood:
        sock.close()
    ranks_started(node0, node1)
    idle = stranger(control)  # says nothing: closed within seconds, while the rest goes on
    idle_closed: list[float] = []
    watcher = threading.Thread(target=lambda: idle_closed.append(closed_by_peer(idle, 10)))
    watcher.start()
    first_step, started = rank0_step(node0), time.monotonic()

    for _ in range(5):
        stranger(control).close()  # nc -z
    assert closed_by_peer(stranger(control, b"abort 0 GPU0 3\n"), 5) < 1  # the unauthenticated protocol
    forged = stranger(control)
    challenge = forged.recv(4096).decode().split()[1]
    forged.sendall(f"{hello_line(b'not the secret', 1, 3, 1, challenge, new_nonce())}\n".encode())
    assert forged.recv(4096) == b"refused\n"
    assert closed_by_peer(stranger(control, b"\x00\xff binary \x1b[2J\n"), 5) < 1
    oversized = stranger(control)
    sent = time.monotonic()
    with pytest.raises(OSError):  # reset once node 0 closes it
        oversized.sendall(b"x" * 20_000_000)
    closed_after = time.monotonic() - sent
    assert closed_after < 2

    for code in ("99999999999999999999", "256", "-1", "3.0"):
        me.send(f"abort 2 CPU0 {code}")
    me.send("abort 1 CPU0 3")  # in another node's name
    me.send("shutdown")
    replayed = me.send("done")
    me.sock.sendall(replayed)  # out of sequence
    tampered = me.session.seal("abort 2 CPU0 3").replace(b"CPU0 3", b"CPU0 4")  # the MAC no longer fits
    me.sock.sendall(tampered)
    me.sock.sendall(b"abort 2 CPU0 3 " + b"f" * 64 + b"\n")  # a made-up MAC

    watcher.join()
    assert 2 < idle_closed[0] < 6
    elapsed, steps = time.monotonic() - started, rank0_step(node0) - first_step
    assert node0.proc.poll() is None and node1.proc.poll() is None, node0.err_path.read_text()
    assert supervisor_fds < 100
    print(f"rank 0 during the attacks: {steps} steps in {elapsed:.2f} s; node 0 held {supervisor_fds} fds in the flood; "
          f"20 MB without a newline cut off after {closed_after:.3f} s")
    assert steps > 0.5 * elapsed / 0.02  # worker.py's --step-time: not slowed to half

    ranks0 = node0.pids()
    killed = time.monotonic()
    os.kill(node1.pids()[1], signal.SIGKILL)  # CPU1 of node 1: a real node's abort
    assert survivors(ranks0, timeout=5) == []
    stopped_in = time.monotonic() - killed
    node0.wait(timeout=20)
    node1.wait(timeout=20)
    assert (node0.returncode, node1.returncode) == (137, 137), node0.stderr[-3000:]
    print(f"node 0's ranks gone {stopped_in:.3f} s after node 1's rank was killed")
    assert stopped_in < 1.0, stopped_in
    assert me.news()[0].startswith("abort 1 CPU1 137 ")  # relayed to every node
    for said in ("closed before authenticating", "is not a hello", "that does not prove this run's key",
                 "a line over 512 bytes", "did not authenticate within 3 s", "connections waiting to authenticate",
                 "exit code '99999999999999999999' is not within 0-255", "whose MAC is wrong",
                 "dropped an unknown message from node 2: 'shutdown'", "node 1: CPU1 failed with SIGKILL"):
        assert said in node0.stderr, said


def test_a_remote_abort_never_ends_a_run_with_exit_0(tmp_path):
    node0, node1, control = three_nodes(tmp_path)
    me = FakeNode(control, node=2)
    ranks_started(node0, node1)
    me.send("abort 2 CPU0 0")
    node0.wait(timeout=20)
    node1.wait(timeout=20)
    assert (node0.returncode, node1.returncode) == (LOST_CODE, LOST_CODE), node0.stderr[-3000:]
    assert "node 2: CPU0 failed with exit 0" in node0.stderr


SERVER_WITH_FEW_FDS = """
import os, resource, select, sys
from supervisor.control.server import ControlServer, listen
from supervisor.control.wire import ControlKey, Timing
limits = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir('/proc/self/fd')) + 12, limits[1]))
channel = ControlServer(3, 1, listen(int(sys.argv[1]) + 1), ControlKey(sys.argv[2].encode(), True), Timing(),
                        lambda line: print(line, flush=True))
print('listening', flush=True)
select.select([channel.fd], [], [])
print('event', [(e.node, e.label, e.code, e.why) for e in channel.read_events()[0]], flush=True)
resource.setrlimit(resource.RLIMIT_NOFILE, limits)  # room to exit in (ending a thread may load a library)
"""


def test_out_of_file_descriptors_the_control_port_goes_on_hearing_the_nodes(tmp_path):
    """EMFILE in accept: the oldest waiting connection makes room (it used to end the control thread silently)."""
    port = free_port_pair()
    server = subprocess.Popen([sys.executable, "-c", SERVER_WITH_FEW_FDS, str(port), CONTROL_SECRET],
                              env=clean_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline() == "listening\n"
        flood = [stranger(port + 1) for _ in range(40)]
        FakeNode(port + 1, node=1, ranks=1).send("abort 1 GPU5 9")
        out, _ = server.communicate(timeout=10)
        for sock in flood:
            sock.close()
    finally:
        server.kill()
    assert "out of file descriptors (Too many open files): closed the oldest connection" in out
    assert "event [(1, 'GPU5', 9, 'node 1: GPU5 failed with exit 9')]" in out


def test_a_line_is_worth_nothing_on_another_connection_or_twice():
    secret = CONTROL_SECRET.encode()
    sender = Session.derive(secret, "a" * 32, "b" * 32, server=False)
    receiver = Session.derive(secret, "a" * 32, "b" * 32, server=True)
    elsewhere = Session.derive(secret, "a" * 32, "c" * 32, server=True)
    line = sender.seal("abort 1 GPU0 3").decode().strip()
    assert elsewhere.open(line) is None  # recorded on one connection, replayed on another
    assert receiver.open(line) == "abort 1 GPU0 3"
    assert receiver.open(line) is None  # replayed on its own
    assert Session.derive(secret, "a" * 32, "b" * 32, server=False).open(line) is None  # reflected back


def test_a_secret_that_is_set_must_not_be_trivial(tmp_path):
    """No secret is no error: the channel's key then comes from the run id and the port (torchrun's trust), the same on
    every node of the run, another for another run id or port. A secret set, in the environment or in a file, is
    used as it is and must not be guessable."""
    assert read_secret({}) is None
    key = ControlKey.of(None, "none", 29600)
    assert not key.secret and key == ControlKey.of(None, "none", 29600)
    assert key.key not in (ControlKey.of(None, "other-run", 29600).key, ControlKey.of(None, "none", 29602).key)
    assert ControlKey.of(CONTROL_SECRET.encode(), "none", 29600) == ControlKey(CONTROL_SECRET.encode(), True)
    secret_file = tmp_path / "secret"
    secret_file.write_text(CONTROL_SECRET + "\n")  # as `kubectl create secret --from-file` keeps an editor's newline
    assert read_secret({SECRET_FILE_ENV: str(secret_file)}) == CONTROL_SECRET.encode()
    with pytest.raises(UserError, match=f"both {SECRET_ENV} and {SECRET_FILE_ENV} are set; keep one of them"):
        read_secret({SECRET_ENV: CONTROL_SECRET, SECRET_FILE_ENV: str(secret_file)})
    with pytest.raises(UserError, match=f"{SECRET_FILE_ENV}={tmp_path}/missing: cannot read it \\(No such file"):
        read_secret({SECRET_FILE_ENV: str(tmp_path / "missing")})
    secret_file.write_text("abc123\n")
    with pytest.raises(UserError, match=rf"the secret in {secret_file} \({SECRET_FILE_ENV}\) has 6 bytes; use at"):
        read_secret({SECRET_FILE_ENV: str(secret_file)})
    with pytest.raises(UserError, match="SUPERVISOR_CONTROL_SECRET has 6 characters; use at least 16"):
        read_secret({SECRET_ENV: "abc123"})
    with pytest.raises(UserError, match="SUPERVISOR_CONTROL_SECRET has only 1 distinct characters; use at least 8"):
        read_secret({SECRET_ENV: "a" * 16})
    with pytest.raises(UserError, match="only 7 distinct characters"):
        read_secret({SECRET_ENV: "abcdefg" * 4})
    assert read_secret({SECRET_ENV: CONTROL_SECRET}) == CONTROL_SECRET.encode()


def test_an_abort_says_whether_a_rank_failed_or_a_supervisor_stopped():
    assert remote_failure(1, "GPU3", 7).why == "node 1: GPU3 failed with exit 7"
    assert remote_failure(1, "supervisor", 138).why == "node 1: its supervisor stopped with SIGUSR1 (138)"  # Slurm's warning
