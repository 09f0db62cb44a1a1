"""The rank's process as torchrun leaves it: rank 0 reads the supervisor's stdin (pdb at a ``breakpoint()``; a prompt
on the terminal shows while it waits), PYTHONPATH is the user's exactly (their own package named ``trainer`` is the
one imported), ``sys.argv[0]`` is the script as typed, OMP_NUM_THREADS and TORCHELASTIC_SIGNALS_TO_HANDLE are
torchrun's, ``--local-ranks-filter`` thins the console and not the logs; a port another program holds is refused
before anything starts. (The bad rendezvous endpoints, addresses and program names of torchrun's command line are
among the one-line refusals of tests/test_torchrun_dropin.py.)"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from rank_scripts.harness import clean_env, project_pythonpath, start
from supervisor.console import Console
from supervisor.group.pump import PROMPT_WAIT, Pump
from supervisor.launch import cli
from supervisor.plan import spec
from supervisor.plan.spec import SIGNALS_TO_HANDLE, SIGNALS_TO_HANDLE_SINCE, Plan, node_ranks
from trainer.config import PROJECT_ROOT

PROGRAMS = Path(__file__).resolve().parent / "torchrun_programs"


def test_pdb_on_rank_0_reads_the_supervisors_stdin(tmp_path):
    """``printf 'p x*7\\nc\\n' | python -m supervisor --nproc-per-node 2 interactive.py pdb``: pdb reads the pipe,
    prints 42 and continues; rank 1, which reads /dev/null, finishes as well."""
    typed, typing = os.pipe()
    os.write(typing, b"p x*7\nc\n")
    os.close(typing)
    run = start(tmp_path, "--nproc-per-node", "2", str(PROGRAMS / "interactive.py"), "pdb", entry=None, stdin=typed)
    os.close(typed)
    run.wait(60)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "CPU0:(Pdb) 42\n" in run.stdout and "CPU0:(Pdb) rank 0 done\n" in run.stdout, run.stdout
    assert "CPU1:rank 1 done\n" in run.stdout


def test_a_prompt_on_the_terminal_shows_while_it_waits(tmp_path):
    """The supervisor's stdin a terminal: rank 0's ``input("name? ")`` reaches the console before its line ends,
    and the rest of the line follows it once a name is typed; its log file has the line once, whole."""
    terminal, rank_side = os.openpty()
    run = start(tmp_path, str(PROGRAMS / "interactive.py"), "ask", entry=None, stdin=rank_side)
    os.close(rank_side)
    try:
        deadline = time.monotonic() + 60
        while not run.out_path.read_bytes().endswith(b"CPU0:name? "):
            assert time.monotonic() < deadline and run.proc.poll() is None, run.err_path.read_text()[-3000:]
            time.sleep(0.05)
        os.write(terminal, b"bob\n")
        run.wait(60)
    finally:
        os.close(terminal)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout == "CPU0:name? hello bob\nCPU0:rank 0 done\n"
    assert (run.run_dir() / "cpu0.log").read_text() == "name? hello bob\nrank 0 done\n"


def whoami(tmp_path: Path, launcher: Any, *flags: str) -> tuple[list[dict], Any]:
    """``whoami.py`` copied into `tmp_path` and started there as ``./whoami.py`` on 2 ranks, with a package of the
    user's named ``trainer`` first on PYTHONPATH, PYTHON_EXEC naming a link to this interpreter, and no
    OMP_NUM_THREADS set: each rank's record, and the run."""
    user, out, python = tmp_path / "user", tmp_path / f"out-{launcher.__name__}", tmp_path / "python"
    (user / "trainer").mkdir(parents=True, exist_ok=True)
    (user / "trainer" / "__init__.py").write_text("")
    out.mkdir()
    shutil.copy(PROGRAMS / "whoami.py", tmp_path / "whoami.py")
    if not python.exists():
        python.symlink_to(sys.executable)
    env = clean_env(PYTHONPATH=f"{user}{os.pathsep}{project_pythonpath()}", PYTHON_EXEC=str(python))
    env.pop("OMP_NUM_THREADS", None)
    run = launcher(tmp_path, env, "--nproc-per-node", "2", *flags, "./whoami.py", str(out))
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)], run


def under_supervisor(tmp_path: Path, env: dict[str, str], *argv: str) -> Any:
    run = start(tmp_path, *argv, entry=None, env=env).wait(60)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def torchruns_signals() -> str | None:
    """TORCHELASTIC_SIGNALS_TO_HANDLE as the installed torch's torchrun leaves it to its workers (since torch 2.10)."""
    return SIGNALS_TO_HANDLE if spec.torch_release() >= SIGNALS_TO_HANDLE_SINCE else None


