"""Where the ranks meet: node 0's address and port checked before anything starts, a free port that nobody else can
take, and the loopback interface.

Checked first: node 0's address must resolve (a wrong one would have the ranks retry it until the store's 30-minute
timeout), looked up in a thread of its own so that a resolver that never answers costs seconds, not the run; and on
node 0 a port given by hand must be free, bound as rank 0's store binds it, on every address with ``SO_REUSEADDR``
(so a port left in TIME_WAIT by an earlier run counts as free), and let go at once.

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

import errno
import socket
import threading
import time
from dataclasses import dataclass, field

from trainer.errors import UserError

LOOPBACK = "127.0.0.1"
RESOLVE_WAIT = 5.0  # seconds one look-up of a host name may take
RESOLVE_RETRY = 1.0  # seconds between two look-ups of a name that does not resolve yet


def look_up(host: str, wait: float = RESOLVE_WAIT) -> str | None:
    """Why `host` does not resolve (None: it does), the resolver given `wait` seconds."""
    failure: list[str] = []
    done = threading.Event()

    def ask() -> None:
        try:
            socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError, ValueError) as e:  # UnicodeError: a label too long; ValueError: a NUL byte
            failure.append(getattr(e, "strerror", None) or str(e))
        done.set()

    threading.Thread(target=ask, name="supervisor-resolve", daemon=True).start()
    if not done.wait(wait):
        return f"no answer from the resolver within {wait:g} s"
    return failure[0] if failure else None


def check_host(host: str, patience: float = 0.0) -> None:
    """Node 0's address resolves, or the run is refused naming it. `patience`: how long a node that only joins may
    wait for the name to appear (on Kubernetes a worker pod can start before the master's service name is published;
    torchrun's agent retries too); node 0 itself, and a number or a name that will never resolve, is refused once
    the look-up has failed and the patience is spent."""
    deadline = time.monotonic() + patience
    while (why := look_up(host)) is not None and time.monotonic() + RESOLVE_RETRY < deadline:
        time.sleep(RESOLVE_RETRY)
    if why is not None:
        waited = f" for {patience:g} s (--join-timeout)" if patience else ""
        raise UserError(f"node 0's address {host} (--master-addr, or the host of --rdzv-endpoint) does not resolve "
                        f"({why}){waited}; give a host name or an address that every node can reach")


def check_port_free(port: int) -> None:
    """On node 0: `port`, where rank 0 will host the store, is not taken by another program."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError as e:
            why = "another program listens on it" if e.errno == errno.EADDRINUSE else e.strerror or str(e)
            raise UserError(f"port {port}, where node 0's rank 0 would host the rendezvous, cannot be taken on this "
                            f"machine ({why}); choose a free one with --master-port PORT (or --rdzv-endpoint "
                            f"HOST:PORT), or on a single node leave the port out and a free one is taken") from None


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
