"""What crosses the control channel's wire: bounded text lines, the handshake that proves a shared key, and the
per-message HMAC that keeps strangers and replays out.

The control port is reachable by anyone on the cluster's network, so nothing a connection says is acted on until it
has proven it holds the run's key (`ControlKey`; it never crosses the wire): the secret in `SUPERVISOR_CONTROL_SECRET`
(or in the file `SUPERVISOR_CONTROL_SECRET_FILE` names), the same on every node; without one, a key derived from the
run id and the port, which trusts what torchrun's rendezvous trusts. The handshake is a challenge-response with a
fresh nonce from each side:

    challenge <server-nonce>                      server → client, as soon as the connection is accepted
    hello <node> <nnodes> <ranks> <client-nonce> <proof>
                                                  client → server; proof = HMAC(key, "hello <node> <nnodes> <ranks>
                                                  <both nonces>"); <node> is `?` from a node started without
                                                  --node-rank, <nnodes> its --nnodes, <ranks> its rank count
    welcome <node> <proof>                        server → client; proof = HMAC(key, "welcome <node> <both nonces>");
                                                  <node> is the one asked for, or the one node 0 gives a `?`
    nnodes <n> <proof>                            server → client: the hello proved the key but node 0 was started
                                                  with --nnodes <n>; proof = HMAC(key, "nnodes <n> <both nonces>")
    full <proof>                                  server → client: a `?` hello, but every node of the run has joined;
                                                  proof = HMAC(key, "full <both nonces>")
    taken <node> <proof>                          server → client: node <node> has joined already (two nodes were
                                                  given one --node-rank); proof = HMAC(key, "taken <node> <both
                                                  nonces>")
    refused                                       server → client: the hello's proof is wrong (another key)

Once every node has joined, node 0 tells each ``assembled <ranks of node 0>,<ranks of node 1>,...`` (authenticated,
below): no node starts a rank before that, as torchrun's rendezvous holds its workers until the nodes are there, and
the global ranks follow from each node's count (nodes may differ in --nproc-per-node, as under torchrun).

Every answer but ``refused`` proves the key in turn, so a node acts on it at once. ``refused`` cannot: the server that
sends it does not hold the client's key, and nor would a stranger that answers in its place (a process of an earlier
run still on the port, or one that took it first). A refused node says so at once and tries again until the join
timeout, so no unauthenticated line can end a genuine node.

A node that authenticated is then heard from at least every few seconds (``beat``, `Timing`), so a node that
stops answering (frozen, cut off) is told apart from one that is merely quiet; see supervisor/control/__init__.py.

Both sides then derive a session key from the key and both nonces, and every later line is ``<message> <mac>``:
HMAC-SHA256 under that session key over the direction, the line's sequence number in that direction, and the message.
A line recorded on one connection is worthless on another (other nonces, other session key), and on its own
connection it is out of sequence. Lines are at most `MAX_LINE` bytes; a longer one ends the connection, so a peer
that never sends a newline costs a bounded buffer, read once.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from trainer.errors import UserError

SECRET_ENV = "SUPERVISOR_CONTROL_SECRET"
SECRET_FILE_ENV = "SUPERVISOR_CONTROL_SECRET_FILE"  # a file that holds it: a Kubernetes Secret mounted in the pod
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
MAX_RANKS = 1 << 16  # ranks on one node, at most: a hello's count is a number a node could have
SECRET_HINT = (f"set {SECRET_ENV} to the same random value on every node before starting them, e.g. export "
               f"{SECRET_ENV}=$(python3 -c 'import secrets; print(secrets.token_hex(32))'), or name a file that "
               f"holds it in {SECRET_FILE_ENV}; train_slurm.sbatch sets one for its job")

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


def read_secret(env: Mapping[str, str]) -> bytes | None:
    """The run's control secret, from `SECRET_ENV` or the file `SECRET_FILE_ENV` names (surrounding whitespace, such as
    a file's last newline, left out); None when neither is set: the nodes then trust what torchrun trusts
    (`ControlKey.of`). A secret that is set but weak, or a file that cannot be read, is refused before anything
    starts."""
    value, path = env.get(SECRET_ENV, ""), env.get(SECRET_FILE_ENV, "")
    if value and path:
        raise UserError(f"both {SECRET_ENV} and {SECRET_FILE_ENV} are set; keep one of them (the same secret on every "
                        f"node)")
    if not path:
        if not value:
            return None
        check_secret(value, SECRET_ENV)
        return value.encode()
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as e:
        raise UserError(f"{SECRET_FILE_ENV}={path}: cannot read it ({e.strerror or e}); name a readable file that "
                        f"holds the control secret, the same on every node") from None
    check_secret(secret, f"the secret in {path} ({SECRET_FILE_ENV})")
    return secret


def check_secret(secret: str | bytes, where: str) -> None:
    """Refuses a secret that is short or has few distinct characters: one that can be guessed proves nothing."""
    unit = "characters" if isinstance(secret, str) else "bytes"
    if len(secret) < MIN_SECRET_LENGTH:
        raise UserError(f"{where} has {len(secret)} {unit}; use at least {MIN_SECRET_LENGTH} random ones: "
                        f"{SECRET_HINT}")
    if len(set(secret)) < MIN_SECRET_DISTINCT:
        raise UserError(f"{where} has only {len(set(secret))} distinct {unit}; use at least "
                        f"{MIN_SECRET_DISTINCT} (a random value): {SECRET_HINT}")


@dataclass(frozen=True)
class ControlKey:
    """What the nodes prove to each other: HMACs under `key`.

    With a secret (`secret`), only its holders join the run. Without one, the key is derived from what every node of
    the run is given anyway, the run id (--rdzv-id, torchrun's ``none`` by default) and the port: the nodes then trust
    what torchrun's rendezvous trusts (whoever reaches its endpoint with the run's id joins), two runs on one endpoint
    still do not mix, and a connection that does not know them proves nothing. The host is left out of it: nodes may
    name node 0 differently (its address, one of its names), as torchrun lets them."""

    key: bytes
    secret: bool

    @classmethod
    def of(cls, secret: bytes | None, run_id: str, port: int) -> ControlKey:
        if secret is not None:
            return cls(secret, True)
        derived = hashlib.sha256(f"supervisor control channel: run {run_id}, port {port}".encode()).digest()
        return cls(derived, False)

    @property
    def differs(self) -> str:
        """What a hello refused under this key means, as either end says it."""
        if self.secret:
            return f"{SECRET_ENV} differs between the nodes, or the other end is another run's"
        return f"the nodes differ in --rdzv-id, or only some have {SECRET_ENV}, or the other end is another run's"


def unauthenticated_note(run_id: str, control_port: int) -> str:
    """The console line of a node whose control channel runs without a secret."""
    return (f"control channel: unauthenticated ({SECRET_ENV} is not set): as with torchrun's rendezvous, any host "
            f"that reaches port {control_port} and knows the run id (--rdzv-id: {run_id}) can join this run or stop "
            f"it; to authenticate the nodes, give every node the same random {SECRET_ENV}, or {SECRET_FILE_ENV} "
            f"naming a file that holds it")


def new_nonce() -> str:
    return secrets.token_hex(NONCE_HEX // 2)


def is_nonce(word: str) -> bool:
    return len(word) == NONCE_HEX and all(c in "0123456789abcdef" for c in word)


def proof(key: bytes, text: str) -> str:
    return hmac.new(key, text.encode(), hashlib.sha256).hexdigest()


def node_word(node: int | None) -> str:
    """A node's rank in a hello: `ASSIGNED` for a node whose rank node 0 gives."""
    return ASSIGNED if node is None else str(node)


