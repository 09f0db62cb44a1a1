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


USER_ERROR_EXIT_CODE = 2


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
