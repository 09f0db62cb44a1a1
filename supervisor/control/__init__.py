"""Multi-node: a failure on any node stops the ranks of every node within moments, not after an NCCL timeout.

Node 0's supervisor runs a small TCP server on ``master-addr:master-port + 1`` (`CONTROL_PORT_OFFSET`); every other
node's supervisor connects to it and proves it holds the run's secret (supervisor/control/wire.py: a
challenge-response, then an HMAC on every line). Nodes started without --node-rank (torchrun's c10d way) are
numbered here: node 0 is the one that opens that port at master-addr, the others get 1, 2, ... from node 0's welcome,
in the order they join. Once authenticated, the messages are:

    abort <node> <label> <code>    anyone → everyone: <label> on <node> ended the run with exit code <code> (0-255)
    lost <node> <why>              server → clients: <node> was lost (stopped answering, died, never joined), and why
    beat                           both ways, every `Timing.beat` seconds (at most 2 s): this node is alive
    verdict <node> <0|1> <text>    anyone → everyone (relayed by node 0): <node>'s stall verdict, 1 when its evidence
                                   names a rank of its own (supervisor/verdicts.py gathers them)
    done                           client → server: this node's ranks all finished
    bye                            server → clients: the run is over; a closed connection now means nothing

Node 0 relays every client's ``abort`` to the other clients, and hands it to a node that connects only later; an
aborting supervisor lingers (up to the grace period) until its abort is delivered: to every node (but one named as
never joined), for node 0, or to node 0, for the others. An authenticated connection that closes without ``done``
(seen by the server) or without ``bye`` (seen by a client), while nobody has aborted, means that supervisor died; one
that stays open but says nothing for `Timing.node_timeout` seconds (``--node-timeout``: its supervisor frozen, its host
gone without a reset) means it stopped answering. Either way the node is lost: node 0 names it to everyone
(``lost``), a client that loses node 0 names it itself, and every node stops its ranks with `LOST_CODE` (125), a node
still building its dataset too (`supervisor.launcher`). A node that has not joined within
`Timing.join_timeout` seconds of node 0 opening the channel (``--join-timeout``) is lost the same way ("node 2 never
joined"), with any hello refused in its name (another secret, another run) said at once and again in that headline.
Otherwise every node exits with the code of the rank that failed first, wherever it ran, and its report says where
that was.

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

from collections.abc import Callable

from supervisor.control.channel import CONTROL_PORT_OFFSET, ControlChannel
from supervisor.control.client import ControlClient
from supervisor.control.server import ControlServer, claim, listen, port_refused
from supervisor.plan import Plan


def open_channel(plan: Plan, secret: bytes, say: Callable[[str], None]) -> ControlChannel:
    """Node 0's server or another node's client. A node started without --node-rank is node 0 when it opens the
    control port at --master-addr (`claim`), else a client whose node rank node 0's welcome gives."""
    assert plan.master_port is not None
    port = plan.master_port + CONTROL_PORT_OFFSET
    if plan.node_rank == 0 and not plan.node_rank_assigned:
        try:
            listener = listen(port)
        except OSError as e:
            raise port_refused(port, e) from None
        return ControlServer(plan.nnodes, listener, secret, plan.node_timing, say)
    if plan.node_rank_assigned and (listener := claim(plan.master_addr, port)) is not None:
        return ControlServer(plan.nnodes, listener, secret, plan.node_timing, say)
    return ControlClient(None if plan.node_rank_assigned else plan.node_rank, plan.nnodes, (plan.master_addr, port),
                         plan.local_addr, secret, plan.node_timing, say)
