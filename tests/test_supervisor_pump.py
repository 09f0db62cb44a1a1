"""Rank output through the real supervisor: every line whole, once, under the right prefix, in console and log."""

from __future__ import annotations

import os
import re
import subprocess
import time

import pytest

from rank_scripts.harness import SPAM, WORKER, alive, clean_env, run, start, survivors
from supervisor.console import Console
from supervisor.group.pump import MAX_LINE, Pump, clean_cr

GPUS = [1, 3, 5, 7]  # physical ids in rank order, through the fake-GPU seam
LINES = 20000
LONG = 3 << 20  # one line three times the pump's read size


def check_stream(text: str, stream: str, expect_every: int) -> None:
    """Every line of `text` is `GPU<id>:r<rank> <stream> <n> <pad>` (or a known extra) with the id matching the rank."""
    seen: dict[int, list[int]] = {r: [] for r in range(len(GPUS))}
    extras: dict[int, list[str]] = {r: [] for r in range(len(GPUS))}
    pattern = re.compile(rf"GPU(\d+):r(\d) {stream} (\d+) (x+)")
    for line in text.splitlines():
        if line.startswith("supervisor: "):
            continue
        m = pattern.fullmatch(line)
        if m:
            gpu, rank, n, pad = int(m[1]), int(m[2]), int(m[3]), m[4]
            assert GPUS[rank] == gpu, line[:80]
            assert len(pad) == rank * 7 + 20, line[:80]
            seen[rank].append(n)
            continue
        m = re.fullmatch(r"GPU(\d+):r(\d) (.*)", line, re.S)
        assert m, f"malformed line: {line[:120]!r}"
        assert GPUS[int(m[2])] == int(m[1]), line[:80]
        extras[int(m[2])].append(m[3])
    for rank in seen:
        assert seen[rank] == list(range(0, LINES, expect_every)), f"rank {rank} {stream}: lines lost or reordered"
        if stream == "out":
            assert extras[rank] == ["long " + "y" * LONG + " end", "progress 100%", "partial-out"]
        else:
            assert extras[rank] == ["partial-err"]


def test_four_ranks_flooding_both_streams(tmp_path):
    r = run(tmp_path, "--gpus", ",".join(map(str, GPUS)), entry=SPAM, entry_args=(str(LINES), str(LONG)),
            env=clean_env(SUPERVISOR_FAKE_GPUS="0,1,2,3,4,5,6,7"))
    assert r.returncode == 0, r.stderr[-2000:]
    check_stream(r.stdout, "out", 1)
    check_stream(r.stderr, "err", 3)
    for rank, gpu in enumerate(GPUS):
        log = (r.run_dir() / f"gpu{gpu}.log").read_text().splitlines()
        assert sum(1 for line in log if line.startswith(f"r{rank} out ")) == LINES
        assert sum(1 for line in log if line.startswith(f"r{rank} err ")) == len(range(0, LINES, 3))
        assert f"r{rank} progress 100%" in log and f"r{rank} partial-out" in log and f"r{rank} partial-err" in log
        assert not any(line.startswith("GPU") for line in log), "log files hold the rank's lines unprefixed"


def test_reader_leaving_does_not_stop_the_run(tmp_path):
    """`| head -1`: console output stops, the run and the log files go on."""
    r = start(tmp_path, "--nproc", "2", entry=SPAM, entry_args=("5000",), stdout=subprocess.PIPE)
    assert r.proc.stdout is not None
    first = r.proc.stdout.readline()
    r.proc.stdout.close()
    r.wait()
    assert first.startswith(b"CPU")
    assert r.returncode == 0, r.stderr
    for rank in (0, 1):
        log = (r.run_dir() / f"cpu{rank}.log").read_text()
        assert log.count(f"r{rank} out ") == 5000


def test_supervisor_messages_stay_off_the_rank_prefixes(tmp_path):
    """`2>&1 | grep GPU2:` keeps exactly the rank's lines."""
    r = run(tmp_path, "--gpus", "2", entry=WORKER, entry_args=("--steps", "2"),
            env=clean_env(SUPERVISOR_FAKE_GPUS="0,1,2"))
    assert r.returncode == 0, r.stderr
    assert [line for line in r.stdout.splitlines() if line.startswith("GPU2:")] == \
        ["GPU2:rank 0 started (pid %s, resumed=False)" % r.pids()[0], "GPU2:rank 0 finished 2 steps"]
    assert all(line.startswith("supervisor: ") for line in r.stderr.splitlines())


def test_carriage_returns_keep_the_last_segment():
    assert clean_cr(b"10%\r50%\r100%\nnext\n") == b"100%\nnext\n"
    assert clean_cr(b"windows\r\nline\r\n") == b"windows\nline\n"


