"""Multi-node: a failure on any node stops the ranks of every node within moments, not after an NCCL timeout.

Node 0's supervisor runs a small TCP server on ``master-addr:master-port + 1`` (`CONTROL_PORT_OFFSET`); every other
node's supervisor connects to it and proves it holds the run's secret (supervisor/control/wire.py: a
challenge-response, then an HMAC on every line). Once authenticated, the messages are:

    abort <node> <label> <code>    anyone → everyone: <label> on <node> ended the run with exit code <code> (0-255)
    done                           client → server: this node's ranks all finished
    bye                            server → clients: the run is over; a closed connection now means nothing

Node 0 relays every client's ``abort`` to the other clients, and hands it to a node that connects only later; an
aborting supervisor lingers (up to the grace period) until its abort is delivered: to every node, for node 0, or
to node 0, for the others. An authenticated connection that closes without ``done`` (seen by the server) or without
``bye`` (seen by a client), while nobody has aborted, means that supervisor died: the others treat it as an abort with
exit code 1. Every node then exits with the code of the rank that failed first, wherever it ran, and its report says
where that was.

The port is open to the whole network, so the server assumes nothing of a connection until its hello proves the
secret. A connection that has not done so within `HELLO_TIMEOUT` seconds is closed, as is one that sends a line over
`MAX_LINE` bytes or a hello that is wrong; at most `MAX_PENDING` connections may be waiting to authenticate (the
oldest is closed when another arrives), so a flood of connections holds a bounded number of file descriptors while a
real node, which answers the challenge at once, still gets in (and retries if it was pushed out). Out of file
descriptors, the server closes its oldest waiting connection, or stops accepting for a moment; it never stops
listening. A line without a valid MAC, an unknown message or an exit code outside 0-255 is dropped; nothing dropped
is acted on. A connection that closes before authenticating (``nc -z``, a port scanner) means nothing. The console
hears of every kind of drop, at most once per `NOTE_INTERVAL` with the count of the ones in between.

A background thread does the networking; the watcher's loop learns of aborts through `fd`, a pipe that becomes
readable whenever `read_events` has something.
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

from supervisor.control.wire import (LOST_CODE, MAX_LINE, SECRET_ENV, LineReader, Session, abort_message, hello_proof, is_nonce,
                                     matches, new_nonce, parse_abort, welcome_proof)
from supervisor.worker import describe_exit
from trainer.errors import UserError

CONTROL_PORT_OFFSET = 1
RETRY_INTERVAL = 0.2
HELLO_TIMEOUT = 3.0  # seconds a new connection has to authenticate
MAX_PENDING = 32  # connections waiting to authenticate, at most
ACCEPT_PAUSE = 0.1  # out of file descriptors with none to free: seconds before accepting again
SEND_TIMEOUT = 2.0
NOTE_INTERVAL = 10.0
RECV_BYTES = 4096

Event = tuple[int, str, int, str]  # node, label, exit code, why


def remote_failure(node: int, label: str, code: int) -> Event:
    if label == "supervisor":  # no rank failed there: the supervisor itself stopped (a signal such as Slurm's USR1)
        return node, label, code, f"its supervisor stopped with {describe_exit(code)}"
    return node, label, code, f"{label} failed with {describe_exit(code)}"


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
    """What the server and the client share: the secret, the event pipe, the thread, the notes."""

    def __init__(self, node_rank: int, nnodes: int, secret: bytes, say: Callable[[str], None]) -> None:
        self.node_rank, self.nnodes, self.secret = node_rank, nnodes, secret
        self.notes = Notes(say)
        self.fd, self._events_w = os.pipe()
        os.set_blocking(self.fd, False)
        self._events: list[Event] = []
        self._lock = threading.Lock()
        self.stopping = False  # an abort went out or came in: closed connections are expected from now on
        self.closing = False
        self.selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        self.selector.register(self._wake_r, selectors.EVENT_READ, None)
        self.thread = threading.Thread(target=self._run, name="supervisor-control", daemon=True)

    def _event(self, event: Event) -> None:
        with self._lock:
            self._events.append(event)
        self.stopping = True
        os.write(self._events_w, b"!")

    def read_events(self) -> list[Event]:
        try:
            os.read(self.fd, 4096)
        except BlockingIOError:
            pass
        with self._lock:
            events, self._events = self._events, []
        return events

    def _wake(self) -> None:
        os.write(self._wake_w, b"x")

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
    def done(self) -> None:
        """This node's ranks all finished."""

    @abstractmethod
    def close(self, wait: float) -> None:
        """End the channel (after the node's ranks are gone)."""

    def _finish_thread(self, timeout: float) -> None:
        self.closing = True
        self._wake()
        self.thread.join(timeout)
        for fd in (self.fd, self._events_w, self._wake_r, self._wake_w):
            os.close(fd)


