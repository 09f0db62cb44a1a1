"""Multi-node: a failure on any node stops the ranks of every node within moments, not after an NCCL timeout.

Node 0's supervisor runs a small TCP server on ``master-addr:master-port + 1`` (`CONTROL_PORT_OFFSET`); every other
node's supervisor connects to it and proves it holds the run's key (supervisor/control/wire.py: a
challenge-response, then an HMAC on every line): ``SUPERVISOR_CONTROL_SECRET`` (or the file
``SUPERVISOR_CONTROL_SECRET_FILE`` names), or without one a key derived from the run id and the port, which trusts
what torchrun's rendezvous trusts (every node says so on its console). The hello carries the node's --nnodes: nodes
that disagree stop at once, each saying both values (exit 2). Nodes started without --node-rank (torchrun's c10d way)
are numbered here: node 0 is the one that opens that port at master-addr, the others get 1, 2, ... from node 0's
welcome, in the order they join. Once authenticated, the messages are:

    abort <node> <label> <code>    anyone → everyone: <label> on <node> ended the run with exit code <code> (0-255)
    lost <node> <why>              server → clients: <node> was lost (stopped answering, died, never joined), and why
    beat                           both ways, every `Timing.beat` seconds (at most 2 s): this node is alive
    verdict <node> <0|1> <text>    anyone → everyone (relayed by node 0): <node>'s stall verdict, 1 when its evidence
                                   names a rank of its own (supervisor/diagnosis/verdicts.py gathers them)
    progress <node> <age>          anyone → everyone (relayed): <node>'s ranks of a program that reports nothing last
                                   made progress <age> s ago, every sample of the hang watchdog
    finding <node> <kind> <text>   anyone → everyone (relayed): <node>'s ranks once no rank of any node made progress
                                   for the hang timeout: quiet, waits or busy (supervisor/diagnosis/quiet.py)
    done                           client → server: this node's ranks all finished
    bye                            server → clients: the run is over; a closed connection now means nothing

Node 0 relays every client's ``abort`` to the other clients, and hands it to a node that connects only later; an
aborting supervisor lingers (up to the grace period) until its abort is delivered: to every node (but one named as
never joined), for node 0, or to node 0, for the others. An authenticated connection that closes without ``done``
(seen by the server) or without ``bye`` (seen by a client), while nobody has aborted, means that supervisor died; one
that stays open but says nothing for `Timing.node_timeout` seconds (``--node-timeout``: its supervisor frozen, its host
gone without a reset) means it stopped answering. Either way the node is lost: node 0 names it to everyone
(``lost``), a client that loses node 0 names it itself, and every node stops its ranks with `LOST_CODE` (125), a node
still building its dataset too (`supervisor.launch.agent`). A node that has not joined within
`Timing.join_timeout` seconds of node 0 opening the channel (``--join-timeout``) is lost the same way ("node 2 never
joined"), with any hello refused in its name (another key, another run) said at once and again in that headline.
A node that node 0 refuses says so at once and tries again until its join timeout: a refusal proves nothing.
Otherwise every node exits with the code of the rank that failed first, wherever it ran, and its report says where
that was.

The port is open to the whole network, so the server assumes nothing of a connection until its hello proves the
key. A connection that has not done so within `HELLO_TIMEOUT` seconds is closed, as is one that sends a line over
`MAX_LINE` bytes or a hello that is wrong; at most `MAX_PENDING` connections may be waiting to authenticate (the
oldest is closed when another arrives), so a flood of connections holds a bounded number of file descriptors while a
real node, which answers the challenge at once, still gets in (and retries if it was pushed out). Out of file
descriptors, the server closes its oldest waiting connection, or stops accepting for a moment; it never stops
listening. A line without a valid MAC, an unknown message or an exit code outside 0-255 is dropped; nothing dropped
is acted on. A connection that closes before authenticating (``nc -z``, a port scanner) means nothing. The console
hears of every kind of drop, at most once per `NOTE_INTERVAL` with the count of the ones in between.

A background thread does the networking; the watcher's loop learns of aborts through `fd`, a pipe that becomes
readable whenever `read_events` has something.

* `wire` — what crosses the channel: bounded lines, the channel's key (``SUPERVISOR_CONTROL_SECRET``, or one derived
  from the run id), the challenge-response over it, the per-line HMAC with sequence numbers, the validation of aborts,
  losses and verdicts, the node and join timeouts (a leaf: the plan names its timings and secret);
* `channel` — what both ends share: the connection's reader and writer threads, the events and verdicts handed to the
  watcher, the heartbeat;
* `server` — node 0's end: the listening port, what it does with strangers (timeouts, caps, drops), the numbering of
  nodes started without ``--node-rank``, the relay;
* `client` — every other node's end: joining, the welcome that numbers it, losing node 0;
* `endpoint` — this node's end, opened: node 0's server or another node's client.

This file imports nothing, so that the plan below the group can import `wire` (Python runs a package's
``__init__`` before any module of it).
"""
