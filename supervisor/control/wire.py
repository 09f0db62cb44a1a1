"""What crosses the control channel's wire: bounded text lines, the handshake that proves a shared secret, and the
per-message HMAC that keeps strangers and replays out.

The control port is reachable by anyone on the cluster's network, so nothing a connection says is acted on until it
has proven it holds the run's secret, `SUPERVISOR_CONTROL_SECRET` (the same on every node; it never crosses the
wire). The handshake is a challenge-response with a fresh nonce from each side:

    challenge <server-nonce>                 server → client, as soon as the connection is accepted
    hello <node> <client-nonce> <proof>      client → server; proof = HMAC(secret, "hello <node> <both nonces>");
                                             <node> is `?` from a node started without --node-rank
    welcome <node> <proof>                   server → client; proof = HMAC(secret, "welcome <node> <both nonces>");
                                             <node> is the one asked for, or the one node 0 gives a `?`
    refused                                  server → client: the hello's proof is wrong (another secret)
    full                                     server → client: a `?` hello, but every node of the run has joined

A node that authenticated is then heard from at least every few seconds (``beat``, `Timing`), so a node that
stops answering (frozen, cut off) is told apart from one that is merely quiet; see supervisor/control/__init__.py.

Both sides then derive a session key from the secret and both nonces, and every later line is ``<message> <mac>``:
HMAC-SHA256 under that key over the direction, the line's sequence number in that direction, and the message. A line
recorded on one connection is worthless on another (other nonces, other key), and on its own connection it is out of
sequence. Lines are at most `MAX_LINE` bytes; a longer one ends the connection, so a peer that never sends a newline
costs a bounded buffer, read once.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Mapping
from dataclasses import dataclass

from trainer.errors import UserError

SECRET_ENV = "SUPERVISOR_CONTROL_SECRET"
MIN_SECRET_LENGTH = 16
MIN_SECRET_DISTINCT = 8  # "aaaaaaaaaaaaaaaa" is long enough and guessed at once
MAX_LINE = 512
NONCE_HEX = 32  # 16 random bytes
MAX_EXIT_CODE = 255
HANG_CODE = 124  # a stalled group, as timeout(1) reports a command that ran out of time
ASSIGNED = "?"  # a hello's node for a node started without --node-rank: node 0 gives it the next free one
LOST_CODE = 125  # a node was lost (it stopped answering, died, or never joined): no rank's code to give
MAX_WHY = 300  # a `lost` message's explanation, in characters
MAX_VERDICT = 400  # a `verdict` message's headline, in characters
MAX_BEAT_INTERVAL = 2.0  # seconds between heartbeats, at most
MAX_LABEL = 32
SECRET_HINT = (f"set {SECRET_ENV} to the same random value on every node before starting them, e.g. export "
               f"{SECRET_ENV}=$(python3 -c 'import secrets; print(secrets.token_hex(32))'); train_slurm.sbatch "
               f"sets one for its job")

@dataclass(frozen=True)
class Timing:
    """How long a node may be silent, and how long the others wait for one to join.

    Every authenticated line counts as a sign of life; a ``beat`` goes out every `beat` seconds both ways, so that a
    node stays heard while nothing else happens. A connected node silent for `node_timeout` (its supervisor frozen,
    its host or the network gone without a reset) is lost; a node that has not joined `join_timeout` seconds after
    node 0 opened the channel never will."""

    node_timeout: float = 30.0
    join_timeout: float = 300.0

    @property
    def beat(self) -> float:
        return min(MAX_BEAT_INTERVAL, self.node_timeout / 4)


def read_secret(env: Mapping[str, str]) -> bytes:
    """The run's control secret: a multi-node launch without one is refused before anything starts."""
    secret = env.get(SECRET_ENV, "")
    if not secret:
        raise UserError(f"a multi-node run needs {SECRET_ENV}, which authenticates the nodes to each other on the "
                        f"control port; {SECRET_HINT}")
    if len(secret) < MIN_SECRET_LENGTH:
        raise UserError(f"{SECRET_ENV} has {len(secret)} characters; use at least {MIN_SECRET_LENGTH} random ones: "
                        f"{SECRET_HINT}")
    if len(set(secret)) < MIN_SECRET_DISTINCT:
        raise UserError(f"{SECRET_ENV} has only {len(set(secret))} distinct characters; use at least "
                        f"{MIN_SECRET_DISTINCT} (a random value): {SECRET_HINT}")
    return secret.encode()


