"""Rank output → ``GPU<id>:`` lines on the console and plain lines in the rank's log file.

Speed comes from never touching a line on its own. One thread serves every rank's stdout and stderr through one
selector: it reads up to 1 MiB, cuts at the last newline (the rest waits for the next read), prefixes every line
with a single ``bytes.replace(b"\\n", b"\\n" + prefix)`` and sends the whole block with one ``writev`` to the console
and one to ``gpu<id>.log``. When the writers trickle (a read came back small), the thread waits a millisecond before
the next read so the following one is big, instead of waking up for every line a rank prints. (Without that
pause the pump spent twice the CPU on 2 ranks × 3 M lines; a thread per stream instead of the selector measured
the same or a little more, with GIL hand-offs, so one thread it is.)

Lines stay whole: a block holds only complete lines of one stream of one rank and is written in one call under the
console lock, so lines of different ranks never split or merge. A partial line waits in its stream's carry until
its newline arrives, and is flushed as a line of its own (prefix and newline added) when the rank closes the stream.
A single line longer than 8 MiB is emitted in 8 MiB pieces rather than held forever.

Carriage returns (progress bars, tqdm's among them): a line keeps only its last ``\\r`` segment, as a terminal would
finally show it (``10%\\r20%\\r30%\\n`` → ``30%``), and ``\\r\\n`` counts as a newline. While such a line is still
being redrawn, what a terminal would show of it now is shown as a prefixed line of its own, at most once per
``BAR_INTERVAL`` (a second) per stream: the first state once the bar has run that long (a bar finished sooner shows
only its end), then the latest state whenever it changed, within a second of the change (the selector's timeout
wakes the thread for it; a bar that stopped changing costs no wake-up). The log file gets the same lines: a bar of
thousands of updates leaves one line a second and its final state, readable, not thousands of partial updates. The
final state is not repeated when the last state shown was already it. Prefixes stay intact because every line shown
is a whole line.

Prompts: the rank that reads the supervisor's terminal (rank 0: pdb at a ``breakpoint()``, ``input()``) writes a
prompt and waits for a line typed, without ending its own line. Its stdout's unfinished line, once it has stayed
unchanged for ``PROMPT_WAIT``, is shown on the console as it is, the line left open, so what is typed follows it;
the rest of that line, when it comes, continues it without a prefix (where the user pressed Enter, the terminal has
already moved to a new line), unless something else reached the console in between, which ends the open line first.
The log file gets the line once, whole, when it ends. Only with a terminal on stdin: nobody types into a pipe.

torchrun's ``--local-ranks-filter``: a stream without a console (``Stream.console_fd`` None) goes to its log file
only.

The log file gets the lines without the prefix (it belongs to one rank already). For each stderr stream the pump
keeps the last 64 KiB, from which the failure report takes the failing rank's last lines, and the failure rule the
error a rank ended with (`Stream.caught_up` tells the watcher when the pump has taken all an exited rank wrote).

Fallout stays off the console: once one rank has failed, the others' collectives are cut short and each of them
prints a traceback of its own (gloo's "Connection closed by peer", NCCL's abort) that says nothing about the cause
and buries the failing rank's lines. `Stream.mute` sends such a stream's further lines to its log file only and
counts them, so the report can say where they are.
"""

from __future__ import annotations

import fcntl
import os
import selectors
import struct
import termios
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from supervisor.console import Console, write_all

CHUNK = 1 << 20
TRICKLE = 64 << 10  # a read smaller than this: the writers are slower than we are, let data pile up a little
TRICKLE_WAIT = 0.001
MAX_LINE = 8 << 20
TAIL_BYTES = 64 << 10
BAR_INTERVAL = 1.0  # seconds between two states of one progress bar on the console
PROMPT_WAIT = 0.2  # seconds an unfinished line of the rank reading the terminal stays unchanged before it is shown


def clean_cr(lines: bytes) -> bytes:
    """Complete lines → each keeps only its last carriage-return segment; ``\r\n`` is a newline.

    Linear in the input: one ``rfind`` per line (a regular expression here would rescan long lines quadratically).
    """
    lines = lines.replace(b"\r\n", b"\n")
    if b"\r" not in lines:
        return lines
    return b"\n".join(line[line.rfind(b"\r") + 1:] for line in lines.split(b"\n"))