def hello_proof(key: bytes, node: int | None, nnodes: int, ranks: int, server_nonce: str, client_nonce: str) -> str:
    return proof(key, f"hello {node_word(node)} {nnodes} {ranks} {server_nonce} {client_nonce}")


def hello_line(key: bytes, node: int | None, nnodes: int, ranks: int, server_nonce: str, client_nonce: str) -> str:
    """A node's hello: who it is (`node`, None: node 0 gives it one), the run's --nnodes, its `ranks`, and the proof."""
    return (f"hello {node_word(node)} {nnodes} {ranks} {client_nonce} "
            f"{hello_proof(key, node, nnodes, ranks, server_nonce, client_nonce)}")


def assembled_message(sizes: tuple[int, ...]) -> str:
    """Every node has joined: the ranks on each, in node order, a run of equal counts as `<ranks>*<nodes>` (a line
    stays short on a thousand nodes)."""
    runs: list[list[int]] = []
    for n in sizes:
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
        else:
            runs.append([n, 1])
    return "assembled " + ",".join(f"{n}*{k}" if k > 1 else str(n) for n, k in runs)


def parse_assembled(message: str, nnodes: int, node: int, ranks: int) -> tuple[int, ...] | str:
    """The rank counts of an ``assembled`` message, or why it is not one for this run's `node` with `ranks`."""
    words = message.split()
    sizes: list[int] = []
    for run in words[1].split(",") if len(words) == 2 else []:
        n, _, k = run.partition("*")
        if not (n.isdecimal() and 0 < int(n) <= MAX_RANKS and (k == "" or k.isdecimal() and 0 < int(k) <= nnodes)):
            return f"not a rank count: {run[:20]!r}"
        sizes += [int(n)] * int(k or 1)
        if len(sizes) > nnodes:
            break
    if len(sizes) != nnodes:
        return f"not {nnodes} rank counts: {message[:80]!r}"
    if sizes[node] != ranks:
        return f"node {node} has {ranks} ranks, not {sizes[node]}"
    return tuple(sizes)