class ControlServer(ControlChannel):
    """Node 0."""

    def __init__(self, node_rank: int, nnodes: int, addr: str, port: int, secret: bytes,
                 say: Callable[[str], None]) -> None:
        super().__init__(node_rank, nnodes, secret, say)
        try:
            self.listener = socket.create_server((addr, port))
        except OSError:
            try:  # master-addr may name this node by an address it cannot bind (NAT, a DNS alias)
                self.listener = socket.create_server(("", port))
            except OSError as e:
                raise UserError(f"cannot open the control port {port} (--master-port + {CONTROL_PORT_OFFSET}) "
                                f"on node 0: {e.strerror}; choose another --master-port") from None
        self.listener.setblocking(False)
        self.selector.register(self.listener, selectors.EVENT_READ, "listener")
        self.peers: list[Peer] = []  # authenticated or not
        self.abort_message: str | None = None  # the abort, for nodes that connect after it
        self.nodes_seen: set[int] = set()
        self.accept_paused_until: float | None = None
        self.thread.start()

    def _run(self) -> None:
        while not self.closing:
            for key, _ in self.selector.select(self._timeout()):
                if key.data is None:
                    os.read(self._wake_r, 64)
                elif key.data == "listener":
                    self._accept()
                elif not key.data.closed:
                    self._read(key.data)
            self._expire()

    def _waiting(self) -> list[Peer]:
        """The connections that have not authenticated yet, oldest first."""
        return [p for p in self.peers if p.session is None]

    def _timeout(self) -> float | None:
        deadlines = [p.opened + HELLO_TIMEOUT for p in self._waiting()]
        if self.accept_paused_until is not None:
            deadlines.append(self.accept_paused_until)
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def _expire(self) -> None:
        now = time.monotonic()
        for peer in self._waiting():
            if now >= peer.opened + HELLO_TIMEOUT:
                self._drop(peer, "silent", f"closed the connection from {peer.address}: it did not authenticate "
                                           f"within {HELLO_TIMEOUT:g} s")
        if self.accept_paused_until is not None and now >= self.accept_paused_until:
            self.accept_paused_until = None
            self.selector.register(self.listener, selectors.EVENT_READ, "listener")

    def _accept(self) -> None:
        try:
            sock, address = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:  # EMFILE, ENFILE, ENOBUFS: the connection stays in the backlog until there is room
            waiting = self._waiting()
            if waiting:
                self._drop(waiting[0], "descriptors", f"out of file descriptors ({e.strerror}): closed the oldest "
                                                      f"connection still to authenticate, from {waiting[0].address}")
            else:
                self.selector.unregister(self.listener)
                self.accept_paused_until = time.monotonic() + ACCEPT_PAUSE
                self.notes.note("descriptors", f"cannot accept a connection ({e.strerror}); trying again in "
                                               f"{ACCEPT_PAUSE:g} s")
            return
        waiting = self._waiting()
        if len(waiting) >= MAX_PENDING:
            self._drop(waiting[0], "crowded", f"{MAX_PENDING} connections waiting to authenticate: closed the "
                                              f"oldest, from {waiting[0].address}")
        sock.settimeout(SEND_TIMEOUT)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = Peer(sock, f"{address[0]}:{address[1]}", new_nonce())
        with self._lock:
            self.peers.append(peer)
        self.selector.register(sock, selectors.EVENT_READ, peer)
        peer.send_plain(f"challenge {peer.nonce}")

    def _read(self, peer: Peer) -> None:
        try:
            data = peer.sock.recv(RECV_BYTES)
        except OSError:
            data = b""
        if not data:
            if peer.session is None:
                self.notes.note("closed", f"a connection from {peer.address} closed before authenticating (a port "
                                          f"scan or a probe); ignored")
            self._close(peer)
            return
        lines = peer.reader.feed(data)
        if lines is None:
            self._drop(peer, "long", f"closed the connection from {peer.address}: a line over {MAX_LINE} bytes")
            return
        for line in lines:
            if peer.closed:
                return
            if peer.session is None:
                self._hello(peer, line)
            else:
                self._message(peer, line)

    def _hello(self, peer: Peer, line: str) -> None:
        words = line.split()
        if len(words) != 4 or words[0] != "hello" or not words[1].isdecimal() or not is_nonce(words[2]):
            self._drop(peer, "malformed", f"closed the connection from {peer.address}: {shown(line)} is not a hello")
            return
        node, client_nonce = int(words[1]), words[2]
        if not matches(words[3], hello_proof(self.secret, node, peer.nonce, client_nonce)):
            peer.send_plain("refused")
            self._drop(peer, "forged", f"refused a hello from {peer.address} that does not prove this run's secret "
                                       f"(a stranger, or a node started with another {SECRET_ENV})")
            return
        if not 0 < node < self.nnodes or any(p.node == node for p in self.peers):
            self._drop(peer, "node", f"closed the connection from {peer.address}: node {node} is not one of this "
                                     f"run's other nodes, or is connected already")
            return
        peer.send_plain(f"welcome {welcome_proof(self.secret, node, peer.nonce, client_nonce)}")
        with self._lock:  # from here on, abort() and close() reach this peer (after its welcome, never before)
            peer.session = Session.derive(self.secret, peer.nonce, client_nonce, server=True)
            peer.node = node
            self.nodes_seen.add(node)
            late_abort = self.abort_message
        if late_abort is not None:
            peer.send(late_abort)

    def _message(self, peer: Peer, line: str) -> None:
        assert peer.session is not None
        message = peer.session.open(line)
        if message is None:
            self.notes.note("mac", f"dropped a line from node {peer.node} ({peer.address}) whose MAC is wrong or out "
                                   f"of sequence: {shown(line)}")
        elif message == "done":
            peer.done = True
        elif message.startswith("abort "):
            parsed = self._abort_words(peer, message)
            if parsed is None:
                return
            node, label, code = parsed
            if node != peer.node:
                self.notes.note("invalid", f"dropped an abort from node {peer.node} in node {node}'s name")
                return
            with self._lock:
                self.abort_message = self.abort_message or message
            self._broadcast(message, skip=peer)
            self._event(remote_failure(node, label, code))
        else:
            self.notes.note("unknown", f"dropped an unknown message from node {peer.node}: {shown(message)}")

    def _drop(self, peer: Peer, kind: str, note: str) -> None:
        self.notes.note(kind, note)
        self._close(peer)

    def _close(self, peer: Peer) -> None:
        """Forget a connection; an authenticated node's, closed before it was done and while nobody has aborted, means
        its supervisor died."""
        if peer.closed:
            return
        self.selector.unregister(peer.sock)
        peer.closed = True
        peer.sock.close()
        with self._lock:
            self.peers.remove(peer)
        if peer.session is not None and not peer.done and not self.stopping and not self.closing:
            node = peer.node if peer.node is not None else -1
            self._broadcast(abort_message(node, "supervisor", LOST_CODE))
            self._event((node, "supervisor", LOST_CODE, f"lost contact with node {node}'s supervisor"))

    def _broadcast(self, message: str, skip: Peer | None = None) -> None:
        with self._lock:
            peers = [p for p in self.peers if p.session is not None and p is not skip]
        for peer in peers:
            peer.send(message)

    def abort(self, node: int, label: str, code: int) -> None:
        self.stopping = True
        message = abort_message(node, label, code)
        with self._lock:
            self.abort_message = self.abort_message or message
        self._broadcast(message)

    def done(self) -> None:
        """Node 0 says nothing: its `close` waits for the others."""

    def settled(self) -> bool:
        """After an abort: every other node has connected, so it has the abort. Otherwise: the connected nodes are
        done."""
        with self._lock:
            if self.stopping:
                return len(self.nodes_seen) >= self.nnodes - 1
            return all(p.done for p in self.peers if p.session is not None)

    def close(self, wait: float) -> None:
        """Give the other nodes up to `wait` seconds to finish (or to receive an abort), say ``bye``, and close
        every connection cleanly."""
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and not self.settled():
            time.sleep(0.05)
        self._broadcast("bye")
        self._finish_thread(timeout=1.0)
        with self._lock:
            peers, self.peers = self.peers, []
        for peer in peers:
            peer.shutdown()
        self.listener.close()
        self.selector.close()


