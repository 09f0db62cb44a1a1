"""The test side: run the real supervisor as a subprocess on the rank programs beside this file, and check what is
left running afterwards. Imported by tests/test_supervisor_*.py (as ``rank_scripts.harness``)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "rank_scripts" / "worker.py"
SPAM = ROOT / "tests" / "rank_scripts" / "spam.py"
PYTHON = sys.executable
SEAM_KEYS = ("SUPERVISOR_FAKE_GPUS", "SUPERVISOR_FAKE_GPU_STATE", "CUDA_VISIBLE_DEVICES", "GPU_RANK", "RANK",
             "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SUPERVISOR_PROGRESS_FD", "SLURM_JOB_ID",
             "SLURM_NNODES", "SLURM_JOB_NUM_NODES", "SLURM_NODEID", "SLURM_JOB_NODELIST", "SLURM_NTASKS",
             "SLURMD_NODENAME", "SLURM_RESTART_COUNT", "SUPERVISOR_CONTROL_SECRET", "SUPERVISOR_CONTROL_SECRET_FILE",
             "SUPERVISOR_NODE_EXCLUSION",
             # inductor writes its cache folder into the environment of a process that compiled (this test process,
             # after an in-process compile): a supervisor started with it would keep it instead of the run folder's
             "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
CONTROL_SECRET = "a-test-secret-of-the-control-channel"  # what two node supervisors of a test share

_started: list["Run"] = []


def project_pythonpath(*first: str) -> str:
    """PYTHONPATH for a process a test starts: `first`, the checkout, then this environment's own entries. Those stay:
    where the dependencies are installed outside the interpreter (wheels unpacked into a folder on PYTHONPATH, as on a
    GPU machine that gets them carried), a process without them could not import them."""
    return os.pathsep.join(filter(None, [*first, str(ROOT), os.environ.get("PYTHONPATH")]))


def free_port_pair() -> int:
    """A port P such that P and P+1 (the control channel) are both free right now."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 65534:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + 1))
                    return port
                except OSError:
                    continue
    raise RuntimeError("no free port pair")


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without the seams and rank variables a test must set itself. The machine's GPUs stay hidden
    (CPU ranks, as on CI) unless `extra` pretends some (SUPERVISOR_FAKE_GPUS) or names CUDA_VISIBLE_DEVICES."""
    env = {k: v for k, v in os.environ.items() if k not in SEAM_KEYS}
    env["PYTHONPATH"] = project_pythonpath()
    env.update(extra)
    if "SUPERVISOR_FAKE_GPUS" not in env:
        env.setdefault("CUDA_VISIBLE_DEVICES", "")
    return env


@dataclass
class Run:
    proc: subprocess.Popen
    tmp: Path
    log_dir: Path
    pid_dir: Path
    out_path: Path
    err_path: Path
    returncode: int | None = None
    stdout: str = ""
    stderr: str = ""
    elapsed: float = 0.0
    started: float = field(default_factory=time.monotonic)

    def wait(self, timeout: float = 60) -> "Run":
        try:
            self.returncode = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_everything(self)
            raise
        self.elapsed = time.monotonic() - self.started
        self.stdout = self.out_path.read_text(errors="replace")
        self.stderr = self.err_path.read_text(errors="replace")
        return self

    def run_dir(self) -> Path:
        (folder,) = [p for p in self.log_dir.iterdir() if p.is_dir()]
        return folder

    def pids(self) -> list[int]:
        return [int(p) for f in sorted(self.pid_dir.glob("rank*.pids")) for p in f.read_text().split()]

    def wait_for_ranks(self, count: int, timeout: float = 20) -> list[int]:
        """Wait until `count` ranks wrote their pid files (they are up, children started)."""
        deadline = time.monotonic() + timeout
        while len(list(self.pid_dir.glob("rank*.pids"))) < count:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise AssertionError(f"ranks did not start: {self.err_path.read_text()[-2000:]}")
            time.sleep(0.02)
        return self.pids()

    def wait_for_stderr(self, text: str, timeout: float = 30) -> None:
        """Wait until the supervisor has said `text` on stderr (a node joined, a state reached): never a fixed sleep."""
        deadline = time.monotonic() + timeout
        while text not in self.err_path.read_text(errors="replace"):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise AssertionError(f"never said {text!r}: {self.err_path.read_text(errors='replace')[-2000:]}")
            time.sleep(0.02)


def start(tmp: Path, *args: str, entry: Path | None = WORKER, entry_args: tuple[str, ...] = (),
          env: dict[str, str] | None = None, stdout: int | None = None, stderr: int | None = None,
          tag: str = "", stdin: int | None = None) -> Run:
    """Start ``python -m supervisor ARGS --entry ENTRY -- ENTRY_ARGS`` in `tmp` (logs and pid files there too); its
    stdin is /dev/null unless `stdin` gives one."""
    log_dir, pid_dir = tmp / f"logs{tag}", tmp / f"pids{tag}"
    pid_dir.mkdir(parents=True, exist_ok=True)
    out_path, err_path = tmp / f"stdout{tag}.txt", tmp / f"stderr{tag}.txt"
    cmd = [PYTHON, "-m", "supervisor", "--log-dir", str(log_dir), *args]
    if entry is not None:
        cmd += ["--entry", str(entry)]
    if entry is WORKER:
        entry_args = ("--pid-dir", str(pid_dir), *entry_args)
    if entry_args:
        cmd += ["--", *entry_args]
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen(cmd, cwd=tmp, env=env or clean_env(), stdout=stdout if stdout is not None else out,
                                stderr=stderr if stderr is not None else err,
                                stdin=stdin if stdin is not None else subprocess.DEVNULL)
    started = Run(proc, tmp, log_dir, pid_dir, out_path, err_path)
    _started.append(started)
    return started


def run(tmp: Path, *args: str, timeout: float = 60, **kwargs) -> Run:
    return start(tmp, *args, **kwargs).wait(timeout)


def alive(pid: int) -> bool:
    """Running, sleeping or stopped; a zombie has finished (it only waits for its parent to read its status)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def survivors(pids: list[int], timeout: float = 3.0) -> list[int]:
    """The pids still alive after up to `timeout` seconds (PDEATHSIG and the sentinel act within milliseconds)."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in pids if alive(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.02)


def ours(pid: int) -> bool:
    """A recorded pid still running one of our programs (a pid may have been reused since: leave others alone)."""
    try:
        cmdline = " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return False
    return "sleep 300" in cmdline or str(WORKER) in cmdline


def kill_everything(run: Run) -> None:
    """Clean-up: the supervisor (SIGKILL, then its sentinel's own clean-up, as for a supervisor killed in production),
    its whole tree, and every process a rank recorded that still runs our programs."""
    pids = []
    try:
        pids = [p.pid for p in psutil.Process(run.proc.pid).children(recursive=True)]
    except psutil.Error:
        pass
    if run.proc.poll() is None:
        run.proc.kill()
        run.proc.wait()
        survivors(pids, timeout=2.0)  # its sentinel's turn: it kills the ranks and removes the run's /dev/shm folder
    for pid in pids + [p for p in (run.pids() if run.pid_dir.exists() else []) if ours(p)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


@pytest.fixture(autouse=True)
def reap_supervisors() -> Iterator[None]:
    """Every test (tests/conftest.py loads this module as a plugin): whatever supervisor it started through `start`
    and `run`, and their ranks, are killed at its end, should a failing test have left them behind."""
    yield
    while _started:
        kill_everything(_started.pop())