def test_a_torchrun_programs_imports_argv_and_console_are_as_under_torchrun(tmp_path):
    """The user's ``trainer`` package, not the project's, and PYTHONPATH exactly as given; ``./whoami.py`` as typed;
    PYTHON_EXEC's interpreter; OMP_NUM_THREADS=1 for 2 ranks; torchrun's signals; ``--local-ranks-filter 1``: rank
    0's line in its log file only."""
    records, run = whoami(tmp_path, under_supervisor, "--local-ranks-filter", "1")
    user = tmp_path / "user"
    for record in records:
        assert record == {"trainer": str(user / "trainer" / "__init__.py"), "argv0": "./whoami.py",
                          "python": str(tmp_path / "python"),
                          "PYTHONPATH": f"{user}{os.pathsep}{project_pythonpath()}", "OMP_NUM_THREADS": "1",
                          "TORCHELASTIC_SIGNALS_TO_HANDLE": torchruns_signals()}
    assert run.stdout == "CPU1:rank 1 here\n" and "CPU0:" not in run.stderr
    assert (run.run_dir() / "cpu0.log").read_text() == "rank 0 here\n"


@pytest.mark.slow
def test_the_same_process_under_torchrun(tmp_path):
    """torchrun's ranks see what the supervisor's see (the test above), ``--local-ranks-filter`` alike."""
    from test_torchrun_dropin import torchrun

    def under_torchrun(folder: Path, env: dict[str, str], *argv: str) -> Any:
        return torchrun(folder, *argv, env=env)

    records, _ = whoami(tmp_path, under_supervisor, "--local-ranks-filter", "1")
    theirs, run = whoami(tmp_path, under_torchrun, "--local-ranks-filter", "1")
    assert records == theirs
    assert "rank 1 here" in run.stdout and "rank 0 here" not in run.stdout


def test_the_environment_is_torchruns_for_its_programs_and_the_projects_for_its_own(tmp_path, monkeypatch):
    """OMP_NUM_THREADS: torchrun's 1 for several ranks, nothing for one, the cores shared out for the project's
    programs, a value set by hand kept by all; PYTHONPATH: the user's, the project's root first for its programs;
    TORCHELASTIC_SIGNALS_TO_HANDLE where the installed torch's torchrun sets it (2.10 on)."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("PYTHONPATH", raising=False)

    def env(ranks: int, torchrun_contract: bool = True, **plan: str) -> dict[str, str]:
        made = Plan(entry="train.py", entry_args=[], run_dir=tmp_path, ranks=node_ranks([], ranks, 0),
                    torchrun_contract=torchrun_contract, **plan)
        return made.rank_env(made.ranks[0], 29500, None, 0)

    assert "OMP_NUM_THREADS" not in env(1) and "PYTHONPATH" not in env(1)
    monkeypatch.setattr(spec, "torch_release", lambda: SIGNALS_TO_HANDLE_SINCE)
    assert env(2)["OMP_NUM_THREADS"] == "1" and env(2)["TORCHELASTIC_SIGNALS_TO_HANDLE"] == SIGNALS_TO_HANDLE
    assert env(2, signals_to_handle="SIGUSR1")["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGUSR1"
    monkeypatch.setattr(spec, "torch_release", lambda: (2, 9))  # torchrun before --signals-to-handle sets none
    assert "TORCHELASTIC_SIGNALS_TO_HANDLE" not in env(2)
    monkeypatch.setenv("PYTHONPATH", "/users/own")
    assert env(2)["PYTHONPATH"] == "/users/own"
    ours = env(2, torchrun_contract=False)
    assert ours["PYTHONPATH"] == f"{PROJECT_ROOT}{os.pathsep}/users/own" and int(ours["OMP_NUM_THREADS"]) >= 1
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert env(1)["OMP_NUM_THREADS"] == env(2)["OMP_NUM_THREADS"] == env(2, False)["OMP_NUM_THREADS"] == "4"


def test_a_master_port_in_use_is_refused_before_anything_starts(tmp_path, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = cli.main(["--log-dir", str(tmp_path / "logs"), "--master-port", str(port), "--nproc-per-node", "2",
                         str(PROGRAMS / "whoami.py"), str(tmp_path)])
    assert code == 2 and not (tmp_path / "logs").exists()
    assert capsys.readouterr().err == (
        f"error: port {port}, where node 0's rank 0 would host the rendezvous, cannot be taken on this machine "
        f"(another program listens on it); choose a free one with --master-port PORT (or --rdzv-endpoint "
        f"HOST:PORT), or on a single node leave the port out and a free one is taken\n")


# -- prompts, in the pump: its clock by hand ----------------------------------------------------------------------

class Ranks:
    """Two ranks' stdout through one pump (no thread): rank 0's may prompt, rank 1's reaches the console unless
    `filtered`. The console and each rank's log file are files."""

    def __init__(self, tmp_path: Path, filtered: bool = False) -> None:
        self.console_path = tmp_path / "console"
        self.fds = [os.open(self.console_path, os.O_WRONLY | os.O_CREAT)]
        self.pump = Pump(Console(terminal=False))
        self.now = 0.0
        self.pump.clock = lambda: self.now
        self.streams = []
        for rank in (0, 1):
            self.fds.append(os.open(tmp_path / f"cpu{rank}.log", os.O_WRONLY | os.O_CREAT))
            read_end, write_end = os.pipe()
            os.close(write_end)
            self.streams.append(self.pump.add(read_end, f"CPU{rank}:".encode(), None if filtered and rank else
                                              self.fds[0], self.fds[-1], keep_tail=False, prompts=rank == 0))
        self.tmp_path = tmp_path

    def write(self, rank: int, data: bytes) -> None:
        self.pump.feed(self.streams[rank], data)

    def wait(self, seconds: float) -> None:
        self.now += seconds
        self.pump.show_due_prompts()

    def console(self) -> bytes:
        return self.console_path.read_bytes()

    def close(self) -> tuple[bytes, bytes, bytes]:
        """Both streams end: the console, and each rank's log file."""
        for stream in self.streams:
            self.pump.close_stream(stream)
        for fd in (*self.fds, self.pump.wake_r, self.pump.wake_w):
            os.close(fd)
        return self.console(), *((self.tmp_path / f"cpu{rank}.log").read_bytes() for rank in (0, 1))


