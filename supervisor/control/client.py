"""The end of every node but 0: connects to node 0 (retrying until the join timeout), proves the key, passes
aborts both ways, and beats; node 0 silent for the node timeout is lost. A node started without --node-rank learns
its node rank from node 0's welcome (`node_rank` is None until then, and the event pipe wakes whoever waits for it).
Node 0's answers that prove the key are final (the run is full, the nodes disagree on --nnodes); a ``refused``, which
cannot prove anything, is said at once and tried again until the join timeout (supervisor/control/wire.py).
"""

from __future__ import annotations

import os
import selectors
import socket
import time
from collections.abc import Callable

from supervisor.control.channel import (
    HELLO_TIMEOUT,
    RECV_BYTES,
    REPORTS,
    RETRY_INTERVAL,
    ControlChannel,
    Event,
    Peer,
    disagreement,
    lost,
    remote_failure,
    shown,
    silence,
)
from supervisor.control.wire import (
    ControlKey,
    Session,
    Timing,
    abort_message,
    answer_proof,
    hello_line,
    is_nonce,
    matches,
    new_nonce,
    parse_assembled,
    parse_lost,
    verdict_message,
)


REFUSED = "node 0's control server refused this node's hello"  # what a `refused` answer is said as


class ControlClient(ControlChannel):
    """Every node but node 0."""

    def __init__(self, node_rank: int | None, nnodes: int, ranks: int, server: tuple[str, int],
                 local_addr: str | None, key: ControlKey, timing: Timing, say: Callable[[str], None]) -> None:
        super().__init__(node_rank, nnodes, ranks, key, timing, say)
        (self.addr, self.port), self.local_addr = server, local_addr
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
        """Connect and authenticate, retrying until the join timeout: node 0 may not be listening yet, may have
        closed this connection among a flood of others, or may not be node 0 at all (a refusal proves nothing). None
        when it cannot be done (the reason is an event)."""
        deadline = time.monotonic() + self.timing.join_timeout
        why, refusal = "no answer", ""  # the last attempt's reason; a refusal, the likeliest cause, is kept apart
        while not self.closing:
            try:
                sock = socket.create_connection((self.addr, self.port), timeout=HELLO_TIMEOUT,
                                                source_address=(self.local_addr, 0) if self.local_addr else None)
            except OSError as e:
                why = e.strerror or str(e)
            else:
                result = self._handshake(Peer(sock, f"{self.addr}:{self.port}", new_nonce(), node=0))
                if isinstance(result, Peer):
                    return result
                sock.close()
                if isinstance(result, Event):
                    self._event(result)
                    return None
                if result == REFUSED:
                    result = refusal = f"{REFUSED}: {self.key.differs}"
                    self.notes.note("refused", f"{result} (at {self.addr}:{self.port}); trying again until "
                                               f"--join-timeout ({self.timing.join_timeout:g} s) runs out: a refusal "
                                               f"proves nothing, whoever answers on that port can send one")
                why = result
            if time.monotonic() >= deadline:
                if not self.stopping:
                    why += f" (before that, {refusal})" if refusal and refusal != why else ""
                    self._event(lost(0, f"could not join node 0's control server at {self.addr}:{self.port} "
                                        f"within {self.timing.join_timeout:g} s (--join-timeout): {why}"))
                return None
            time.sleep(RETRY_INTERVAL)
        return None

    def _handshake(self, server: Peer) -> Peer | Event | str:
        """The authenticated connection; node 0's final answer, proven (the run is full, or was started with another
        --nnodes), as the event that ends this node; or what went wrong, to try again (`REFUSED`: another key)."""
        try:
            words = server.read_line().split()
            if len(words) != 2 or words[0] != "challenge" or not is_nonce(words[1]):
                return "node 0 sent no challenge"
            server_nonce = words[1]
            server.send_plain(hello_line(self.key.key, self.node_rank, self.nnodes, self.ranks, server_nonce,
                                         server.nonce))
            answer = server.read_line()
        except OSError as e:
            return f"handshake: {e}"
        if answer == "refused":
            return REFUSED
        *said, given = answer.split()
        if not said or not matches(given, answer_proof(self.key.key, " ".join(said), server_nonce, server.nonce)):
            return "node 0's answer does not prove the run's key"
        if len(said) == 2 and said[0] == "taken" and said[1].isdecimal():
            return lost(0, f"node 0's control server refused this node: node {said[1]} has joined already "
                           f"(two nodes were given --node-rank {said[1]}: give each its own, within "
                           f"1-{self.nnodes - 1})")
        if said == ["full"]:
            return lost(0, f"node 0's control server refused this node: all {self.nnodes} nodes of the run (--nnodes "
                           f"{self.nnodes}) have joined already")
        if len(said) == 2 and said[0] == "nnodes" and said[1].isdecimal():
            return disagreement(0, self.nnodes, int(said[1]), f"node 0 ({self.addr})")
        if len(said) != 2 or said[0] != "welcome" or not said[1].isdecimal():
            return "node 0's answer is not a welcome"
        node = int(said[1])
        asked_for = node == self.node_rank if self.node_rank is not None else 0 < node < self.nnodes
        if not asked_for:
            return f"node 0 welcomed this node as node {node}"
        server.session = Session.derive(self.key.key, server_nonce, server.nonce, server=False)
        if self.node_rank is None:
            self.node_rank = node
            os.write(self._events_w, b"j")  # wakes a launcher waiting for its node rank
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
            deadline = min(self.next_beat, server.heard + self.timing.node_timeout)
            for key, _ in self.selector.select(max(0.0, deadline - time.monotonic())):
                if key.data is None:
                    os.read(self._wake_r, 64)
                elif not self._read(server):
                    return
            self._beat([server])
            if self._silent(server) and not (self.bye or self.stopping or self.closing):
                self._event(lost(0, silence(0, server.address, server.heard)))
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
                self._event(lost(0, f"lost contact with node 0's supervisor ({self.addr}): its connection closed"))
            return False
        for line in lines:
            self._message(server, line)
        return True

    def _message(self, server: Peer, line: str) -> None:
        message = self._opened(server, line)
        if message is None or message == "beat":
            pass
        elif message.startswith("lost "):
            parsed = parse_lost(message, self.nnodes)
            if isinstance(parsed, str):
                self.notes.note("invalid", f"dropped a lost message from node 0: {parsed}")
            else:
                self._event(lost(*parsed))
        elif message.startswith("verdict "):
            if (verdict := self._verdict_words(server, message)) is not None:
                self._verdict(verdict)
        elif message.startswith(REPORTS):
            self._report(server, message)
        elif message.startswith("assembled "):
            parsed = parse_assembled(message, self.nnodes, self.node_rank or 0, self.ranks)
            if isinstance(parsed, str):
                self.notes.note("invalid", f"dropped an assembled message from node 0: {parsed}")
            else:
                self._assemble(parsed)
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

    def verdict(self, node: int, named: bool, headline: str) -> None:
        self._send(verdict_message(node, named, headline))

    def _tell(self, message: str) -> None:
        self._send(message)

    def done(self) -> None:
        self._send("done")

    def lingering(self) -> bool:
        return self.stopping and self.server is None and self.thread.is_alive() and not self.hurried

    def close(self, wait: float) -> None:
        """Close the connection; an abort not yet delivered (node 0 not reached so far) gets up to `wait` seconds."""
        deadline = time.monotonic() + wait
        while self.lingering() and time.monotonic() < deadline:
            time.sleep(0.05)
        self._finish_thread(timeout=1.0)
        with self._lock:
            server, self.server = self.server, None
        if server is not None:
            server.shutdown()
        self.selector.close()