def screen(carry: bytes | bytearray) -> bytes:
    """What a terminal shows of an unfinished line now: its last carriage-return segment (a final ``\r`` moves the
    cursor back without erasing anything)."""
    text = bytes(carry[:-1] if carry.endswith(b"\r") else carry)
    return text[text.rfind(b"\r") + 1:]


@dataclass(eq=False)  # one stream is one pipe: identity is equality (and the hash, for `Pump.bars`)
class Stream:
    fd: int  # read end of the rank's stdout or stderr pipe
    prefix: bytes  # b"GPU3:"
    console_fd: int | None  # 1 or 2; None: the log file only (a rank torchrun's --local-ranks-filter leaves out)
    log_fd: int | None
    keep_tail: bool  # stderr: remember the last lines for the report
    prompts: bool = False  # the stdout of the rank reading the terminal: its unfinished line may be a prompt
    carry: bytearray = field(default_factory=bytearray)  # the unfinished last line
    carry_cr: bool = False  # the carry holds a carriage return
    bar_due: float | None = None  # the carry is a progress bar being redrawn: when its next state may be shown
    bar_shown: bytes | None = None  # the state of that bar shown last
    prompt_due: float | None = None  # when the unfinished line, unchanged until then, is shown as a prompt
    shown: int = 0  # bytes of the unfinished line already on the console, as a prompt
    tail: bytes = b""
    muted: bool = False  # set from the watcher's thread; a plain bool is read whole under the GIL
    muted_lines: int = 0  # lines kept from the console since `mute`
    received: int = 0  # bytes read from the pipe
    taken: int = 0  # of those, the bytes the tail (or the carry) reflects
    nl_prefix: bytes = field(init=False)

    def __post_init__(self) -> None:
        self.nl_prefix = b"\n" + self.prefix

    @property
    def label(self) -> str:
        return self.prefix.decode()[:-1]

    def mute(self, muted: bool = True) -> None:
        """From now on, lines go to the log file only (fallout of another rank's failure); `False` undoes it."""
        self.muted = muted

    def tail_lines(self, count: int) -> list[str]:
        lines = self.tail.decode(errors="replace").splitlines()
        return lines[-count:]

    def caught_up(self) -> bool:
        """Whether the pump has taken every byte in the pipe into the tail: for a rank that has exited, all it wrote.
        Read from the watcher's thread; a descriptor the pump closes meanwhile counts as caught up."""
        fd = self.fd
        if fd < 0:
            return True
        try:
            unread = struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
        except OSError:
            return True
        return unread == 0 and self.taken == self.received


