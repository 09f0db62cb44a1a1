"""End to end, the fault matrix: every way a run can end badly × when it happens, through the real supervisor.

Faults: a rank raises, exits 3, SIGKILLs itself, segfaults, hangs or loses its GPU (``debug.inject_fault``); or the
supervisor itself gets SIGINT, SIGTERM or SIGKILL. Phases: the first step, mid-run, and while a checkpoint is being
written (``debug.inject_fault_during=checkpoint``; for the supervisor's signals, rank 0 hangs inside that save and the
signal arrives while it is stuck there). Each case runs ``python -m supervisor`` on 2 CPU ranks that pretend to be GPUs 0
and 1, and checks what must hold however a run ends:

* nothing the supervisor started is left: every descendant pid seen while it ran is gone at the end;
* the exit code: the rank's own (1, 3, 128 + signal), 124 for a hang, 130 / 143 for SIGINT / SIGTERM;
* the report names the GPU (except after SIGKILL: nothing is left to write it), and after a rank's fault says whether
  the GPU or the program was at fault (the fake NVML state, ``SUPERVISOR_FAKE_GPU_STATE``: only ``gpu_lost`` changes
  it);
* every published checkpoint is complete and the latest loads; a save cut short is never published;
* ``--resume auto`` then continues from the latest checkpoint (or from step 0 where there is none) and completes.

A run costs about ten seconds on two cores, most of it two ranks importing torch, so the default suite runs
DEFAULT_CASES (a rank's exception inside a save, the supervisor's Ctrl-C inside a save) with the resume leg after the
save cut short (RESUMED_BY_DEFAULT; with no checkpoint, `--resume auto` is a fresh start, tests/test_checkpoint.py).
The other 25 cases are in the slow tier (``-m slow``, which CI runs too), and there every case resumes. A rank's exit
mid-run, its SIGKILL, a hang, a segfault, the supervisor's SIGTERM and its SIGKILL stay in the default suite through
other files: an exit mid-run and the resume after it through test_faults.py and test_supervisor_restarts.py, a rank's
SIGKILL through test_faults.py and test_checkpoint_async.py, a hang through tests/test_diagnosis_e2e.py and
test_supervisor_failures.py (a hang is caught only after the watchdog's allowance, 15 s inside a save here: the
slowest case of all), the segfault through test_supervisor_failures.py, SIGTERM to the supervisor and its
checkpoint-and-resume through test_supervisor_signals.py and test_rank_e2e.py, its SIGKILL through
test_supervisor_signals.py.

The last section adds the machine's faults, all slow tests: a rank frozen by SIGSTOP (named as the culprit), the
checkpoint disk and the log disk filling up mid-run (a small tmpfs), and a damaged latest checkpoint under
--resume auto.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from process_tree import watching
from rank_scripts.harness import clean_env
from rank_support import TINY, checkpoint_content, merged, set_flags
from small_disk import fill, small_disk
from trainer.checkpoint import layout, store

RANK_FAULTS = {"raise": 1, "exit": 3, "sigkill": 128 + signal.SIGKILL, "segv": 128 + signal.SIGSEGV, "hang": 124,
               "gpu_lost": 1}
SUPERVISOR_SIGNALS = {"SIGINT": 130, "SIGTERM": 143, "SIGKILL": -signal.SIGKILL}  # SIGKILL: Popen's view
PHASES = ("first", "mid", "checkpoint")

STEPS = 6  # checkpoints after steps 1 and 3 (step_000002, step_000004); the final one at step_000006
SIGNAL_STEPS = 30  # the runway a signal needs to land mid-run: steps take tens of milliseconds
INTERVAL = 2
FAULT_STEP = {"first": 0, "mid": 3, "checkpoint": 3}  # "checkpoint": inside the save of step_000004
SIGNAL_AFTER_STEP = 2  # mid-run, the supervisor's signal follows rank 0's log line of this step
GRACE = 2.0
# The watchdog's allowances are short only where catching the hang is the point (a hang in step 0, or inside a
# checkpoint, is caught by the start-up allowance). Elsewhere a slow but healthy moment, such as a failing rank 0 writing its loss plot on a busy
# machine, must not pass for a stall; and a rank held inside a save must stay there until the supervisor's signal.
HANG_TIMEOUT, HANG_FIRST_STARTUP_TIMEOUT = 3.0, 15.0
SAFETY_TIMEOUT = 60.0
RUN_TIMEOUT = 150.0

DEFAULT_CASES = {("raise", "checkpoint"), ("SIGINT", "checkpoint")}
RESUMED_BY_DEFAULT = {("SIGINT", "checkpoint")}


@dataclass(frozen=True)
class Case:
    fault: str  # a debug.inject_fault kind, or the name of the signal the supervisor gets
    phase: str  # "first" | "mid" | "checkpoint"

    @property
    def by_supervisor(self) -> bool:
        return self.fault in SUPERVISOR_SIGNALS

    @property
    def resumes(self) -> bool:
        key = (self.fault, self.phase)
        return key not in DEFAULT_CASES or key in RESUMED_BY_DEFAULT

    @property
    def exit_code(self) -> int:
        return SUPERVISOR_SIGNALS[self.fault] if self.by_supervisor else RANK_FAULTS[self.fault]

    @property
    def fault_rank(self) -> int:
        """Rank 0 writes the checkpoint, so it is the one to fail inside it; elsewhere rank 1 (not the main rank)."""
        return 0 if self.phase == "checkpoint" else 1

    @property
    def injected(self) -> str | None:
        """The injected fault: the case's own kind, or the hang that holds rank 0 inside a save for a signal."""
        if not self.by_supervisor:
            return self.fault
        return "hang" if self.phase == "checkpoint" else None

    @property
    def max_steps(self) -> int:
        return SIGNAL_STEPS if self.by_supervisor and self.phase != "checkpoint" else STEPS

    def fault_message(self) -> str:
        where = "during the checkpoint after step" if self.phase == "checkpoint" else "at step"
        return f"fault injection: {self.injected} {where} {FAULT_STEP[self.phase]} on rank {self.fault_rank}"

    def signal_cue(self) -> re.Pattern[str]:
        """The output line after which the supervisor gets its signal."""
        if self.phase == "first":  # rank 0's banner, written after every rank is set up, just before step 0
            return re.compile(r"^GPU0:INFO \| dataset: cache ", re.M)
        if self.phase == "mid":
            return re.compile(rf"^GPU0:INFO \| \[GPU 0\] Step \[{SIGNAL_AFTER_STEP}/", re.M)
        return re.compile(re.escape(self.fault_message()))

    def allowed_checkpoints(self) -> set[int | None]:
        """The steps the latest checkpoint may be at after the fault (None: there must be none)."""
        if not self.by_supervisor or self.phase == "checkpoint":
            # the last interval checkpoint before the fault's step; in the checkpoint phase the next one was cut short
            return {FAULT_STEP[self.phase] // INTERVAL * INTERVAL or None}
        anywhere = set(range(1, self.max_steps + 1))  # wherever the ranks stopped: a graceful stop saves there
        if self.phase == "first":
            return {None} | anywhere  # the stop may come before step 0 ends: nothing to save
        if self.fault == "SIGKILL":  # no graceful stop: the interval checkpoint before the signal's step
            return {n for n in anywhere if n >= SIGNAL_AFTER_STEP // INTERVAL * INTERVAL}
        return {n for n in anywhere if n > SIGNAL_AFTER_STEP}  # the graceful stop's own checkpoint

    def diagnosis(self) -> str | None:
        """The line that says whose fault it was (the supervisor's own signals have none)."""
        if self.by_supervisor:
            return None
        if self.fault == "gpu_lost":
            return (f"GPU fault: GPU {self.fault_rank} (NVML: lost, its error: RuntimeError: CUDA error: "
                    f"uncorrectable ECC")
        return "program fault, not a GPU's: NVML finds the GPUs as they were at the start"

    def report_pattern(self) -> str:
        if self.fault == "hang":
            return rf"GPU{self.fault_rank} \(rank {self.fault_rank}\) stalled .* by flight recorder\)"
        if self.by_supervisor:
            return rf"run interrupted after .*: interrupted by {self.fault}"
        described = {"raise": "exit 1", "exit": "exit 3", "sigkill": "SIGKILL (137)", "segv": "SIGSEGV (139)",
                     "gpu_lost": "exit 1"}
        return rf"GPU{self.fault_rank} \(rank {self.fault_rank}\) failed: {re.escape(described[self.fault])}"


def cases() -> list[pytest.param]:
    out = []
    for fault in [*RANK_FAULTS, *SUPERVISOR_SIGNALS]:
        for phase in PHASES:
            marks = () if (fault, phase) in DEFAULT_CASES else (pytest.mark.slow,)
            out.append(pytest.param(Case(fault, phase), id=f"{fault}-{phase}", marks=marks))
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Running the supervisor


@dataclass
class Outcome:
    code: int
    output: str  # stdout and stderr merged, as a user sees them
    survivors: list[psutil.Process]
    seen: int  # how many descendants were seen


def flags(case: Case, tmp_path: Path, cache_dir: Path, resume: bool) -> list[str]:
    debug: dict[str, object] = {}
    if case.injected and not resume:
        debug = {"inject_fault": case.injected, "inject_fault_step": FAULT_STEP[case.phase],
                 "inject_fault_rank": case.fault_rank, "inject_fault_code": RANK_FAULTS["exit"],
                 "inject_fault_during": "checkpoint" if case.phase == "checkpoint" else "step"}
    layer = merged(TINY, {"system": {"device": "auto"},  # auto: the fake GPUs are used (their ranks run on CPUs)
                          "data": {"cache_dir": str(cache_dir)}, "training": {"max_steps": case.max_steps},
                          "checkpoint": {"dir": str(tmp_path / "ckpt"), "interval": INTERVAL,
                                         # a mid-run fault comes after a complete checkpoint: saved synchronously, as
                                         # one written in the background may still be in flight when a rank dies
                                         # (that case: tests/test_checkpoint_async.py)
                                         "async_save": "auto" if case.phase != "mid" else False},
                          "debug": debug})
    hang = case.fault == "hang" and not resume
    hang_timeout = HANG_TIMEOUT if hang else SAFETY_TIMEOUT
    startup_timeout = HANG_FIRST_STARTUP_TIMEOUT if hang and case.phase in ("first", "checkpoint") else SAFETY_TIMEOUT
    return ["--debug", "--no-footer", "--nproc", "2", "--log-dir", str(tmp_path / "logs"),
            "--hang-timeout", str(hang_timeout), "--startup-timeout", str(startup_timeout),
            "--grace-period", str(GRACE), *set_flags(layer), *(["--resume", "auto"] if resume else [])]


def wait_for(pattern: re.Pattern[str], log: Path, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not pattern.search(log.read_text(errors="replace")):
        assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before {pattern.pattern!r}:\n" \
                                    f"{log.read_text(errors='replace')[-3000:]}"
        assert time.monotonic() < deadline, f"no {pattern.pattern!r} within {timeout} s"
        time.sleep(0.02)


def run_supervisor(argv: list[str], tmp_path: Path, log_name: str, env: dict[str, str],
                   during: Callable[[subprocess.Popen[bytes], Path], None] | None = None) -> Outcome:
    """`python -m supervisor ARGV` to its end, its output merged into `log_name`; `during` acts on the run while it
    goes (a signal, a disk that fills up, a rank frozen)."""
    log = tmp_path / log_name
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "supervisor", *argv], cwd=tmp_path, env=env, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    with watching(proc) as tree:
        if during is not None:
            during(proc, log)
        code = proc.wait(RUN_TIMEOUT)
        tree.stop()
        return Outcome(code, log.read_text(errors="replace"), tree.survivors(timeout=5.0), len(tree.seen))


def supervise(case: Case, tmp_path: Path, cache_dir: Path, resume: bool = False) -> Outcome:
    """One run of the case to its end; the supervisor's signal, if the case has one, sent once its cue shows up."""
    def signal_at_cue(proc: subprocess.Popen[bytes], log: Path) -> None:
        wait_for(case.signal_cue(), log, proc, RUN_TIMEOUT)
        proc.send_signal(getattr(signal, case.fault))

    state = tmp_path / "gpu_state.json"  # the fake NVML state: healthy until gpu_lost marks a GPU lost
    if not state.exists():
        state.write_text("{}")
    return run_supervisor(flags(case, tmp_path, cache_dir, resume), tmp_path, "resume.txt" if resume else "run.txt",
                          clean_env(SUPERVISOR_FAKE_GPUS="0,1", SUPERVISOR_FAKE_GPU_STATE=str(state)),
                          signal_at_cue if case.by_supervisor and not resume else None)


# ---------------------------------------------------------------------------------------------------------------------
# Checks


def latest_loadable(root: Path) -> int | None:
    """The latest checkpoint's step, after checking every published one is complete and the latest loads."""
    published = sorted(p for p in root.glob(f"{layout.STEP_PREFIX}*") if p.is_dir())
    assert published == layout.list_checkpoints(root), "a published checkpoint is incomplete"
    latest = layout.latest_checkpoint(root)
    if latest is None:
        return None
    state = checkpoint_content(latest)
    step = layout.step_of(latest)
    assert state["meta"]["step"] == step and state["model"] and state["optimizer"]["state"]
    return step


def check_checkpoints(case: Case, root: Path) -> int | None:
    latest = latest_loadable(root)
    assert latest in case.allowed_checkpoints(), f"latest checkpoint at step {latest}"
    if case.phase == "checkpoint":  # the save that was cut short: written in part, never published
        cut = layout.step_path(root, FAULT_STEP["checkpoint"] + 1)
        assert (cut.with_name(layout.TMP_PREFIX + cut.name) / store.STATE_FILE).is_file()
        assert not cut.exists()
    return latest


@pytest.mark.parametrize("case", cases())
def test_fault(case: Case, tmp_path: Path, token_cache_dir: Path) -> None:
    run = supervise(case, tmp_path, token_cache_dir)
    out = run.output
    assert run.code == case.exit_code, out[-4000:]
    assert run.seen >= 3, "the ranks and the sentinel were never seen"
    assert run.survivors == [], f"left running: {[(p.pid, p.cmdline()) for p in run.survivors]}"
    if case.injected:
        assert case.fault_message() in out
    if case.fault != "SIGKILL":
        assert re.search(case.report_pattern(), out), out[-4000:]
        for rank in (0, 1):  # the report's table names both devices
            assert re.search(rf"^supervisor:\s+GPU{rank}\s+{rank}\s+\d+\s", out, re.M), out[-4000:]
        assert f"exit code {case.exit_code}; logs in" in out
    if (diagnosis := case.diagnosis()) is not None:
        assert f"supervisor: {diagnosis}" in out, out[-4000:]
    latest = check_checkpoints(case, tmp_path / "ckpt")

    if not case.resumes:
        return
    again = supervise(case, tmp_path, token_cache_dir, resume=True)
    assert again.code == 0, again.output[-4000:]
    assert again.survivors == []
    root = tmp_path / "ckpt"
    if latest is None:
        assert f"no checkpoint in {root}; starting from step 0" in again.output
    else:
        assert f"resumed from {layout.step_path(root, latest)} at step {latest}" in again.output, \
            again.output[-4000:]
    assert "run finished in" in again.output and f"step {case.max_steps}/{case.max_steps}" in again.output
    assert latest_loadable(root) == case.max_steps
    assert not list(root.glob(f"{layout.TMP_PREFIX}*"))  # the next saves cleared what the cut one left


# ---------------------------------------------------------------------------------------------------------------------
# Faults of the machine: a rank frozen, a disk that fills up, a checkpoint damaged on disk. Plain CPU ranks (CPU0,
# CPU1). Where the test must act between two moments of the run, rank 0 sleeps before every step from SLOW_FROM on
# (debug.inject_fault=slow), so that the act lands before the next checkpoint. Each costs a run or two of 15 to 30 s
# on two cores: all are slow tests. The default suite covers their parts: the culprit rule on recorded evidence
# (tests/test_diagnosis.py), a damaged checkpoint and a full folder refused at the start (tests/test_bad_inputs.py),
# the passing over of a damaged checkpoint and a failed history write (tests/test_checkpoint.py, test_metrics.py).

SLOW_FROM, SLOW_S = 3, 0.4


def machine_flags(tmp_path: Path, cache_dir: Path, *extra: str, **sections: dict[str, object]) -> list[str]:
    layer = merged(merged(TINY, {"data": {"cache_dir": str(cache_dir)}, "training": {"max_steps": STEPS},
                                 "checkpoint": {"dir": str(tmp_path / "ckpt"), "interval": INTERVAL}}), sections)
    return ["--debug", "--no-footer", "--nproc", "2", "--log-dir", str(tmp_path / "logs"), "--grace-period",
            str(GRACE), *set_flags(layer), *extra]


SLOW = {"inject_fault": "slow", "inject_fault_step": SLOW_FROM, "inject_fault_delay_s": SLOW_S}


def step_line(step: int) -> re.Pattern[str]:
    return re.compile(rf"^CPU0:INFO \| \[GPU 0\] Step \[{step}/", re.M)


def assert_ended_cleanly(run: Outcome, code: int) -> None:
    assert run.code == code, run.output[-4000:]
    assert "Traceback" not in run.output, run.output[-4000:]
    assert run.survivors == [], f"left running: {[(p.pid, p.cmdline()) for p in run.survivors]}"


@pytest.mark.slow
def test_a_frozen_rank_is_blamed(tmp_path: Path, token_cache_dir: Path) -> None:
    """Rank 1 stops dead (SIGSTOP: a debugger, swap, a driver hang): it answers neither SIGUSR1 nor the flight
    recorder while rank 0 waits for it in a collective, and the headline names it."""
    def freeze_rank_1(proc: subprocess.Popen[bytes], log: Path) -> None:
        wait_for(step_line(3), log, proc, RUN_TIMEOUT)
        (rank1,) = [p for p in psutil.Process(proc.pid).children() if p.environ().get("RANK") == "1"]
        rank1.suspend()

    # no checkpoint (its phase has the start-up allowance): the frozen step is caught by the short hang allowance, and
    # start-up keeps a long one, for ranks importing torch on a busy machine
    argv = machine_flags(tmp_path, token_cache_dir, "--hang-timeout", str(HANG_TIMEOUT), "--startup-timeout",
                         str(SAFETY_TIMEOUT), training={"max_steps": 2000}, checkpoint={"interval": 0})
    run = run_supervisor(argv, tmp_path, "run.txt", clean_env(), freeze_rank_1)
    assert_ended_cleanly(run, RANK_FAULTS["hang"])
    assert re.search(r"^supervisor: CPU1 \(rank 1\) stalled at step \d+ and answered neither the stack request nor the "
                     r"flight recorder \(stopped, or stuck outside Python\); CPU0 \(rank 0\) waits for it in .* "
                     r"\(no progress for [\d.]+ s; by silence\)$", run.output, re.M), run.output[-4000:]


@pytest.mark.slow
def test_a_full_checkpoint_disk_is_named_and_the_earlier_checkpoints_stay(tmp_path: Path,
                                                                          token_cache_dir: Path) -> None:
    with small_disk(tmp_path / "ckpt", "8m") as ckpt:
        def fill_after_the_first_checkpoint(proc: subprocess.Popen[bytes], log: Path) -> None:
            wait_for(re.compile(r"checkpoint saved: \S+step_000002 ", re.M), log, proc, RUN_TIMEOUT)
            fill(ckpt)

        run = run_supervisor(machine_flags(tmp_path, token_cache_dir, debug=SLOW), tmp_path, "run.txt", clean_env(),
                             fill_after_the_first_checkpoint)
        assert_ended_cleanly(run, 2)
        assert re.search(rf"^CPU0:error: cannot write checkpoint {ckpt}/step_000004: No space left on device in "
                         rf"{ckpt} \(\d[\d,]* bytes free\); free space there, or set checkpoint.dir", run.output,
                         re.M), run.output[-4000:]
        assert latest_loadable(ckpt) == INTERVAL  # the earlier checkpoint intact
        assert not list(ckpt.glob(f"{layout.TMP_PREFIX}*"))  # the partial save removed


@pytest.mark.slow
def test_a_full_log_disk_does_not_fail_a_finished_run(tmp_path: Path, token_cache_dir: Path) -> None:
    with small_disk(tmp_path / "logs", "8m") as logs:
        def fill_mid_run(proc: subprocess.Popen[bytes], log: Path) -> None:
            wait_for(step_line(SLOW_FROM - 1), log, proc, RUN_TIMEOUT)
            fill(logs)

        run = run_supervisor(machine_flags(tmp_path, token_cache_dir, debug=SLOW, logging={"plot": True}), tmp_path,
                             "run.txt", clean_env(), fill_mid_run)
        assert_ended_cleanly(run, 0)
        run_dir = next(p for p in logs.iterdir() if p.is_dir())
        assert re.search(rf"^CPU0:WARNING \| cannot write {run_dir}/training_history.json \(No space left on device\); "
                         rf"left out \(the checkpoints are not affected\)$", run.output, re.M), run.output[-4000:]
        assert "run finished in" in run.output
    assert latest_loadable(tmp_path / "ckpt") == STEPS


@pytest.mark.slow
def test_a_damaged_latest_checkpoint_is_passed_over_for_the_newest_intact_one(tmp_path: Path,
                                                                              token_cache_dir: Path) -> None:
    root = tmp_path / "ckpt"
    first = run_supervisor(machine_flags(tmp_path, token_cache_dir, checkpoint={"keep": 3}), tmp_path, "run.txt",
                           clean_env())
    assert_ended_cleanly(first, 0)
    state = layout.step_path(root, STEPS) / store.STATE_FILE
    state.write_bytes(state.read_bytes()[:state.stat().st_size // 2])  # a copy cut short
    again = run_supervisor(machine_flags(tmp_path, token_cache_dir, "--resume", "auto",
                                         training={"max_steps": STEPS + INTERVAL}), tmp_path, "resume.txt",
                           clean_env())
    assert_ended_cleanly(again, 0)
    intact = layout.step_path(root, STEPS - INTERVAL)
    assert f"supervisor: --resume: {state} is not a torch.save archive, or one cut short" in again.output
    # said once, by the supervisor before any rank starts; rank 0 (under the supervisor) does not repeat it
    assert again.output.count(f"resuming from {intact}, the newest intact checkpoint") == 1, again.output[-4000:]
    assert f"resumed from {intact} at step {STEPS - INTERVAL}" in again.output
    assert latest_loadable(root) == STEPS + INTERVAL
