"""This node's end of the control channel, opened: node 0's server, or another node's client."""

from __future__ import annotations

from collections.abc import Callable

from supervisor.control.channel import CONTROL_PORT_OFFSET, ControlChannel
from supervisor.control.client import ControlClient
from supervisor.control.server import ControlServer, claim, listen, port_refused
from supervisor.control.wire import ControlKey, unauthenticated_note
from supervisor.plan.spec import Plan


def open_channel(plan: Plan, secret: bytes | None, say: Callable[[str], None]) -> ControlChannel:
    """Node 0's server or another node's client. A node started without --node-rank is node 0 when it opens the
    control port at --master-addr (`claim`), else a client whose node rank node 0's welcome gives. Without a `secret`
    the channel's key comes from the run id and the port, and the console says that the channel is unauthenticated."""
    assert plan.master_port is not None
    port = plan.master_port + CONTROL_PORT_OFFSET
    key = ControlKey.of(secret, plan.run_id, plan.master_port)
    if not key.secret:
        say(unauthenticated_note(plan.run_id, port))
    if plan.node_rank == 0 and not plan.node_rank_assigned:
        try:
            listener = listen(port)
        except OSError as e:
            raise port_refused(port, e) from None
        return ControlServer(plan.nnodes, plan.local_world_size, listener, key, plan.node_timing, say)
    if plan.node_rank_assigned and (listener := claim(plan.master_addr, port)) is not None:
        return ControlServer(plan.nnodes, plan.local_world_size, listener, key, plan.node_timing, say)
    return ControlClient(None if plan.node_rank_assigned else plan.node_rank, plan.nnodes, plan.local_world_size,
                         (plan.master_addr, port), plan.local_addr, key, plan.node_timing, say)
