"""Restart benchmark: training under repeated faults, the supervisor against torchrun --max-restarts, one trainer.

    python bench/bench_restart.py [--steps 60] [--every 13] [--interval 10] [--nproc 2] [--rounds 1] [--set KEY=VALUE ...]

Both launchers run `pretrain_main.py` on the debug preset, `--nproc` CPU ranks on gloo (2 by default), a checkpoint
every `--interval` steps (and any `--set` override of the trainer's config, for both: `--set training.batch_size=16`
gives the same model a longer step, which is what a fault's fixed costs are weighed against):
``python -m supervisor --max-restarts F`` and ``torchrun --standalone --max-restarts F`` (the trainer by hand with
``checkpoint.resume=auto``, so that each of torchrun's restarts resumes the latest checkpoint, and
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: with torchrun's default, its rendezvous store outlives a restart with the
failed group's keys in it, and the restarted group's gloo connects to the dead ranks' addresses, failing or hanging
until the trainer's `system.dist_timeout_s` (torch 2.13, every restart of this benchmark). The faults come from
outside, the same way for both: half a step after rank 0 logs step `every`·i − 1 (0-based: `every`·i steps done)
for the first time, in the middle of the next step, where a fault that comes at a random moment lands on average
(and clear of the checkpoint an interval may take at that step boundary), rank 1 of the running group gets SIGKILL
(under torchrun the process whose environment says ``RANK=1`` and the group's ``TORCHELASTIC_RESTART_COUNT``; under
the supervisor the pid its supervisor.log gives for that group's CPU1). Each launcher also runs once without faults,
for its final loss and its goodput without faults. Figures per run, from rank 0's step lines stamped as they arrive:

  goodput          useful steps' time / wall time: the distinct steps × the median step time of the same launcher's
                   run without faults (consecutive lines of one group), over the whole run's wall time, start-up
                   included; and after start-up: over the wall time from the first step line on (what the faults,
                   evaluations and checkpoints cost, without the one start-up every run pays)
                   a free restart: the goodput after start-up a restart costing nothing would reach, the run
                   without faults' wall time after start-up plus half a step per fault (the step a fault cuts short
                   is lost whatever follows): no launcher can do better on this run
  fault → step     seconds from the SIGKILL to rank 0's first step line after it (the restarted group's first step)
  wall per fault   the wall time after start-up each fault added to the launcher's run without faults (the half step
                   it cut short, the restart, the steps trained twice, a slower first step)
  trained twice    step lines logged again after a restart: the steps between the resumed state and the fault (the
                   half step the fault cut short is lost time, never logged)
  final loss       rank 0's mean loss over the ranks at the last step (`[all ranks] step N-1/N | mean loss`)

and, from the supervisor's run with faults (the run without any has no restart to come, so it takes no memory
snapshots), what a memory snapshot costs as `checkpoint.memory_interval=auto` measured it against the step.

The runs alternate launchers (supervisor, torchrun, supervisor, torchrun), so that the machine's other load falls on
both alike, `--rounds` times (a row per launcher and round, then the medians over the rounds: a fault's cost is a
few tenths of a second, of the order of what other load moves a run of 100 steps by); the ratios are the supervisor's figure over torchrun's in the same command. The supervisor's ranks, the
first group's and every restart's, are forked by its standby (importing once for the run, before the first group; in
the run without faults, `--max-restarts 0`, there is no standby and the ranks are spawned, each importing); `--keep DIR`
keeps every run's logs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEP = re.compile(rb"\[GPU 0\] Step \[(\d+)/(\d+)\]")
FINAL = re.compile(rb"\[all ranks\] step (\d+)/(\d+) \| mean loss ([0-9.]+)")
SNAPSHOTS = re.compile(rb"(memory snapshots every .*?) \(checkpoint")  # the supervisor's ranks: what `auto` measured
RUN_TIMEOUT = 900.0


@dataclass
class Run:
    """What one launcher's run showed: rank 0's step lines and the faults, stamped (seconds since the start)."""

    launcher: str
    steps: list[tuple[float, int]] = field(default_factory=list)
    kills: list[float] = field(default_factory=list)
    wall: float = 0.0
    exit_code: int = 0
    final_loss: float | None = None
    snapshots: str = ""  # the first group's memory snapshots, as `checkpoint.memory_interval=auto` measured them
    tail: str = ""

    def step_time(self) -> float:
        """The median time between two consecutive steps of one group (no fault between them)."""
        gaps = [t1 - t0 for (t0, s0), (t1, s1) in zip(self.steps, self.steps[1:])
                if s1 == s0 + 1 and not any(t0 < k < t1 for k in self.kills)]
        return statistics.median(gaps)

    def distinct(self) -> int:
        return len({s for _, s in self.steps})

    def goodput(self, clean: Run, after_start: bool = False) -> float:
        """With the step time of `clean`, the launcher's run without faults: a run's own steps are slowed by what
        else it does (a standby's imports), which is no useful time. `after_start`: over the wall time from the first
        step line on (the start-up, which a run pays once with or without faults, left out)."""
        return self.distinct() * clean.step_time() / (self.after_start() if after_start else self.wall)

    def after_start(self) -> float:
        """The wall time from the first step line on."""
        return self.wall - self.steps[0][0]

    def cost_per_fault(self, clean: Run) -> float:
        """The wall time after start-up each fault added to the launcher's run without faults, the half step it cut
        short included."""
        return (self.after_start() - clean.after_start()) / len(self.kills)

    def bound(self, clean: Run) -> float:
        """The goodput after start-up a restart costing nothing would reach: the run without faults' wall time after
        start-up plus, per fault, the half step it cut short (lost whatever comes next). The ceiling of any
        launcher on this run; a fault's own cost is measured against it."""
        return self.distinct() * clean.step_time() / (clean.after_start() + len(self.kills) * clean.step_time() / 2)

    def twice(self) -> int:
        return len(self.steps) - self.distinct()

    def fault_to_step(self) -> list[float]:
        return [next(t for t, _ in self.steps if t > k) - k for k in self.kills]


def trainer_flags(steps: int, interval: int, work: Path, overrides: list[str]) -> list[str]:
    return ["--debug", "--max-steps", str(steps), "--set", "system.device=cpu",
            "--set", f"checkpoint.interval={interval}", "--set", f"checkpoint.dir={json.dumps(str(work / 'ckpt'))}",
            "--set", f"data.cache_dir={json.dumps(str(work.parent / 'cache'))}", "--set", "logging.plot=false",
            *(flag for override in overrides for flag in ("--set", override))]


def command(launcher: str, flags: list[str], restarts: int, nproc: int, work: Path) -> list[str]:
    if launcher == "supervisor":
        return [sys.executable, "-m", "supervisor", "--nproc", str(nproc), "--no-footer", "--max-restarts",
                str(restarts), "--log-dir", str(work / "logs"), *flags]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "--max-restarts", str(restarts), str(ROOT / "pretrain_main.py"), *flags,
            "--set", "checkpoint.resume=auto", "--set", f"logging.run_dir={json.dumps(str(work / 'logs'))}"]


