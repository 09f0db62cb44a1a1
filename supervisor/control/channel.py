"""What both ends of the control channel share: one authenticated connection (`Peer`), the channel's thread and
event pipe (`ControlChannel`), the rate-limited notes on dropped connections, and the timing constants.
"""

from __future__ import annotations

import math
import os
import selectors
import socket
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

from supervisor.control.wire import (
    HANG_CODE,
    LOST_CODE,
    MAX_LINE,
    ControlKey,
    LineReader,
    Session,
    Timing,
    finding_message,
    parse_abort,
    parse_finding,
    parse_progress,
    parse_verdict,
    progress_message,
)
from supervisor.group.worker import describe_exit
from trainer.errors import USER_ERROR_EXIT_CODE

CONTROL_PORT_OFFSET = 1
RETRY_INTERVAL = 0.2
HELLO_TIMEOUT = 3.0  # seconds a new connection has to authenticate
MAX_PENDING = 32  # connections waiting to authenticate, at most
ACCEPT_PAUSE = 0.1  # out of file descriptors with none to free: seconds before accepting again
SEND_TIMEOUT = 2.0
NOTE_INTERVAL = 10.0
RECV_BYTES = 4096

@dataclass(frozen=True)
class Event:
    """Another node ended the run: `label` (a rank's device label, or "supervisor") on `node` with exit `code`;
    `why` is a sentence that names the node. `lost`: the node itself was lost (its supervisor stopped answering,
    died, or never joined), not a rank of it failing. Code 2: the nodes were started with different layouts
    (`disagreement`)."""

    node: int
    label: str
    code: int
    why: str
    lost: bool = False


NodeVerdict = tuple[int, bool, str]  # node, whether its evidence names a rank of its own, its stall headline
NodeFinding = tuple[int, str, str]  # node, its finding on its ranks when the group was silent (wire.FINDINGS), text
REPORTS = ("progress ", "finding ")  # what the nodes tell each other of their ranks, for the hang watchdog


def remote_failure(node: int, label: str, code: int) -> Event:
    if code == HANG_CODE:  # the node's watchdog: every node reads its own ranks' evidence (supervisor/diagnosis/verdicts.py)
        return Event(node, label, code, f"node {node}: {'its ranks' if label == 'supervisor' else label} stalled")
    if label == "supervisor":  # no rank failed there: the supervisor itself stopped (a signal such as Slurm's USR1)
        return Event(node, label, code, f"node {node}: its supervisor stopped with {describe_exit(code)}")
    return Event(node, label, code, f"node {node}: {label} failed with {describe_exit(code)}")


def lost(node: int, why: str) -> Event:
    """A node that was lost: its supervisor stopped answering, died, or never joined."""
    return Event(node, "supervisor", LOST_CODE, why, lost=True)


def disagreement(node: int, nnodes: int, theirs: int, where: str) -> Event:
    """`node` was started with --nnodes `nnodes` and the node `where` names with `theirs`: a user error on both (exit
    2), said with both values; nobody was lost, and no rank of a world that cannot form is worth starting."""
    why = (f"the nodes disagree on --nnodes: this node was started with --nnodes {nnodes}, {where} with --nnodes "
           f"{theirs}; start every node with the same --nnodes")
    return Event(node, "supervisor", USER_ERROR_EXIT_CODE, why)


def silence(node: int, address: str, since: float) -> str:
    return f"node {node} ({host(address)}) stopped answering {time.monotonic() - since:.1f} s ago"


def host(address: str) -> str:
    """The host of a ``host:port`` address."""
    return address.rpartition(":")[0] or address


def shown(line: str) -> str:
    return repr(line[:60] + ("..." if len(line) > 60 else ""))


