"""Multi-node: a failure on any node stops the ranks of every node within moments, not after an NCCL timeout.

Node 0's supervisor runs a small TCP server on ``master-addr:master-port + 1`` (`CONTROL_PORT_OFFSET`); every other
node's supervisor connects to it. The messages are text lines:

    hello <node>                   client → server, once connected
    abort <node> <label> <code>    anyone → everyone: <label> on <node> ended the run with exit code <code>
    done <node>                    client → server: this node's ranks all finished
    bye                            server → clients: the run is over; a closed connection now means nothing

Node 0 relays every client's ``abort`` to the other clients, and hands it to a node that connects only later; an
aborting supervisor lingers (up to the grace period) until its abort is delivered: to every node, for node 0, or
to node 0, for the others. A connection that closes without ``done`` (seen by the
server) or without ``bye`` (seen by a client), while nobody has aborted, means that supervisor died: the others
treat it as an abort with exit code 1. Every node then exits with the code of the rank that failed first, wherever
it ran, and its report says where that was.

A background thread does the networking; the watcher's loop learns of aborts through `fd`, a pipe that becomes
readable whenever `read_events` has something.
"""

from __future__ import annotations

import os
import selectors
import socket
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

from supervisor.worker import describe_exit
from trainer.errors import UserError

CONTROL_PORT_OFFSET = 1
RETRY_INTERVAL = 0.2
LOST_CODE = 1

Event = tuple[int, str, int, str]  # node, label, exit code, why


@dataclass
class Peer:
    sock: socket.socket
    node: int | None = None
    done: bool = False
    pending: bytes = b""

    def feed(self, data: bytes) -> list[str]:
        *lines, self.pending = (self.pending + data).split(b"\n")
        return [line.decode(errors="replace").strip() for line in lines if line.strip()]


def abort_line(node: int, label: str, code: int) -> bytes:
    return f"abort {node} {label} {code}\n".encode()


def parse_abort(words: list[str]) -> Event | None:
    if len(words) == 4 and words[1].isdigit() and words[3].lstrip("-").isdigit():
        node, label, code = int(words[1]), words[2], int(words[3])
        return node, label, code, f"{label} failed with {describe_exit(code)}"
    return None


class ControlChannel(ABC):
    """What the server and the client share: the event pipe, the thread, the send lock."""

    def __init__(self, node_rank: int, nnodes: int) -> None:
        self.node_rank, self.nnodes = node_rank, nnodes
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

    def __init__(self, node_rank: int, nnodes: int, addr: str, port: int) -> None:
        super().__init__(node_rank, nnodes)
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
        self.peers: list[Peer] = []
        self.abort_message: bytes | None = None  # the abort, for nodes that connect after it
        self.nodes_seen: set[int] = set()
        self.thread.start()

    def _run(self) -> None:
        while not self.closing:
            for key, _ in self.selector.select():
                if key.data is None:
                    os.read(self._wake_r, 64)
                elif key.data == "listener":
                    self._accept()
                else:
                    self._read(key.data)

    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        sock.setblocking(True)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = Peer(sock)
        with self._lock:
            self.peers.append(peer)
            late_abort = self.abort_message
        self.selector.register(sock, selectors.EVENT_READ, peer)
        if late_abort is not None:
            try:
                sock.sendall(late_abort)
            except OSError:
                pass

    def _read(self, peer: Peer) -> None:
        try:
            data = peer.sock.recv(4096)
        except OSError:
            data = b""
        if not data:
            self.selector.unregister(peer.sock)
            peer.sock.close()
            with self._lock:
                self.peers.remove(peer)
            if not peer.done and not self.stopping and not self.closing:
                node = peer.node if peer.node is not None else -1
                self._broadcast(abort_line(node, "supervisor", LOST_CODE))
                self._event((node, "supervisor", LOST_CODE, f"lost contact with node {node}'s supervisor"))
            return
        for line in peer.feed(data):
            words = line.split()
            if words[0] == "hello" and len(words) == 2 and words[1].isdigit():
                peer.node = int(words[1])
                self.nodes_seen.add(peer.node)
            elif words[0] == "done":
                peer.done = True
            elif words[0] == "abort" and (event := parse_abort(words)) is not None:
                self.abort_message = self.abort_message or line.encode() + b"\n"
                self._broadcast(line.encode() + b"\n", skip=peer)
                self._event(event)

    def _broadcast(self, line: bytes, skip: Peer | None = None) -> None:
        with self._lock:
            peers = [p for p in self.peers if p is not skip]
        for peer in peers:
            try:
                peer.sock.sendall(line)
            except OSError:
                pass

    def abort(self, node: int, label: str, code: int) -> None:
        self.stopping = True
        self.abort_message = self.abort_message or abort_line(node, label, code)
        self._broadcast(abort_line(node, label, code))

    def done(self) -> None:
        """Node 0 says nothing: its `close` waits for the others."""

    def settled(self) -> bool:
        """After an abort: every other node has connected, so it has the abort. Otherwise: the connected nodes are
        done."""
        with self._lock:
            if self.stopping:
                return len(self.nodes_seen) >= self.nnodes - 1
            return all(p.done for p in self.peers)

    def close(self, wait: float) -> None:
        """Give the other nodes up to `wait` seconds to finish (or to receive an abort), say ``bye``, and close
        every connection cleanly."""
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and not self.settled():
            time.sleep(0.05)
        self._broadcast(b"bye\n")
        self._finish_thread(timeout=1.0)
        with self._lock:
            peers, self.peers = self.peers, []
        for peer in peers:
            try:
                peer.sock.shutdown(socket.SHUT_WR)  # the last lines still arrive; a plain close could reset them
            except OSError:
                pass
            peer.sock.close()
        self.listener.close()
        self.selector.close()