def feed_pump(tmp_path, chunks: list[bytes], step: float = 0.0) -> tuple[bytes, bytes, int]:
    """Feed chunks to a pump's stream by hand (no thread), its clock advancing `step` seconds before each (a
    progress bar is shown at most once a second of that clock); what reached the console and the log file."""
    console_path, log_path = tmp_path / "console", tmp_path / "log"
    console_fd = os.open(console_path, os.O_WRONLY | os.O_CREAT)
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT)
    read_end, write_end = os.pipe()
    os.close(write_end)
    pump = Pump(Console(terminal=False))
    now = [0.0]
    pump.clock = lambda: now[0]
    stream = pump.add(read_end, b"GPU0:", console_fd, log_fd, keep_tail=True)
    largest_carry = 0
    for chunk in chunks:
        now[0] += step
        pump.feed(stream, chunk)
        largest_carry = max(largest_carry, len(stream.carry))
    pump.close_stream(stream)
    for fd in (console_fd, log_fd, pump.wake_r, pump.wake_w):
        os.close(fd)
    assert largest_carry <= MAX_LINE
    return console_path.read_bytes(), log_path.read_bytes(), largest_carry


@pytest.mark.timeout(20)
def test_long_lines_next_to_carriage_returns_stay_linear(tmp_path):
    """A multi-MiB line arriving in small pieces, then a progress line in the same chunk as its end."""
    long = b"y" * (6 << 20)
    pieces = [long[i:i + 4096] for i in range(0, len(long), 4096)]
    console, log, _ = feed_pump(tmp_path, [b"start\n" + pieces[0], *pieces[1:], b"\nbar 1%\rbar 100%\ntail"])
    assert console == b"GPU0:start\nGPU0:" + long + b"\nGPU0:bar 100%\nGPU0:tail\n"
    assert log == b"start\n" + long + b"\nbar 100%\ntail\n"


@pytest.mark.timeout(20)
def test_a_bar_that_never_ends_its_line_is_bounded(tmp_path):
    updates = [f"\r{i / 1000:.1%} |{'#' * (i // 20)}".encode() for i in range(20000)]
    console, _, largest_carry = feed_pump(tmp_path, updates)
    assert console == b"GPU0:" + updates[-1][1:] + b"\n"
    assert largest_carry <= max(len(u) for u in updates), "only the segment on screen is kept"


def test_terminal_gets_coloured_prefixes_and_a_live_footer(tmp_path):
    """Stdout and stderr on one terminal: rank lines scroll above a footer with each rank's step and loss."""
    master, slave = os.openpty()
    r = start(tmp_path, "--nproc", "2", entry=WORKER, entry_args=("--steps", "20", "--step-time", "0.03"),
              env=clean_env(TERM="xterm", COLUMNS="120", LINES="40"), stdout=slave, stderr=slave)
    os.close(slave)
    screen = b""
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the supervisor closed the terminal's last writer
            break
        if not data:
            break
        screen += data
    os.close(master)
    r.wait()
    assert r.returncode == 0
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen.decode(errors="replace"))
    assert "CPU0:rank 0 finished 20 steps" in text and "CPU1:rank 1 finished 20 steps" in text
    assert re.search(r"CPU0\s+\d+/20\s+\d+\.\d{4}\s+1,000", text), "the footer shows step, loss and tokens/s"
    assert "supervisor: run finished" in text


def read_all(pipe) -> bytes:
    data = b""
    while chunk := pipe.read(1 << 20):
        data += chunk
    return data


def test_a_paused_reader_is_not_a_hang(tmp_path):
    """Nobody reads our stdout for a while (a paused pager): the ranks block on their output, which is not a stall."""
    r = start(tmp_path, "--nproc", "2", "--hang-timeout", "0.5", "--startup-timeout", "20", entry=WORKER,
              entry_args=("--steps", "60", "--chatter", "50000", "--fail-rank", "9"), stdout=subprocess.PIPE)
    time.sleep(3)  # several hang timeouts with the console blocked
    out = read_all(r.proc.stdout)
    r.wait()
    assert r.returncode == 0, r.stderr[-2000:]
    assert "stalled" not in r.stderr
    assert out.count(b"CPU0:rank 0 step ") == 60 and out.count(b"CPU1:rank 1 step ") == 60


def test_a_paused_reader_does_not_delay_the_kill_all(tmp_path):
    """Rank 1 fails while the console is blocked by rank 0's output; rank 0 ignores SIGTERM: it is killed at the end
    of the grace period all the same, the supervisor's messages wait for the reader instead."""
    r = start(tmp_path, "--nproc", "2", "--grace-period", "0.5", entry=WORKER, stdout=subprocess.PIPE,
              entry_args=("--steps", "0", "--chatter", "50000", "--fail", "exit", "--fail-step", "50",
                          "--on-term", "ignore"))
    pids = r.wait_for_ranks(2)
    deadline = time.monotonic() + 20
    while alive(pids[1]) and time.monotonic() < deadline:  # rank 1 reaches its failing step
        time.sleep(0.05)
    assert survivors(pids, timeout=3.0) == [], "rank 0 still runs while the reader is paused"
    read_all(r.proc.stdout)
    r.wait()
    assert r.returncode == 3
