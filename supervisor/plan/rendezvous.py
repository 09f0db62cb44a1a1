"""Where the ranks of one node meet: a free port that nobody else can take, and the loopback interface.

Why holding the port is safe: the supervisor binds ``127.0.0.1:0`` with ``SO_REUSEADDR`` and never listens on it.
While that socket stays bound, the kernel hands the port to no one else: neither ``bind(0)`` nor the automatic
port choice of an outgoing ``connect`` picks a port that has a bound socket. Rank 0's TCPStore also sets
``SO_REUSEADDR``, and Linux lets a second such socket bind and listen beside one that is bound but not listening, so
rank 0 takes the port while we still hold it. We keep holding it until the group is gone, so there is no window
between "found free" and "taken by rank 0" in which another program could grab it, and no fixed default that two
runs on one machine would share.

Single-node traffic stays on the machine: ranks connect to ``MASTER_ADDR=127.0.0.1`` and gloo's own sockets are
pinned to the loopback interface (``GLOO_SOCKET_IFNAME``). torch's TCPStore server itself binds the wildcard
address; torch offers no bind address to change that short of hosting the store, which would mean importing torch
here.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

LOOPBACK = "127.0.0.1"


@dataclass
class PortReservation:
    """A TCP port held for the rendezvous until `release`."""

    host: str = LOOPBACK
    port: int = 0
    sock: socket.socket | None = field(default=None, repr=False)

    @classmethod
    def take(cls, host: str = LOOPBACK) -> "PortReservation":
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        return cls(host, sock.getsockname()[1], sock)

    def release(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def loopback_interface() -> str:
    """The name of the loopback interface (``lo`` on Linux), for GLOO_SOCKET_IFNAME."""
    names = [name for _, name in socket.if_nameindex()]
    return "lo" if "lo" in names else next((n for n in names if n.startswith("lo")), "lo")