def new_nonce() -> str:
    return secrets.token_hex(NONCE_HEX // 2)


def is_nonce(word: str) -> bool:
    return len(word) == NONCE_HEX and all(c in "0123456789abcdef" for c in word)


def proof(secret: bytes, text: str) -> str:
    return hmac.new(secret, text.encode(), hashlib.sha256).hexdigest()


def node_word(node: int | None) -> str:
    """A node's rank in a hello: `ASSIGNED` for a node whose rank node 0 gives."""
    return ASSIGNED if node is None else str(node)


def hello_proof(secret: bytes, node: int | None, server_nonce: str, client_nonce: str) -> str:
    return proof(secret, f"hello {node_word(node)} {server_nonce} {client_nonce}")


def welcome_proof(secret: bytes, node: int, server_nonce: str, client_nonce: str) -> str:
    return proof(secret, f"welcome {node} {server_nonce} {client_nonce}")


def matches(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())


@dataclass
class Session:
    """One authenticated connection's message authentication: a key of its own and a sequence number each way."""

    key: bytes
    outgoing: str  # "s2c" on the server, "c2s" on a client
    incoming: str
    sent: int = 0
    received: int = 0

    @classmethod
    def derive(cls, secret: bytes, server_nonce: str, client_nonce: str, server: bool) -> "Session":
        key = hmac.new(secret, f"session {server_nonce} {client_nonce}".encode(), hashlib.sha256).digest()
        return cls(key, "s2c", "c2s") if server else cls(key, "c2s", "s2c")

    def _mac(self, direction: str, sequence: int, message: str) -> str:
        return hmac.new(self.key, f"{direction} {sequence} {message}".encode(), hashlib.sha256).hexdigest()

    def seal(self, message: str) -> bytes:
        """The line to send; callers serialise their sends, so sequence numbers go out in order."""
        line = f"{message} {self._mac(self.outgoing, self.sent, message)}\n".encode()
        self.sent += 1
        return line

    def open(self, line: str) -> str | None:
        """The message of an authentic, in-sequence line; None (and the sequence unchanged) for anything else."""
        message, _, mac = line.rpartition(" ")
        if not message or not matches(mac, self._mac(self.incoming, self.received, message)):
            return None
        self.received += 1
        return message


class LineReader:
    """Splits a byte stream into lines of at most `MAX_LINE` bytes. Only the unfinished tail is kept between reads,
    and it never exceeds the limit, so every byte is looked at a bounded number of times."""

    def __init__(self, limit: int = MAX_LINE) -> None:
        self.limit = limit
        self.tail = b""

    def feed(self, data: bytes) -> list[str] | None:
        """The complete lines `data` finishes (decoded, stripped, empty ones left out); None when a line is over the
        limit, after which the connection should be closed."""
        *lines, tail = (self.tail + data).split(b"\n")
        if len(tail) > self.limit or any(len(line) > self.limit for line in lines):
            return None
        self.tail = tail
        return [text for line in lines if (text := line.decode(errors="replace").strip())]


def abort_message(node: int, label: str, code: int) -> str:
    return f"abort {node} {label} {code}"


def parse_abort(words: list[str], nnodes: int) -> tuple[int, str, int] | str:
    """An ``abort <node> <label> <code>`` message as (node, label, code), or why it is refused."""
    if len(words) != 4:
        return "an abort needs a node, a label and an exit code"
    _, node_text, label, code_text = words
    if not (node_text.isascii() and node_text.isdigit()) or int(node_text) >= nnodes:
        return f"node {node_text[:20]!r} is not one of this run's {nnodes} nodes"
    if not (code_text.isascii() and code_text.isdigit()) or int(code_text) > MAX_EXIT_CODE:
        return f"exit code {code_text[:24]!r} is not within 0-{MAX_EXIT_CODE}"
    if not (label.isascii() and label.isprintable()) or len(label) > MAX_LABEL:
        return f"label {label[:MAX_LABEL]!r} is not a device label"
    return int(node_text), label, int(code_text)


def lost_message(node: int, why: str) -> str:
    return f"lost {node} {why[:MAX_WHY]}"


def parse_lost(message: str, nnodes: int) -> tuple[int, str] | str:
    """A ``lost <node> <why>`` message (node 0 telling the others a node was lost) as (node, why), or why it is
    refused."""
    words = message.split(" ", 2)
    if len(words) != 3:
        return "a lost message needs a node and an explanation"
    _, node_text, why = words
    if not (node_text.isascii() and node_text.isdigit()) or int(node_text) >= nnodes:
        return f"node {node_text[:20]!r} is not one of this run's {nnodes} nodes"
    if not (why.isascii() and why.isprintable()) or len(why) > MAX_WHY:
        return "its explanation is not printable text"
    return int(node_text), why


def verdict_message(node: int, named: bool, headline: str) -> str:
    """A node's stall verdict: whether its evidence names a rank of its own, and its headline (made ASCII: the
    line's words are checked as printable ASCII on arrival)."""
    text = headline.encode("ascii", "replace").decode()[:MAX_VERDICT]
    return f"verdict {node} {int(named)} {text}"


def parse_verdict(message: str, nnodes: int) -> tuple[int, bool, str] | str:
    """A ``verdict <node> <0|1> <headline>`` message as (node, named, headline), or why it is refused."""
    words = message.split(" ", 3)
    if len(words) != 4 or words[2] not in ("0", "1"):
        return "a verdict needs a node, 0 or 1, and a headline"
    _, node_text, named, headline = words
    if not (node_text.isascii() and node_text.isdigit()) or int(node_text) >= nnodes:
        return f"node {node_text[:20]!r} is not one of this run's {nnodes} nodes"
    if not (headline.isascii() and headline.isprintable()) or len(headline) > MAX_VERDICT:
        return "its headline is not printable text"
    return int(node_text), named == "1", headline
