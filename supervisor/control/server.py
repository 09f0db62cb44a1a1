"""Node 0's end: the server every other node's supervisor connects to; it authenticates strangers, relays aborts and
says `bye` when the run is over.
"""

from __future__ import annotations

import errno
import math
import os
import selectors
import socket
import time
from collections.abc import Callable

from supervisor.control.channel import (
    ACCEPT_PAUSE,
    CONTROL_PORT_OFFSET,
    HELLO_TIMEOUT,
    MAX_PENDING,
    RECV_BYTES,
    REPORTS,
    SEND_TIMEOUT,
    ControlChannel,
    Peer,
    disagreement,
    host,
    lost,
    remote_failure,
    shown,
    silence,
)
from supervisor.control.wire import (
    ASSIGNED,
    MAX_LINE,
    MAX_RANKS,
    ControlKey,
    Session,
    Timing,
    abort_message,
    answer_proof,
    assembled_message,
    hello_proof,
    is_nonce,
    lost_message,
    matches,
    new_nonce,
    verdict_message,
)
from trainer.errors import UserError


def listen(port: int) -> socket.socket:
    """Node 0's control port, on every address of the node (IPv4 and IPv6 where the host has both), as torch's own
    TCPStore listens: --master-addr may name node 0 by an address the other nodes do not reach it by (a hostname that
    node 0's /etc/hosts maps to 127.0.1.1, NAT, a DNS alias). Raises OSError (the port is taken)."""
    if socket.has_dualstack_ipv6():
        return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
    return socket.create_server(("", port))


def port_refused(port: int, e: OSError) -> UserError:
    return UserError(f"cannot open the control port {port} (--master-port + {CONTROL_PORT_OFFSET}) on node 0: "
                     f"{e.strerror or e}; choose another --master-port")