def answer_proof(key: bytes, answer: str, server_nonce: str, client_nonce: str) -> str:
    """Node 0's proof of its answer to a hello that proved the key (``welcome <node>``, ``nnodes <n>``, ``full``)."""
    return proof(key, f"{answer} {server_nonce} {client_nonce}")


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
    def derive(cls, key: bytes, server_nonce: str, client_nonce: str, server: bool) -> "Session":
        key = hmac.new(key, f"session {server_nonce} {client_nonce}".encode(), hashlib.sha256).digest()
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


# What a node's ranks showed when the whole group was silent for the hang timeout (supervisor/diagnosis/quiet.py); a
# node whose ranks show a stall says so with its abort instead
QUIET, WAITS, BUSY = "quiet", "waits", "busy"
FINDINGS = (QUIET, WAITS, BUSY)
MAX_AGE = 1e8  # seconds: a `progress` message's age, at most


def node_of(text: str, nnodes: int) -> int | str:
    """A message's node rank, or why it is refused."""
    if not (text.isascii() and text.isdigit()) or int(text) >= nnodes:
        return f"node {text[:20]!r} is not one of this run's {nnodes} nodes"
    return int(text)


def progress_message(node: int, age: float) -> str:
    """A node's ranks last made progress (output, CPU time) `age` seconds ago: an age, not a time, since the nodes'
    clocks differ."""
    return f"progress {node} {min(max(age, 0.0), MAX_AGE):.1f}"


def parse_progress(message: str, nnodes: int) -> tuple[int, float] | str:
    """A ``progress <node> <age>`` message as (node, age), or why it is refused."""
    words = message.split(" ")
    if len(words) != 3:
        return "a progress message needs a node and an age"
    node = node_of(words[1], nnodes)
    if isinstance(node, str):
        return node
    try:
        age = float(words[2])
    except ValueError:
        return f"age {words[2][:20]!r} is not a number"
    if not 0.0 <= age <= MAX_AGE:  # NaN fails both
        return f"age {words[2][:20]!r} is not within 0-{MAX_AGE:g} s"
    return node, age


def finding_message(node: int, kind: str, text: str) -> str:
    """A node's finding on its own ranks after the group was silent for the hang timeout, and its lines (ASCII)."""
    return f"finding {node} {kind} {text.encode('ascii', 'replace').decode()[:MAX_VERDICT]}"


def parse_finding(message: str, nnodes: int) -> tuple[int, str, str] | str:
    """A ``finding <node> <kind> <text>`` message as (node, kind, text), or why it is refused."""
    words = message.split(" ", 3)
    if len(words) != 4 or words[2] not in FINDINGS:
        return f"a finding needs a node, one of {', '.join(FINDINGS)}, and its text"
    node = node_of(words[1], nnodes)
    if isinstance(node, str):
        return node
    if not (words[3].isascii() and words[3].isprintable()) or len(words[3]) > MAX_VERDICT:
        return "its text is not printable text"
    return node, words[2], words[3]