class Notes:
    """What the channel dropped, for the console: each kind at most once per `NOTE_INTERVAL`, with the number left
    unsaid since, so a flood of bad connections cannot flood the console."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self.say = say
        self.last: dict[str, float] = {}
        self.unsaid: dict[str, int] = {}

    def note(self, kind: str, message: str) -> None:
        now = time.monotonic()
        if now - self.last.get(kind, -math.inf) < NOTE_INTERVAL:
            self.unsaid[kind] = self.unsaid.get(kind, 0) + 1
            return
        self.last[kind] = now
        more = self.unsaid.pop(kind, 0)
        self.say(f"control port: {message}" + (f" (and {more} more like it since the last such note)" if more else ""))


@dataclass
class Peer:
    """One connection, seen from either end."""

    sock: socket.socket
    address: str
    nonce: str  # this end's nonce
    opened: float = field(default_factory=time.monotonic)
    heard: float = field(default_factory=time.monotonic)  # the last authenticated line from it
    reader: LineReader = field(default_factory=LineReader)
    session: Session | None = None  # set once authenticated
    node: int | None = None  # server side: the node it proved to be
    done: bool = False
    closed: bool = False
    backlog: list[str] = field(default_factory=list)  # lines read during the handshake, not yet handled
    send_lock: threading.Lock = field(default_factory=threading.Lock)

    def send_plain(self, line: str) -> None:
        """A handshake line (nothing in it is secret)."""
        try:
            self.sock.sendall(line.encode() + b"\n")
        except OSError:
            pass

    def send(self, message: str) -> None:
        """An authenticated message; the lock keeps sequence numbers and bytes on the wire in the same order."""
        assert self.session is not None
        with self.send_lock:
            try:
                self.sock.sendall(self.session.seal(message))
            except OSError:
                pass

    def read_line(self) -> str:
        """The next line, blocking (within the socket's timeout): the client's handshake."""
        while not self.backlog:
            data = self.sock.recv(RECV_BYTES)
            if not data:
                raise ConnectionError("node 0 closed the connection")
            lines = self.reader.feed(data)
            if lines is None:
                raise ConnectionError(f"node 0 sent a line over {MAX_LINE} bytes")
            self.backlog.extend(lines)
        return self.backlog.pop(0)

    def shutdown(self) -> None:
        """Close cleanly: the last lines sent still arrive (a plain close could reset them)."""
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        self.sock.close()


class ControlChannel(ABC):
    """What the server and the client share: the key, the event pipe, the thread, the notes."""

    def __init__(self, node_rank: int | None, nnodes: int, ranks: int, key: ControlKey, timing: Timing,
                 say: Callable[[str], None]) -> None:
        # None: a node started without --node-rank, until node 0's welcome gives it one (supervisor/control/client.py)
        self.node_rank, self.nnodes, self.key, self.timing = node_rank, nnodes, key, timing
        self.ranks = ranks  # this node's
        self.assembled: tuple[int, ...] | None = None  # once every node joined: the ranks on each, in node order
        self.say = say
        self.next_beat = time.monotonic()
        self.notes = Notes(say)
        self.fd, self._events_w = os.pipe()
        os.set_blocking(self.fd, False)
        self._events: list[Event] = []
        self._verdicts: list[NodeVerdict] = []
        self._progress: dict[int, tuple[float, float]] = {}  # node → (when heard, monotonic; its age): the latest
        self._findings: list[NodeFinding] = []
        self._lock = threading.Lock()
        self.stopping = False  # an abort went out or came in: closed connections are expected from now on
        self.closing = False
        self.hurried = False  # a stop signal while closing: leave without waiting for the other nodes
        self.selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        self.selector.register(self._wake_r, selectors.EVENT_READ, None)
        self.thread = threading.Thread(target=self._run, name="supervisor-control", daemon=True)

    def _event(self, event: Event) -> None:
        with self._lock:
            self._events.append(event)
        self.stopping = True
        os.write(self._events_w, b"!")

    def _assemble(self, sizes: tuple[int, ...]) -> None:
        self.assembled = sizes
        os.write(self._events_w, b"a")  # wakes a launcher waiting for the other nodes

    def _verdict(self, verdict: NodeVerdict) -> None:
        with self._lock:
            self._verdicts.append(verdict)
        os.write(self._events_w, b"v")

    def read_events(self) -> tuple[list[Event], list[NodeVerdict]]:
        """What arrived since the last call: aborts and losses, and other nodes' stall verdicts."""
        try:
            os.read(self.fd, 4096)
        except BlockingIOError:
            pass
        with self._lock:
            events, self._events = self._events, []
            verdicts, self._verdicts = self._verdicts, []
        return events, verdicts

    def read_reports(self) -> tuple[dict[int, tuple[float, float]], list[NodeFinding]]:
        """What the other nodes said of their ranks since the last call: each one's latest progress (when it was heard,
        and how long before that its ranks last made progress), and their findings, in order."""
        with self._lock:
            progress, self._progress = self._progress, {}
            findings, self._findings = self._findings, []
        return progress, findings

    def _report(self, peer: Peer, message: str) -> int | None:
        """A `progress` or `finding` message (`REPORTS`), queued for the watcher: the node it speaks for, or None (and
        a note) when it is not one to act on."""
        kind = message.split(" ", 1)[0]
        parsed = parse_progress(message, self.nnodes) if kind == "progress" else parse_finding(message, self.nnodes)
        if isinstance(parsed, str):
            self.notes.note("invalid", f"dropped a {kind} message from {peer.address}: {parsed}")
            return None
        with self._lock:
            if len(parsed) == 2:
                node, age = parsed
                self._progress[node] = (time.monotonic(), age)
            else:
                self._findings.append(parsed)
        os.write(self._events_w, b"p")
        return parsed[0]

    def progress(self, node: int, age: float) -> None:
        """For every other node: this node's ranks last made progress `age` seconds ago."""
        self._tell(progress_message(node, age))

    def finding(self, node: int, kind: str, text: str) -> None:
        """For every other node: this node's finding on its ranks after the group was silent for the hang timeout."""
        self._tell(finding_message(node, kind, text))

    @abstractmethod
    def _tell(self, message: str) -> None:
        """An authenticated message for every other node."""

    def _verdict_words(self, peer: Peer, message: str) -> NodeVerdict | None:
        parsed = parse_verdict(message, self.nnodes)
        if isinstance(parsed, str):
            self.notes.note("invalid", f"dropped a verdict from {peer.address}: {parsed}")
            return None
        return parsed

    def _wake(self) -> None:
        os.write(self._wake_w, b"x")

    def _opened(self, peer: Peer, line: str) -> str | None:
        """The message of an authentic line from `peer` (which counts as a sign of life), or None (and a note)."""
        assert peer.session is not None
        message = peer.session.open(line)
        if message is None:
            self.notes.note("mac", f"dropped a line from node {peer.node} ({peer.address}) whose MAC is wrong or "
                                   f"out of sequence: {shown(line)}")
        else:
            peer.heard = time.monotonic()
        return message

    def _beat(self, peers: list[Peer]) -> None:
        """A heartbeat to each of `peers`, when one is due."""
        now = time.monotonic()
        if now >= self.next_beat:
            self.next_beat = now + self.timing.beat
            for peer in peers:
                peer.send("beat")

    def _silent(self, peer: Peer) -> bool:
        return time.monotonic() - peer.heard >= self.timing.node_timeout

    def _abort_words(self, peer: Peer, message: str) -> tuple[int, str, int] | None:
        """An authenticated abort's node, label and code, or None (and a note) when it is not one to act on."""
        parsed = parse_abort(message.split(), self.nnodes)
        if isinstance(parsed, str):
            self.notes.note("invalid", f"dropped an abort from {peer.address}: {parsed}")
            return None
        return parsed

    @abstractmethod
    def _run(self) -> None:
        """The networking thread."""

    @abstractmethod
    def abort(self, node: int, label: str, code: int) -> None:
        """Tell every other node to stop: <label> on <node> ended the run with <code>."""

    @abstractmethod
    def verdict(self, node: int, named: bool, headline: str) -> None:
        """This node's stall verdict, for every other node."""

    @abstractmethod
    def done(self) -> None:
        """This node's ranks all finished."""

    @abstractmethod
    def close(self, wait: float) -> None:
        """End the channel (after the node's ranks are gone)."""

    @abstractmethod
    def lingering(self) -> bool:
        """Whether `close` would wait: an abort not yet delivered to a node this one has not reached."""

    def hurry(self) -> None:
        """Cut `close`'s wait short (a second Ctrl-C): the nodes not reached learn of the stop by their own timeouts."""
        self.hurried = True

    def _finish_thread(self, timeout: float) -> None:
        self.closing = True
        self._wake()
        self.thread.join(timeout)
        for fd in (self.fd, self._events_w, self._wake_r, self._wake_w):
            os.close(fd)