def names_this_machine(addr: str) -> bool:
    """Whether `addr` is an address of this machine (or a name for one): one of its addresses binds, on port 0, so
    that no port is taken."""
    try:
        found = socket.getaddrinfo(addr, 0, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False
    for family, kind, proto, _, address in found:
        with socket.socket(family, kind, proto) as probe:
            try:
                probe.bind(address)
                return True
            except OSError:
                continue
    return False


def claim(addr: str, port: int) -> socket.socket | None:
    """The control port for a node started without --node-rank: the node at --master-addr that opens it first is
    node 0 (torchrun's c10d rendezvous makes the endpoint's host its store alike). None when --master-addr is not
    this machine (or does not resolve), or when another node on this machine holds the port: this node is then one of
    the others. Where --master-addr names node 0 by an address it does not have (NAT), the nodes need --node-rank."""
    if not names_this_machine(addr):
        return None
    try:
        return listen(port)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            return None
        raise port_refused(port, e) from None


class ControlServer(ControlChannel):
    """Node 0."""

    def __init__(self, nnodes: int, ranks: int, listener: socket.socket, key: ControlKey, timing: Timing,
                 say: Callable[[str], None]) -> None:
        super().__init__(0, nnodes, ranks, key, timing, say)
        self.sizes = {0: ranks}  # node → its ranks, as each joined
        self.listener = listener
        self.listener.setblocking(False)
        self.selector.register(self.listener, selectors.EVENT_READ, "listener")
        self.peers: list[Peer] = []  # authenticated or not
        self.abort_message: str | None = None  # the abort, for nodes that connect after it
        self.nodes_seen: set[int] = set()
        self.accept_paused_until: float | None = None
        self.join_deadline = time.monotonic() + timing.join_timeout  # inf once every node joined, or after
        self.refused: dict[int, str] = {}  # a node that has not joined → the address of a refused hello in its name
        self.duplicates: dict[int, str] = {}  # a node that joined → the address of a second node in its name
        self.given_up: set[int] = set()  # the nodes named as never joined: no abort waits to be handed to them
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

    def _live(self) -> list[Peer]:
        """The connected nodes whose ranks are still at work: each must be heard from every `node_timeout`."""
        return [p for p in self.peers if p.session is not None and not p.done]

    def _timeout(self) -> float | None:
        deadlines = [p.opened + HELLO_TIMEOUT for p in self._waiting()]
        if self.accept_paused_until is not None:
            deadlines.append(self.accept_paused_until)
        if not self.stopping:
            live = self._live()
            deadlines += [p.heard + self.timing.node_timeout for p in live]
            deadlines += [self.next_beat] if live else []
            deadlines.append(self.join_deadline)
        finite = [d for d in deadlines if d != math.inf]
        return max(0.0, min(finite) - time.monotonic()) if finite else None

    def _expire(self) -> None:
        now = time.monotonic()
        self._beat([p for p in self.peers if p.session is not None])
        if not self.stopping and not self.closing:
            for peer in self._live():
                if self._silent(peer):
                    self._close(peer, silence(peer.node or 0, peer.address, peer.heard))
            if now >= self.join_deadline:
                self._never_joined()
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
        # a node reaching the dual-stack port over IPv4 is named by its IPv4 address, not ::ffff:10.0.0.2
        peer = Peer(sock, f"{address[0].removeprefix('::ffff:')}:{address[1]}", new_nonce())
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
        if (len(words) != 6 or words[0] != "hello" or not (words[1].isdecimal() or words[1] == ASSIGNED)
                or not words[2].isdecimal() or not words[3].isdecimal() or not 0 < int(words[3]) <= MAX_RANKS
                or not is_nonce(words[4])):
            self._drop(peer, "malformed", f"closed the connection from {peer.address}: {shown(line)} is not a hello")
            return
        asked, nnodes, ranks = (None if words[1] == ASSIGNED else int(words[1])), int(words[2]), int(words[3])
        client_nonce = words[4]
        if not matches(words[5], hello_proof(self.key.key, asked, nnodes, ranks, peer.nonce, client_nonce)):
            peer.send_plain("refused")
            if asked is not None and 0 < asked < self.nnodes and asked not in self.nodes_seen:  # each named at once
                self.refused[asked] = peer.address
                left = max(0.0, self.join_deadline - time.monotonic())
                self._drop(peer, f"forged-{asked}", f"refused a hello as node {asked} from {peer.address}: it does "
                                                    f"not prove this run's key ({self.key.differs}); unless node "
                                                    f"{asked} joins, the run stops in {left:.0f} s (--join-timeout)")
            else:
                self._drop(peer, "forged", f"refused a hello from {peer.address} that does not prove this run's key "
                                           f"(a stranger, or {self.key.differs})")
            return
        if nnodes != self.nnodes:  # a node of this run, proven, that cannot be one of its nodes: both stop, saying so
            answer = f"nnodes {self.nnodes}"
            peer.send_plain(f"{answer} {answer_proof(self.key.key, answer, peer.nonce, client_nonce)}")
            self._close(peer)
            self._event(disagreement(0, self.nnodes, nnodes, f"the node at {host(peer.address)}"))
            return
        node = self._free_node() if asked is None else asked
        if node is None:
            peer.send_plain(f"full {answer_proof(self.key.key, 'full', peer.nonce, client_nonce)}")
            self._drop(peer, "node", f"refused a node without --node-rank from {peer.address}: all {self.nnodes} "
                                     f"nodes of this run (--nnodes {self.nnodes}) have joined")
            return
        if any(p.node == node for p in self.peers):  # two nodes given one --node-rank: the second stops at once
            answer = f"taken {node}"
            peer.send_plain(f"{answer} {answer_proof(self.key.key, answer, peer.nonce, client_nonce)}")
            self.duplicates[node] = peer.address
            self._drop(peer, "node", f"refused a second node {node} from {host(peer.address)}: node {node} joined "
                                     f"already (two nodes were given --node-rank {node})")
            return
        if not 0 < node < self.nnodes:
            self._drop(peer, "node", f"closed the connection from {peer.address}: node {node} is not one of this "
                                     f"run's other nodes")
            return
        answer = f"welcome {node}"
        peer.send_plain(f"{answer} {answer_proof(self.key.key, answer, peer.nonce, client_nonce)}")
        with self._lock:  # from here on, abort() and close() reach this peer (after its welcome, never before)
            peer.session = Session.derive(self.key.key, peer.nonce, client_nonce, server=True)
            peer.node = node
            self.nodes_seen.add(node)
            self.sizes[node] = ranks
            everyone = len(self.nodes_seen) == self.nnodes - 1
            if everyone:
                self.join_deadline = math.inf
            late_abort = self.abort_message
        ranks_there = f" with {ranks} rank{'s' * (ranks > 1)}" if ranks != self.ranks else ""
        self.say(f"control port: node {node} joined from {host(peer.address)}{ranks_there}")
        if late_abort is not None:
            peer.send(late_abort)
        elif everyone:  # the run is assembled: every node may start its ranks
            sizes = tuple(self.sizes[n] for n in range(self.nnodes))
            self._broadcast(assembled_message(sizes))
            self._assemble(sizes)

    def _free_node(self) -> int | None:
        """The node rank a node started without --node-rank gets: the lowest that has not joined (in the order they
        join, as torchrun's c10d rendezvous numbers its nodes), None when every node has."""
        taken = self.nodes_seen | self.given_up | {p.node for p in self.peers if p.node is not None}
        return next((n for n in range(1, self.nnodes) if n not in taken), None)

    def _message(self, peer: Peer, line: str) -> None:
        message = self._opened(peer, line)
        if message is None or message == "beat":
            pass
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
        elif message.startswith("verdict "):
            verdict = self._verdict_words(peer, message)
            if verdict is None or verdict[0] != peer.node:
                return
            self._broadcast(message, skip=peer)
            self._verdict(verdict)
        elif message.startswith(REPORTS):  # a node speaks for itself; the others hear it through node 0
            if message.split(" ", 2)[1] == str(peer.node) and self._report(peer, message) is not None:
                self._broadcast(message, skip=peer)
        else:
            self.notes.note("unknown", f"dropped an unknown message from node {peer.node}: {shown(message)}")

    def _drop(self, peer: Peer, kind: str, note: str) -> None:
        self.notes.note(kind, note)
        self._close(peer)

    def _close(self, peer: Peer, why: str | None = None) -> None:
        """Forget a connection; an authenticated node's, closed before it was done and while nobody has aborted, means
        its supervisor was lost: it died, or (`why`) it stopped answering."""
        if peer.closed:
            return
        self.selector.unregister(peer.sock)
        peer.closed = True
        peer.sock.close()
        with self._lock:
            self.peers.remove(peer)
        if peer.session is not None and not peer.done and not self.stopping and not self.closing:
            node = peer.node or 0
            self._lose(node, why or f"lost contact with node {node}'s supervisor ({host(peer.address)}): its "
                                    f"connection closed")

    def _lose(self, node: int, why: str) -> None:
        """`node` was lost: the other nodes hear why (as does one that connects later), and so does this one."""
        message = lost_message(node, why)
        with self._lock:
            self.abort_message = self.abort_message or message
        self._broadcast(message)
        self._event(lost(node, why))

    def _never_joined(self) -> None:
        """The join timeout ran out: the nodes still missing are named, with the hellos refused in their names."""
        self.join_deadline = math.inf
        missing = [n for n in range(1, self.nnodes) if n not in self.nodes_seen]
        if not missing:
            return
        self.given_up.update(missing)
        names = f"node{'s' * (len(missing) > 1)} {', '.join(map(str, missing))}"
        why = (f"{names} never joined: no supervisor of {'them' if len(missing) > 1 else 'it'} connected to node 0 "
               f"and proved this run's key within {self.timing.join_timeout:g} s (--join-timeout)")
        why += "".join(f"; a hello as node {n} from {host(self.refused[n])} was refused ({self.key.differs})"
                       for n in missing if n in self.refused)
        why += "".join(f"; a second node {n} came from {host(address)} (two nodes were given --node-rank {n}; one of "
                       f"them was meant to be node {missing[0]}?)" for n, address in self.duplicates.items())
        self._lose(missing[0], why)

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

    def verdict(self, node: int, named: bool, headline: str) -> None:
        self._broadcast(verdict_message(node, named, headline))

    def _tell(self, message: str) -> None:
        self._broadcast(message)

    def done(self) -> None:
        """Node 0 says nothing: its `close` waits for the others."""

    def settled(self) -> bool:
        """After an abort: every other node has connected, so it has the abort (or was given up as never joined).
        Otherwise: the connected nodes are done."""
        with self._lock:
            if self.stopping:
                return len(self.nodes_seen | self.given_up) >= self.nnodes - 1
            return all(p.done for p in self.peers if p.session is not None)

    def lingering(self) -> bool:
        return self.stopping and not self.settled() and not self.hurried

    def close(self, wait: float) -> None:
        """Give the other nodes up to `wait` seconds to finish (or to receive an abort), say ``bye``, and close
        every connection cleanly."""
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and not self.settled() and not self.hurried:
            time.sleep(0.05)
        self._broadcast("bye")
        self._finish_thread(timeout=1.0)
        with self._lock:
            peers, self.peers = self.peers, []
        for peer in peers:
            peer.shutdown()
        self.listener.close()
        self.selector.close()
