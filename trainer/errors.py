"""The one exception type for bad user input.

Entry points catch it, print ``error: <message>`` on one line and exit 2, so a typo in a config never
ends in a traceback.
"""


class UserError(Exception):
    """Bad input from the user: a config, a flag, a path. The message says what is wrong and how to fix it.

    It is one line whatever it quotes: a newline, a carriage return or a terminal escape the user typed into a value
    is shown escaped (``\\n``, ``\\x1b``), so the error line is never split or rewritten on the screen."""

    def __init__(self, message: str) -> None:
        super().__init__("".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in message))


class CollectiveUserError(UserError):
    """A refusal every rank reaches together, rank 0 having decided it for all (a broadcast): rank 0 says it, the
    others only exit with its code, so the console shows the line once rather than once per rank."""


USER_ERROR_EXIT_CODE = 2

# What an error says when a peer went away under a collective: gloo's pair, NCCL's remote error, the c10d store. The
# supervisor reads it in a rank's last lines; a rank, in the exception it fails with (`lost_a_peer`).
PEER_LOSS = ("Connection closed by peer", "Connection reset by peer", "ncclRemoteError",
             "remote process exited or there was a network error", "failed to recv, got 0 bytes")


def lost_a_peer(error: BaseException) -> bool:
    """Whether `error`, or an error it was raised from, says a peer went away under a collective."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if any(marker in str(e) for marker in PEER_LOSS):
            return True
        e = e.__cause__ or e.__context__
    return False


def exit_without_teardown(code: int) -> None:
    """Flush and exit now, skipping the interpreter's finalisation.

    Used by entry points once everything they own is closed: it hands the exit code back sooner, and keeps C++
    destructors (torch.distributed's among them) from running during finalisation, where they can abort a run that
    already finished (std::terminate, exit 134).
    """
    import os
    import sys

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, OSError):
            pass
    os._exit(code)
