"""Supervisor benchmark: the supervisor and torchrun side by side in one run, 2 CPU ranks on gloo.

    python bench/bench_supervisor.py [--repeats 3] [--line-rounds 3] [--skip-torchrun]

Both launchers get the same torchrun command line (`--standalone --nproc-per-node 2 SCRIPT ARGS`; the supervisor's
own options, where a measure needs them, stand before it). The rank programs are the anchors of ANCHORS.md
("Launcher"), copied into bench/supervisor_anchors/:
1. failure → every rank gone: fail.py (rank 1 ``os._exit(3)`` at step 20, the others inside a gloo all-reduce);
   seconds from its death to the launcher's exit, median over the repeats, and the exit code each launcher returns.
   Goal: ≤ 0.15 s and the rank's own code.
2. a stalled rank, twice: hang_progress.py (hang.py plus the progress channel and faulthandler, as the project's
   trainer) and hang_quiet.py (hang.py as a torchrun program is written: nothing reported, no handler); when the
   supervisor notices, whether it names rank 1, and whether every rank's stack was shown; torchrun is given the same
   time and more. Goal: hang timeout + 1 s (a program that reports nothing: + one sample, a fifth of the timeout).
3. 2 ranks × 3 M log lines: wall time (and CPU seconds, steadier on a shared machine) against the same two ranks
   writing straight to /dev/null, medians of rounds that interleave the two. Goal: ≤ 1.3× direct. Twice: spam2.py
   in the environment every launcher gives its ranks here (PYTHONUNBUFFERED=1, the rank contract: one write per
   line), and spam2_blocks.py, the same lines written in 8 KiB blocks, as stdout was in the anchor's direct run.
   On a loaded machine the wall ratio flatters everyone (the ranks wait for a core either way); the CPU ratio shows
   the cost, and the launcher's own CPU seconds (sampled while it runs) show how much of it is the pump's: reading
   480 MB from the pipes, prefixing it and writing the log files. On 2 cores that both ranks keep busy, the pump has
   no idle core to run on, and the ranks themselves pay more for writing into a pipe than into /dev/null, so the
   wall ratio there measures the machine as much as the launcher. The supervisor's log files are checked
   afterwards: every line whole, none lost.
4. start of 2 no-op ranks (noop.py), median, against spawning the two interpreters bare. Goal: ≤ 0.3 s over bare.
5. SIGKILL to the launcher while 2 ranks sleep (sleeper.py): ranks still alive a second later; for the supervisor
   also with ranks that have children of their own, one of them in a session of its own. Goal: 0.

The machine is shared and noisy: compare the figures of one run with each other, not across runs. Bytecode for the
project is compiled first, as any installed environment has it.
"""

from __future__ import annotations

import argparse
import compileall
import os
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from rank_scripts.harness import alive  # noqa: E402  (a zombie counts as gone: it only awaits its parent's wait)

ANCHORS = ROOT / "bench" / "supervisor_anchors"
WORKER = ROOT / "tests" / "rank_scripts" / "worker.py"
PY = sys.executable
TORCHRUN = str(Path(PY).parent / "torchrun")
RANK_ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


def launch_args(script: Path, *args: str) -> list[str]:
    """The same torchrun command line for both launchers: the supervisor is a drop-in replacement."""
    return ["--standalone", "--nproc-per-node", "2", str(script), *args]


def supervisor_cmd(work: Path, script: Path, *args: str, options: tuple[str, ...] = ()) -> list[str]:
    return [PY, "-m", "supervisor", "--no-footer", "--log-dir", str(work / "logs"), *options,
            *launch_args(script, *args)]


def torchrun_cmd(script: Path, *args: str, options: tuple[str, ...] = ()) -> list[str]:
    return [TORCHRUN, *options, *launch_args(script, *args)]


def kill_tree(proc: subprocess.Popen) -> None:
    try:
        procs = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        procs = []
    for p in [*procs]:
        try:
            p.kill()
        except psutil.Error:
            pass
    if proc.poll() is None:
        proc.kill()
    proc.wait()