def rank_1(launcher: str, launcher_pid: int, group: int, work: Path) -> list[int]:
    """The pid of rank 1 of the running group (`group`: its restart count); none when it is not there (yet). The
    supervisor's log names each group's pids (a restart's ranks are forked by its standby: their environment is the
    standby's); torchrun's ranks are found by the environment they started with."""
    if launcher == "supervisor":
        logs = [log.read_text() for log in (work / "logs").glob("*/supervisor.log")]
        return [int(pid) for pid in re.findall(rf"^\S+ \S+ group {group}: .*?CPU1 pid (\d+)", "".join(logs), re.M)]
    import psutil

    found = []
    for p in psutil.Process(launcher_pid).children(recursive=True):
        try:
            env = p.environ()
        except psutil.Error:
            continue
        if env.get("RANK") == "1" and env.get("TORCHELASTIC_RESTART_COUNT") == str(group):
            found.append(p.pid)
    return found


def kill_rank_1(launcher: str, launcher_pid: int, group: int, work: Path) -> bool:
    """SIGKILL rank 1 of the running group; False when it is not there (yet)."""
    pids = rank_1(launcher, launcher_pid, group, work)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    return bool(pids)


def run(launcher: str, steps: int, interval: int, every: int | None, nproc: int, work: Path,
        overrides: list[str]) -> Run:
    faults = [every * i for i in range(1, (steps - 1) // every + 1)] if every else []
    work.mkdir()
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": str(work)}
    if launcher == "torchrun":
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    started = time.monotonic()
    proc = subprocess.Popen(command(launcher, trainer_flags(steps, interval, work, overrides), len(faults), nproc,
                                    work),
                            cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    timer = threading.Timer(RUN_TIMEOUT, proc.kill)
    timer.start()
    result, tail = Run(launcher), []
    pending: list[threading.Timer] = []  # the next fault's kill, due half a step after its step line

    def kill() -> None:
        if kill_rank_1(launcher, proc.pid, len(result.kills), work):
            result.kills.append(time.monotonic() - started)
            faults.pop(0)
        pending.clear()  # (rank 1 not there yet: the fault waits for its step line again)

    for raw in proc.stdout:
        now = time.monotonic() - started
        tail = (tail + [raw.decode(errors="replace")])[-40:]
        if (final := FINAL.search(raw)) and int(final[1]) == int(final[2]) - 1:
            result.final_loss = float(final[3])
        if not result.snapshots and (measured := SNAPSHOTS.search(raw)):
            result.snapshots = measured[1].decode()
        if not (m := STEP.search(raw)):
            continue
        step = int(m[1])
        result.steps.append((now, step))
        if not pending and faults and step == faults[0] - 1 and len(result.steps) > 1:
            pending.append(threading.Timer((now - result.steps[-2][0]) / 2, kill))
            pending[0].start()
    result.exit_code = proc.wait()
    for late in pending:
        late.cancel()
    timer.cancel()
    result.wall = time.monotonic() - started
    result.tail = "".join(tail)
    return result


def prepare(work: Path) -> None:
    """The debug preset's token cache, built once before any measured run."""
    subprocess.run([sys.executable, str(ROOT / "prepare_dataset.py"), "--debug", "--set",
                    f"data.cache_dir={json.dumps(str(work / 'cache'))}"], cwd=work, check=True,
                   stdout=subprocess.DEVNULL, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": str(work)})


def row(label: str, r: Run, clean: Run) -> str:
    faults = r.fault_to_step()
    each = f" ({', '.join(f'{v:.2f}' for v in faults)})" if faults else ""
    mean = f"{statistics.mean(faults):.2f} s{each}" if faults else "—"
    return (f"| {label} | {len(r.kills)} | {r.wall:.1f} s | {r.goodput(clean):.2f} (without faults "
            f"{clean.goodput(clean):.2f}) | {r.goodput(clean, True):.2f} ({clean.goodput(clean, True):.2f}; a free "
            f"restart {r.bound(clean):.2f}) | {mean} | {r.cost_per_fault(clean):.2f} s | {r.twice()} | "
            f"{r.final_loss} / {clean.final_loss} |")


def medians(rounds: list[dict[tuple[str, bool], Run]], launcher: str) -> tuple[float, float, float, float, float]:
    """The medians over the rounds of the launcher's goodput, goodput after start-up, mean fault → next step, wall per
    fault and a free restart's goodput after start-up."""
    pairs = [(r[launcher, True], r[launcher, False]) for r in rounds]
    return (statistics.median(f.goodput(c) for f, c in pairs), statistics.median(f.goodput(c, True) for f, c in pairs),
            statistics.median(statistics.mean(f.fault_to_step()) for f, _ in pairs),
            statistics.median(f.cost_per_fault(c) for f, c in pairs), statistics.median(f.bound(c) for f, c in pairs))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60, help="steps per run (default 60)")
    parser.add_argument("--every", type=int, default=13, help="rank 1 killed every N steps (default 13)")
    parser.add_argument("--interval", type=int, default=10, help="checkpoint.interval (default 10)")
    parser.add_argument("--nproc", type=int, default=2, help="CPU ranks (default 2)")
    parser.add_argument("--rounds", type=int, default=1, help="the four runs this many times (default 1)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                        help="a trainer config override for every run (repeatable)")
    parser.add_argument("--keep", metavar="DIR", help="run in DIR (a new folder) and keep the runs' logs there")
    args = parser.parse_args()
    rounds: list[dict[tuple[str, bool], Run]] = []
    with tempfile.TemporaryDirectory() if args.keep is None else nullcontext(args.keep) as tmp:
        base = Path(tmp)
        base.mkdir(exist_ok=True)
        prepare(base)
        for n in range(args.rounds):
            runs: dict[tuple[str, bool], Run] = {}
            for faulted in (False, True):
                for launcher in ("supervisor", "torchrun"):
                    name = f"{launcher}-{'faults' if faulted else 'clean'}{f'-{n + 1}' if args.rounds > 1 else ''}"
                    r = run(launcher, args.steps, args.interval, args.every if faulted else None, args.nproc,
                            base / name, args.overrides)
                    if r.exit_code != 0 or (faulted and not r.kills):
                        print(f"{name} failed (exit {r.exit_code}, {len(r.kills)} faults):\n{r.tail}", file=sys.stderr)
                        return 1
                    runs[launcher, faulted] = r
            rounds.append(runs)
    overrides = "".join(f", {override}" for override in args.overrides)
    print(f"debug preset{overrides}, {args.nproc} CPU ranks (gloo), {args.steps} steps, a checkpoint every "
          f"{args.interval} steps, rank 1 SIGKILLed half a step after step {args.every}·i is reached\n")
    print("| launcher | faults | wall | goodput | goodput after start-up | fault → next step (mean; each) | wall per "
          "fault | steps trained twice | final loss (faults / without) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n, runs in enumerate(rounds):
        for launcher in ("supervisor", "torchrun"):
            label = f"{launcher}{f' ({n + 1})' if args.rounds > 1 else ''}"
            print(row(label, runs[launcher, True], runs[launcher, False]))
    print(f"\nthe supervisor's ranks, with faults: {rounds[-1]['supervisor', True].snapshots}")
    ours, theirs = medians(rounds, "supervisor"), medians(rounds, "torchrun")
    if args.rounds > 1:
        for launcher, (whole, after, fault, cost, bound) in (("supervisor", ours), ("torchrun", theirs)):
            print(f"{launcher}, medians of {args.rounds} rounds: goodput {whole:.2f}, after start-up {after:.2f} (a "
                  f"free restart {bound:.2f}), fault → next step {fault:.2f} s, wall per fault {cost:.2f} s")
    last = rounds[-1]
    print(f"supervisor / torchrun: goodput {ours[0] / theirs[0]:.2f}x, fault → next step {ours[2] / theirs[2]:.2f}x, "
          f"steps trained twice {last['supervisor', True].twice()} against {last['torchrun', True].twice()} (the last "
          f"round), wall {last['supervisor', True].wall / last['torchrun', True].wall:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