class ControlClient(ControlChannel):
    """Every node but node 0."""

    def __init__(self, node_rank: int, nnodes: int, addr: str, port: int, connect_timeout: float, secret: bytes,
                 say: Callable[[str], None]) -> None:
        super().__init__(node_rank, nnodes, secret, say)
        self.addr, self.port, self.connect_timeout = addr, port, connect_timeout
        self.server: Peer | None = None  # once connected and authenticated
        self.outbox: list[str] = []  # messages from before that
        self.bye = False
        self.thread.start()

    def _send(self, message: str) -> None:
        with self._lock:
            if self.server is None:
                self.outbox.append(message)  # not authenticated yet: goes out right after the handshake
                return
            server = self.server
        server.send(message)

    def _join(self) -> Peer | None:
        """Connect and authenticate, retrying until `connect_timeout`: node 0 may not be listening yet, or may have
        closed this connection among a flood of others. None when it cannot be done (the reason is an event)."""
        deadline = time.monotonic() + self.connect_timeout
        why = "no answer"
        while not self.closing:
            try:
                sock = socket.create_connection((self.addr, self.port), timeout=HELLO_TIMEOUT)
            except OSError as e:
                why = e.strerror or str(e)
            else:
                result = self._handshake(Peer(sock, f"{self.addr}:{self.port}", new_nonce()))
                if isinstance(result, Peer):
                    return result
                sock.close()
                if result == "refused":
                    self._event((0, "supervisor", LOST_CODE, f"node 0's control server refused this node's hello: "
                                                             f"{SECRET_ENV} differs between the nodes"))
                    return None
                why = result
            if time.monotonic() >= deadline:
                if not self.stopping:
                    self._event((0, "supervisor", LOST_CODE,
                                 f"cannot reach node 0's control server at {self.addr}:{self.port} ({why})"))
                return None
            time.sleep(RETRY_INTERVAL)
        return None

    def _handshake(self, server: Peer) -> Peer | str:
        """The authenticated connection, "refused", or what went wrong."""
        try:
            words = server.read_line().split()
            if len(words) != 2 or words[0] != "challenge" or not is_nonce(words[1]):
                return "node 0 sent no challenge"
            server_nonce = words[1]
            server.send_plain(f"hello {self.node_rank} {server.nonce} "
                              f"{hello_proof(self.secret, self.node_rank, server_nonce, server.nonce)}")
            answer = server.read_line()
        except OSError as e:
            return f"handshake: {e}"
        if answer == "refused":
            return "refused"
        words = answer.split()
        expected = welcome_proof(self.secret, self.node_rank, server_nonce, server.nonce)
        if len(words) != 2 or words[0] != "welcome" or not matches(words[1], expected):
            return "node 0's answer does not prove the run's secret"
        server.session = Session.derive(self.secret, server_nonce, server.nonce, server=False)
        return server

    def _run(self) -> None:
        server = self._join()
        if server is None:
            return
        with self._lock:  # an abort that waited for the connection goes out first
            for message in self.outbox:
                server.send(message)
            self.server, self.outbox = server, []
        for line in server.backlog:
            self._message(server, line)
        self.selector.register(server.sock, selectors.EVENT_READ, "server")
        while not self.closing:
            for key, _ in self.selector.select():
                if key.data is None:
                    os.read(self._wake_r, 64)
                elif not self._read(server):
                    return

    def _read(self, server: Peer) -> bool:
        """Handle what node 0 sent; False once the connection is over."""
        try:
            data = server.sock.recv(RECV_BYTES)
        except OSError:
            data = b""
        lines = server.reader.feed(data) if data else None
        if lines is None:
            self.selector.unregister(server.sock)
            if not self.bye and not self.stopping and not self.closing:
                self._event((0, "supervisor", LOST_CODE, "lost contact with node 0's supervisor"))
            return False
        for line in lines:
            self._message(server, line)
        return True

    def _message(self, server: Peer, line: str) -> None:
        assert server.session is not None
        message = server.session.open(line)
        if message is None:
            self.notes.note("mac", f"dropped a line from node 0 whose MAC is wrong or out of sequence: {shown(line)}")
        elif message == "bye":
            self.bye = True
        elif message.startswith("abort "):
            if (parsed := self._abort_words(server, message)) is not None:
                self._event(remote_failure(*parsed))
        else:
            self.notes.note("unknown", f"dropped an unknown message from node 0: {shown(message)}")

    def abort(self, node: int, label: str, code: int) -> None:
        self.stopping = True
        self._send(abort_message(node, label, code))

    def done(self) -> None:
        self._send("done")

    def close(self, wait: float) -> None:
        """Close the connection; an abort not yet delivered (node 0 not reached so far) gets up to `wait` seconds."""
        deadline = time.monotonic() + wait
        while self.stopping and self.server is None and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        self._finish_thread(timeout=1.0)
        with self._lock:
            server, self.server = self.server, None
        if server is not None:
            server.shutdown()
        self.selector.close()


def open_channel(node_rank: int, nnodes: int, addr: str, master_port: int, connect_timeout: float, secret: bytes,
                 say: Callable[[str], None]) -> ControlChannel:
    port = master_port + CONTROL_PORT_OFFSET
    if node_rank == 0:
        return ControlServer(node_rank, nnodes, addr, port, secret, say)
    return ControlClient(node_rank, nnodes, addr, port, connect_timeout, secret, say)