class OwnCpu(threading.Thread):
    """Samples a launcher's own CPU seconds (its threads, not its ranks) until it exits: what the pump costs."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.process = psutil.Process(pid)
        self.seconds = 0.0

    def run(self) -> None:
        while True:
            try:
                times = self.process.cpu_times()
            except psutil.Error:
                return
            self.seconds = times.user + times.system
            time.sleep(0.05)


def run_to_end(cmd: list[str], work: Path, stdout=None, timeout: float = 300,
               sample_own_cpu: bool = False) -> tuple[int, float, float]:
    """(exit code, wall seconds, the launcher's own CPU seconds when sampled, else 0)."""
    started = time.perf_counter()
    with open(work / "launcher.err", "wb") as err:
        proc = subprocess.Popen(cmd, cwd=work, env=RANK_ENV, stdout=stdout or subprocess.DEVNULL, stderr=err)
        own = OwnCpu(proc.pid) if sample_own_cpu else None
        if own is not None:
            own.start()
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            raise
    return code, time.perf_counter() - started, own.seconds if own is not None else 0.0


# ---------------------------------------------------------------------------------------------------------------------
# 1. failure


def failure(launcher: str, repeats: int) -> tuple[float, list[int]]:
    latencies, codes = [], []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            died_at = work / "died_at"
            script = work / "fail.py"
            script.write_text((ANCHORS / "fail.py").read_text().replace("DIED_AT", str(died_at)))
            cmd = supervisor_cmd(work, script) if launcher == "supervisor" else torchrun_cmd(script)
            code, _, _ = run_to_end(cmd, work)
            ended = time.time()
            latencies.append(ended - float(died_at.read_text()))
            codes.append(code)
    return statistics.median(latencies), codes


# ---------------------------------------------------------------------------------------------------------------------
# 2. a stalled rank


def stall(launcher: str, hang_timeout: float, script: Path) -> str:
    """`script` stalls rank 1 and writes when to its argument: when the launcher notices, how it knows whose stall it
    is, and whether every rank's stack was shown (in the rank logs: faulthandler on SIGUSR1, for a program that
    reports progress; on the console: py-spy, for one that reports nothing)."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        stalled_at = work / "stalled_at"
        if launcher == "supervisor":
            cmd = supervisor_cmd(work, script, str(stalled_at),
                                 options=("--hang-timeout", str(hang_timeout), "--startup-timeout", "120",
                                          "--grace-period", "2"))
        else:
            cmd = torchrun_cmd(script, str(stalled_at))
        with open(work / "launcher.err", "wb") as err:
            proc = subprocess.Popen(cmd, cwd=work, env=RANK_ENV, stdout=subprocess.DEVNULL, stderr=err)
        try:
            while not stalled_at.exists():
                if proc.poll() is not None:
                    return f"ended before the stall (exit {proc.returncode})"
                time.sleep(0.05)
            stalled = float(stalled_at.read_text())
            try:
                code = proc.wait(hang_timeout + 15)
            except subprocess.TimeoutExpired:
                return f"not noticed: still running {time.time() - stalled:.0f} s after the stall"
            text = (work / "launcher.err").read_text()
            m = re.search(r"no progress for ([\d.]+) s|used CPU time for ([\d.]+) s", text)
            logs = list((work / "logs").glob("*/cpu*.log"))
            dumped = sum("most recent call first" in log.read_text() for log in logs) or text.count("thread MainThread:")
            named = "rank 1 named" if re.search(r"CPU1 \(rank 1\) stalled", text) else "no rank named"
            noticed = f"{float(m[1] or m[2]):.2f} s" if m else "?"
            return (f"noticed after {noticed} of silence (timeout {hang_timeout:g} s), {named}, stacks of "
                    f"{dumped}/{len(logs)} ranks, exit {code}, all gone {time.time() - stalled:.1f} s after the stall")
        finally:
            kill_tree(proc)


# ---------------------------------------------------------------------------------------------------------------------
# 3. log lines


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def direct_spam(script: Path) -> tuple[float, float]:
    """(wall, CPU seconds) of the two ranks writing straight to /dev/null."""
    cpu, started = children_cpu(), time.perf_counter()
    procs = [subprocess.Popen([PY, str(script)], env={**RANK_ENV, "RANK": str(r)}, stdout=subprocess.DEVNULL)
             for r in (0, 1)]
    for p in procs:
        p.wait()
    return time.perf_counter() - started, children_cpu() - cpu


def check_logs(folder: Path, lines: int) -> str:
    """Every line of each rank's log whole (the anchor's format), and all of them there."""
    problems = []
    for rank in (0, 1):
        data = (folder / f"cpu{rank}.log").read_bytes()
        head = f"INFO | [GPU {rank}] Step [".encode()
        whole = data.startswith(head) and data.count(b"\n" + head) == lines - 1 and data.count(b"\n") == lines
        if not whole:
            problems.append(f"cpu{rank}.log")
    return "every line whole" if not problems else "BROKEN: " + ", ".join(problems)


def log_lines(launcher: str, script: Path) -> tuple[float, float, str, float]:
    """(wall, CPU seconds of the launcher and its ranks, log check, the launcher's own CPU seconds)."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        cpu = children_cpu()
        if launcher == "supervisor":
            _, wall, own = run_to_end(supervisor_cmd(work, script), work, sample_own_cpu=True)
            return wall, children_cpu() - cpu, check_logs(next((work / "logs").iterdir()), 3_000_000), own
        _, wall, own = run_to_end(torchrun_cmd(script, options=("--tee", "3", "--log-dir", str(work / "tr"))), work,
                                  sample_own_cpu=True)
        return wall, children_cpu() - cpu, "", own


# ---------------------------------------------------------------------------------------------------------------------
# 4. start-up


def bare_noop() -> float:
    started = time.perf_counter()
    procs = [subprocess.Popen([PY, str(ANCHORS / "noop.py")], env=RANK_ENV) for _ in range(2)]
    for p in procs:
        p.wait()
    return time.perf_counter() - started


def startup(launcher: str, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            script = ANCHORS / "noop.py"
            cmd = supervisor_cmd(work, script) if launcher == "supervisor" else torchrun_cmd(script)
            times.append(run_to_end(cmd, work)[1])
    return statistics.median(times)


# ---------------------------------------------------------------------------------------------------------------------
# 5. SIGKILL the launcher


def orphans(launcher: str, grandchildren: bool = False) -> tuple[int, int]:
    """(still alive a second after the launcher's SIGKILL, how many there were)."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if grandchildren:
            cmd = supervisor_cmd(work, WORKER, "--children", "2", "--escaped-child", "--pid-dir", str(work))
        elif launcher == "supervisor":
            cmd = supervisor_cmd(work, ANCHORS / "sleeper.py")
        else:
            cmd = torchrun_cmd(ANCHORS / "sleeper.py")
        out = work / "out.txt"
        with open(out, "wb") as f:
            proc = subprocess.Popen(cmd, cwd=work, env=RANK_ENV, stdout=f, stderr=subprocess.STDOUT)
        pids: list[int] = []
        deadline = time.monotonic() + 120
        while len(pids) < (8 if grandchildren else 2) and time.monotonic() < deadline:
            time.sleep(0.1)
            if grandchildren:
                files = list(work.glob("rank*.pids"))
                pids = [int(p) for f in files for p in f.read_text().split()] if len(files) == 2 else []
            else:
                pids = [int(p) for p in re.findall(r"pid (\d+)", out.read_text())]
        time.sleep(0.5)
        proc.kill()
        proc.wait()
        time.sleep(1.0)
        left = [p for p in pids if alive(p)]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        return len(left), len(pids)


# ---------------------------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--line-rounds", type=int, default=3, help="rounds of the 3 M lines measure")
    parser.add_argument("--skip-torchrun", action="store_true")
    args = parser.parse_args()
    compileall.compile_dir(ROOT / "supervisor", quiet=1)
    compileall.compile_dir(ROOT / "trainer", quiet=1)
    launchers = ["supervisor"] + ([] if args.skip_torchrun else ["torchrun"])
    rows: list[tuple[str, str, str, str, str]] = []

    def say(text: str) -> None:
        print(text, flush=True)

    say("1. failure -> every rank gone")
    fail = {name: failure(name, args.repeats) for name in launchers}
    for name, (median, codes) in fail.items():
        say(f"   {name}: median {median:.3f} s, exit codes {codes}")

    say("2. a stalled rank")
    hang = {name: stall(name, 2.0, ANCHORS / "hang_progress.py") for name in launchers}
    quiet = {name: stall(name, 2.0, ANCHORS / "hang_quiet.py") for name in launchers}
    for name in launchers:
        say(f"   {name}, reporting progress: {hang[name]}")
        say(f"   {name}, reporting nothing: {quiet[name]}")

    say("3. 2 ranks x 3 M log lines (medians; direct and supervisor interleaved, torchrun once)")
    lines: dict[str, dict[str, tuple[float, float]]] = {}
    for kind, script in (("per line", ANCHORS / "spam2.py"), ("8 KiB blocks", ANCHORS / "spam2_blocks.py")):
        runs: dict[str, list[tuple[float, float]]] = {"direct": [], "supervisor": []}
        own: dict[str, list[float]] = {"supervisor": []}
        checks = set()
        for _ in range(args.line_rounds):
            runs["direct"].append(direct_spam(script))
            wall, cpu, check, launcher_cpu = log_lines("supervisor", script)
            runs["supervisor"].append((wall, cpu))
            own["supervisor"].append(launcher_cpu)
            checks.add(check)
        if "torchrun" in launchers:
            wall, cpu, _, launcher_cpu = log_lines("torchrun", script)
            runs["torchrun"], own["torchrun"] = [(wall, cpu)], [launcher_cpu]
        lines[kind] = {name: (statistics.median(w for w, _ in r), statistics.median(c for _, c in r))
                       for name, r in runs.items()}
        base_wall, base_cpu = lines[kind]["direct"]
        say(f"   ranks writing {kind}: direct {base_wall:.2f} s wall, {base_cpu:.2f} s CPU; " + "; ".join(
            f"{name}: {wall:.2f} s = {wall / base_wall:.2f}x wall, {cpu / base_cpu:.2f}x CPU "
            f"({statistics.median(own[name]):.2f} s of it the launcher's own)"
            for name, (wall, cpu) in lines[kind].items() if name != "direct") + f"; supervisor logs: {checks}")

    say("4. start of 2 no-op ranks")
    bare = statistics.median(bare_noop() for _ in range(max(5, args.repeats)))
    start = {name: startup(name, max(5, args.repeats)) for name in launchers}
    say(f"   bare: {bare:.3f} s; " + "; ".join(f"{n}: {t:.3f} s (+{t - bare:.3f} s)" for n, t in start.items()))

    say("5. SIGKILL the launcher")
    kill = {name: orphans(name) for name in launchers}
    deep = orphans("supervisor", grandchildren=True)
    say("   " + "; ".join(f"{n}: {left} of {total} ranks survive" for n, (left, total) in kill.items())
        + f"; supervisor with grandchildren: {deep[0]} of {deep[1]} processes survive")

    def cell(name: str, fn) -> str:
        return fn(name) if name in launchers else "-"

    rows.append(("failure -> group gone (median)",
                 cell("supervisor", lambda n: f"{fail[n][0]:.3f} s, exit {fail[n][1][0]}"),
                 cell("torchrun", lambda n: f"{fail[n][0]:.3f} s, exit {fail[n][1][0]}"),
                 "-", "<= 0.15 s, the rank's code (3)"))
    for what, found in (("reporting progress", hang), ("reporting nothing", quiet)):
        rows.append((f"stalled rank, {what} (hang timeout 2 s)",
                     *(cell(name, lambda n: ", ".join(found[n].split(", ")[:2])) for name in ("supervisor", "torchrun")),
                     "-", "<= timeout + 1 s, rank 1 named"))
    for kind, figures in lines.items():
        base_wall, base_cpu = figures["direct"]
        rows.append((f"2 x 3 M log lines, {kind}",
                     *(cell(name, lambda n: f"{figures[n][0]:.2f} s ({figures[n][0] / base_wall:.2f}x; CPU "
                                            f"{figures[n][1] / base_cpu:.2f}x)")
                       for name in ("supervisor", "torchrun")),
                     f"direct {base_wall:.2f} s", "<= 1.3x direct"))
    rows.append(("start of 2 no-op ranks", cell("supervisor", lambda n: f"{start[n]:.3f} s (+{start[n] - bare:.3f})"),
                 cell("torchrun", lambda n: f"{start[n]:.3f} s (+{start[n] - bare:.3f})"),
                 f"bare {bare:.3f} s", "<= +0.3 s"))
    rows.append(("SIGKILL launcher: survivors", cell("supervisor", lambda n: f"{kill[n][0]}/{kill[n][1]} "
                                                     f"(grandchildren incl.: {deep[0]}/{deep[1]})"),
                 cell("torchrun", lambda n: f"{kill[n][0]}/{kill[n][1]}"), "-", "0"))
    header = ("measure", "supervisor", "torchrun", "reference", "goal")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print()
    for row in [header, tuple("-" * w for w in widths), *rows]:
        print(" | ".join(c.ljust(w) for c, w in zip(row, widths)))


if __name__ == "__main__":
    main()