def test_an_unfinished_line_that_stays_unchanged_is_shown_and_continued(tmp_path):
    ranks = Ranks(tmp_path)
    ranks.write(0, b"(Pdb) ")
    ranks.wait(PROMPT_WAIT / 2)
    assert ranks.console() == b""
    ranks.wait(PROMPT_WAIT)
    assert ranks.console() == b"CPU0:(Pdb) "
    ranks.write(0, b"42\n(Pdb) ")
    ranks.write(1, b"partial, and no prompt")  # rank 1 does not read the terminal
    ranks.wait(PROMPT_WAIT * 10)
    assert ranks.console() == b"CPU0:(Pdb) 42\nCPU0:(Pdb) "
    ranks.write(0, b"loading")  # a line still being written is no prompt
    for _ in range(5):
        ranks.wait(PROMPT_WAIT / 2)
        ranks.write(0, b".")
    console, log, _ = ranks.close()
    assert console == b"CPU0:(Pdb) 42\nCPU0:(Pdb) loading.....\nCPU1:partial, and no prompt\n"
    assert log == b"(Pdb) 42\n(Pdb) loading.....\n"


def test_another_writer_ends_a_line_left_open(tmp_path):
    """A supervisor message (on stderr here), then another rank's line: each ends the open line first, and the rest
    of the prompt's line comes as a line of its own."""
    ranks = Ranks(tmp_path)
    ranks.write(0, b"name? ")
    ranks.wait(PROMPT_WAIT)
    ranks.pump.console.say("a message")
    ranks.write(0, b"bob\nagain? ")
    ranks.wait(PROMPT_WAIT)
    ranks.write(1, b"rank 1 says\n")
    ranks.write(0, b"no\n")
    console, log, _ = ranks.close()
    assert console == b"CPU0:name? \nCPU0:bob\nCPU0:again? \nCPU1:rank 1 says\nCPU0:no\n"
    assert log == b"name? bob\nagain? no\n"


def test_a_rank_left_out_of_the_console_is_in_its_log(tmp_path):
    ranks = Ranks(tmp_path, filtered=True)
    ranks.write(1, b"rank 1 here\nand its end")
    ranks.write(0, b"rank 0 here\n")
    assert ranks.close() == (b"CPU0:rank 0 here\n", b"rank 0 here\n", b"rank 1 here\nand its end\n")


def test_the_footer_gives_way_to_a_prompt_for_the_rest_of_the_run():
    from rich.console import Console as RichConsole

    console = Console(terminal=True)
    screen = io.StringIO()
    console.rich = RichConsole(file=screen, force_terminal=True, width=80, highlight=False, soft_wrap=True)
    console.start_footer(lambda: "the footer")
    assert console.live is not None
    console.print_lines(b"CPU0:", b"name? ", owner="rank 0", unfinished=True)
    assert console.live is None
    console.start_footer(lambda: "the footer")  # a restarted group's
    assert console.live is None
    console.print_lines(b"CPU0:", b"hello bob\nrank 0 done\n", owner="rank 0")
    console.close()
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen.getvalue())
    assert text.endswith("CPU0:name? hello bob\nCPU0:rank 0 done\n"), repr(text)