class Pump(threading.Thread):
    def __init__(self, console: Console, bar_interval: float = BAR_INTERVAL) -> None:
        super().__init__(name="supervisor-pump", daemon=True)
        self.console, self.bar_interval = console, bar_interval
        self.clock: Callable[[], float] = time.monotonic  # the bars' clock (a test may drive its own)
        self.bars: set[Stream] = set()  # streams whose bar changed since it was last shown
        self.prompts: set[Stream] = set()  # streams whose unfinished line waits for its `prompt_due`
        self.selector = selectors.DefaultSelector()
        self.streams: list[Stream] = []
        self.open = 0
        self.stop_requested = False
        self.wake_r, self.wake_w = os.pipe()
        self.selector.register(self.wake_r, selectors.EVENT_READ, None)
        self.gate: Callable[[], None] | None = None  # set by the watcher while it runs

    def add(self, fd: int, prefix: bytes, console_fd: int | None, log_fd: int | None, keep_tail: bool,
            prompts: bool = False) -> Stream:
        stream = Stream(fd, prefix, console_fd, log_fd, keep_tail, prompts)
        self.streams.append(stream)
        self.selector.register(fd, selectors.EVENT_READ, stream)
        self.open += 1
        return stream

    # -- the thread ------------------------------------------------------------------------------------------------

    def run(self) -> None:
        while self.open and not self.stop_requested:
            biggest = 0
            for key, _ in self.selector.select(self.timeout()):
                stream: Stream | None = key.data
                if stream is None:
                    os.read(self.wake_r, 64)
                    continue
                try:
                    data = os.read(stream.fd, CHUNK)
                except (BlockingIOError, InterruptedError):
                    continue
                if data:
                    stream.received += len(data)
                    self.feed(stream, data)
                    biggest = max(biggest, len(data))
                else:
                    self.close_stream(stream)
            if self.bars:
                self.show_due_bars()
            if self.prompts:
                self.show_due_prompts()
            if 0 < biggest < TRICKLE:
                time.sleep(TRICKLE_WAIT)
        for stream in self.streams:  # stopped early: take what is already in the pipes, then close
            if stream.fd >= 0:
                self.drain(stream)
                self.close_stream(stream)
        self.selector.close()
        os.close(self.wake_r)

    def finish(self, timeout: float) -> None:
        """Wait until every stream reached end-of-file, or `timeout`; then take what is buffered and stop.

        End-of-file can be late only when some process outside the ranks' process groups still holds a pipe;
        the watcher's sweep kills those, and the timeout bounds the wait in any case.
        """
        if self.is_alive():
            self.join(timeout)
        if self.is_alive():
            self.stop_requested = True
            os.write(self.wake_w, b"x")
            self.join()
        os.close(self.wake_w)

    def drain(self, stream: Stream) -> None:
        os.set_blocking(stream.fd, False)
        while True:
            try:
                data = os.read(stream.fd, CHUNK)
            except (BlockingIOError, InterruptedError):
                return
            if not data:
                return
            self.feed(stream, data)

    def close_stream(self, stream: Stream) -> None:
        if stream.carry:  # the unfinished line ends here
            self.feed(stream, b"\n")
        self.selector.unregister(stream.fd)
        os.close(stream.fd)
        stream.fd = -1
        self.open -= 1

    # -- chunks → lines --------------------------------------------------------------------------------------------

    def feed(self, stream: Stream, data: bytes) -> None:
        end = data.rfind(b"\n")
        if end >= 0:
            if stream.carry_cr or b"\r" in data:
                self.emit_ended(stream, clean_cr(bytes(stream.carry) + data[: end + 1]))
            else:
                self.emit(stream, stream.carry, data, end + 1, stream.shown)
            stream.carry, stream.carry_cr, stream.shown = bytearray(), False, 0
        self.extend_carry(stream, data[end + 1:])
        stream.taken = stream.received
        if stream.prompts:
            self.await_prompt(stream)

    def extend_carry(self, stream: Stream, piece: bytes) -> None:
        """Append to the unfinished line, in amortised linear time whatever the line's length."""
        if not piece:
            return
        cut = piece.rfind(b"\r", 0, len(piece) - 1) if b"\r" in piece else -1
        if cut >= 0:  # a later \r overwrote everything before it (a final \r may yet be half of \r\n)
            stream.carry = bytearray(piece[cut + 1:])
        else:
            stream.carry += piece
        stream.carry_cr = stream.carry_cr or b"\r" in piece
        if len(stream.carry) > MAX_LINE:
            line = bytes(stream.carry) + b"\n"
            stream.carry, stream.carry_cr, stream.shown = bytearray(), False, 0
            self.emit_ended(stream, clean_cr(line) if b"\r" in line else line)
        elif b"\r" in piece:
            self.redrawn(stream)

    # -- progress bars ---------------------------------------------------------------------------------------------

    def redrawn(self, stream: Stream) -> None:
        """A carriage return arrived in the unfinished line: show its state now if the interval is over, else once
        it is (`show_due_bars`)."""
        now = self.clock()
        if stream.bar_due is None:  # a new bar: its first state waits an interval, so a quick one shows only its end
            stream.bar_due = now + self.bar_interval
        if now >= stream.bar_due:
            self.show_bar(stream, now)
        else:
            self.bars.add(stream)

    def show_bar(self, stream: Stream, now: float) -> None:
        self.bars.discard(stream)
        stream.bar_due = now + self.bar_interval
        state = screen(stream.carry)
        if state and state != stream.bar_shown:
            stream.bar_shown = state
            self.emit(stream, b"", state + b"\n")

    def timeout(self) -> float | None:
        """The selector's timeout: until the first changed bar or waiting prompt is due (None, no timeout, when
        there is neither)."""
        due = [s.bar_due for s in self.bars if s.bar_due is not None]
        due += [s.prompt_due for s in self.prompts if s.prompt_due is not None]
        return max(0.0, min(due) - self.clock()) if due else None

    def show_due_bars(self) -> None:
        now = self.clock()
        for stream in [s for s in self.bars if s.bar_due is not None and s.bar_due <= now]:
            self.show_bar(stream, now)

    # -- prompts ---------------------------------------------------------------------------------------------------

    def await_prompt(self, stream: Stream) -> None:
        """After a read: an unfinished line with something not shown yet (and no bar) is a prompt if it stays
        unchanged for PROMPT_WAIT (`show_due_prompts`)."""
        if len(stream.carry) > stream.shown and not stream.carry_cr:
            stream.prompt_due = self.clock() + PROMPT_WAIT
            self.prompts.add(stream)
        else:
            self.prompts.discard(stream)

    def show_due_prompts(self) -> None:
        """Each unfinished line due: what is not on the console yet, the line left open (the log file gets the whole
        line once it ends)."""
        now = self.clock()
        for stream in [s for s in self.prompts if s.prompt_due is not None and s.prompt_due <= now]:
            self.prompts.discard(stream)
            piece = bytes(stream.carry[stream.shown:])
            stream.shown = len(stream.carry)
            if stream.muted or stream.console_fd is None:
                continue
            if self.console.terminal:
                self.console.print_lines(stream.prefix, piece, owner=stream, unfinished=True)
            else:
                self.console.write_lines(stream.console_fd, stream.prefix, [piece], owner=stream, unfinished=True)

    def emit_ended(self, stream: Stream, lines: bytes) -> None:
        """Complete lines whose first one ends the carried line; a bar's final state is not shown twice. (A prompt
        shown of that line is ended on the console, and the line shown whole after it.)"""
        if stream.bar_shown is not None and lines.startswith(stream.bar_shown + b"\n"):
            lines = lines[len(stream.bar_shown) + 1:]
        stream.bar_due = stream.bar_shown = None
        self.bars.discard(stream)
        if lines:
            self.emit(stream, b"", lines)

    def emit(self, stream: Stream, head: bytes | bytearray, data: bytes, size: int | None = None,
             shown: int = 0) -> None:
        """Write `head` + `data[:size]` (complete lines; `head` is the carried start of the first one, whose first
        `shown` bytes are on the console already, as a prompt: the console gets the rest)."""
        size = len(data) if size is None else size
        lines = memoryview(data)[:size]
        if stream.log_fd is not None:
            try:
                write_all(stream.log_fd, [head, lines])
            except OSError as e:
                stream.log_fd = None
                self.console.say(f"cannot write the log of {stream.label} any more: {e}")
        if stream.keep_tail:  # before the gate: the watcher may be reading the tail while it holds the gate
            if size >= TAIL_BYTES:
                stream.tail = bytes(lines[size - TAIL_BYTES:])
            else:
                stream.tail = (stream.tail + head + bytes(lines))[-TAIL_BYTES:]
            stream.taken = stream.received
        if stream.keep_tail and not stream.muted and (gate := self.gate) is not None:
            gate()  # stderr: what came before these lines may make them fallout (`supervisor.group.failure.FalloutGate`)
        rest = memoryview(head)[shown:]  # what the console has not shown of the first line
        owner = stream if shown else None  # a prompt's line is continued; any other write starts a line
        if stream.muted:
            stream.muted_lines += data.count(b"\n", 0, size)  # `head` is the start of a line, never a whole one
        elif stream.console_fd is not None and self.console.terminal:
            self.console.print_lines(stream.prefix, bytes(rest) + bytes(lines), owner=owner)
        elif stream.console_fd is not None:
            replaced = data.replace(b"\n", stream.nl_prefix)  # the unfinished rest after `size` has no newline
            cut = len(replaced) - (len(data) - size) - len(stream.prefix)
            self.console.write_lines(stream.console_fd, stream.prefix, [rest, memoryview(replaced)[:cut]], owner=owner)