class ControlClient(ControlChannel):
    """Every node but node 0."""

    def __init__(self, node_rank: int, nnodes: int, addr: str, port: int, connect_timeout: float) -> None:
        super().__init__(node_rank, nnodes)
        self.addr, self.port, self.connect_timeout = addr, port, connect_timeout
        self.sock: socket.socket | None = None
        self.outbox: list[bytes] = [f"hello {node_rank}\n".encode()]
        self.bye = False
        self.thread.start()

    def _send(self, line: bytes) -> None:
        with self._lock:
            if self.sock is None:
                self.outbox.append(line)  # not connected yet: goes out right after the hello
                return
            sock = self.sock
        try:
            sock.sendall(line)
        except OSError:
            pass

    def _connect(self) -> socket.socket | None:
        deadline = time.monotonic() + self.connect_timeout
        while not self.closing:
            try:
                sock = socket.create_connection((self.addr, self.port), timeout=5)
                sock.settimeout(None)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return sock
            except OSError:
                if time.monotonic() >= deadline:
                    return None
                time.sleep(RETRY_INTERVAL)
        return None

    def _run(self) -> None:
        sock = self._connect()
        if sock is None:
            if not self.closing and not self.stopping:
                self._event((0, "supervisor", LOST_CODE,
                             f"cannot reach node 0's control server at {self.addr}:{self.port}"))
            return
        with self._lock:  # the hello, and an abort that waited for the connection, go out first
            for line in self.outbox:
                try:
                    sock.sendall(line)
                except OSError:
                    pass
            self.sock, self.outbox = sock, []
        self.selector.register(sock, selectors.EVENT_READ, "server")
        peer = Peer(sock)
        while not self.closing:
            for key, _ in self.selector.select():
                if key.data is None:
                    os.read(self._wake_r, 64)
                    continue
                try:
                    data = sock.recv(4096)
                except OSError:
                    data = b""
                if not data:
                    self.selector.unregister(sock)
                    if not self.bye and not self.stopping and not self.closing:
                        self._event((0, "supervisor", LOST_CODE, "lost contact with node 0's supervisor"))
                    return
                for line in peer.feed(data):
                    words = line.split()
                    if words[0] == "bye":
                        self.bye = True
                    elif words[0] == "abort" and (event := parse_abort(words)) is not None:
                        self._event(event)

    def abort(self, node: int, label: str, code: int) -> None:
        self.stopping = True
        self._send(abort_line(node, label, code))

    def done(self) -> None:
        self._send(f"done {self.node_rank}\n".encode())

    def close(self, wait: float) -> None:
        """Close the connection; an abort not yet delivered (node 0 not reached so far) gets up to `wait` seconds."""
        deadline = time.monotonic() + wait
        while self.stopping and self.sock is None and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        self._finish_thread(timeout=1.0)
        with self._lock:
            sock, self.sock = self.sock, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            sock.close()
        self.selector.close()


def open_channel(node_rank: int, nnodes: int, addr: str, master_port: int, connect_timeout: float) -> ControlChannel:
    port = master_port + CONTROL_PORT_OFFSET
    if node_rank == 0:
        return ControlServer(node_rank, nnodes, addr, port)
    return ControlClient(node_rank, nnodes, addr, port, connect_timeout)
