"""The end of a run: what each rank did, why the run ended, and the exit code.

Exit codes: 0 when every rank finished; 2 for a user error; otherwise the code of the rank that failed first
(128 + signal number when a signal killed it); 124 when a rank stalled (the hang watchdog stopped the group, as
``timeout`` reports a command that ran out of time); 130 / 143 / 129 / 138 when the supervisor itself got SIGINT /
SIGTERM / SIGHUP / SIGUSR1; on a multi-node run, the code of the rank that failed first on whichever node it ran. A rank
that ran out of device memory exits with 99 (`trainer.diagnosis.oom_report.OOM_EXIT_CODE`), which the supervisor passes on.

A failing rank of a program under torch's ``@record`` names its root cause in its error file
(`supervisor.diagnosis.error_file`): the report puts its exception, time and traceback right under the headline.
"""

from __future__ import annotations

from pathlib import Path

from supervisor.diagnosis import error_file
from supervisor.diagnosis.gpu_fault import Verdict
from supervisor.gpus.exclusion import EXCLUSIONS_FILE, Exclusion
from supervisor.group.watch import GroupResult
from supervisor.group.worker import describe_exit

TAIL_LINES = 20


def duration(seconds: float) -> str:
    """12.3 s under a minute, else h:mm:ss (the log line's ETA format)."""
    if seconds < 10:
        return f"{seconds:.2f} s"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def rank_table(result: GroupResult) -> list[str]:
    header = ("device", "rank", "pid", "exit", "how it ended", "run time")
    rows = [header]
    for w in result.workers:
        code = describe_exit(w.exit_code if w.exit_code is not None else 0)
        rows.append((w.label, str(w.spec.rank), str(w.pid), code, result.endings.get(w.spec.rank, "finished"),
                     duration(w.run_time())))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return ["  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]


def progress_line(result: GroupResult) -> str | None:
    """Steps and final loss as the lowest rank reported them on the progress channel."""
    if not result.states:
        return None
    state = result.states[min(result.states)]
    if state.event is None:
        return None
    text = f"step {state.step}/{state.total}" if state.total else f"step {state.step}"
    if state.loss is not None:
        text += f", final loss {state.loss:.4f}"
    return text


def exclusion_lines(exclusions: list[Exclusion], run_dir: Path) -> list[str]:
    """The GPUs a fault took out of the run, and the layout each restart went on with."""
    if not exclusions:
        return []
    return [f"GPU exclusions (also in {run_dir / EXCLUSIONS_FILE}):", *(f"  {e.line()}" for e in exclusions)]


def failure_report(result: GroupResult, run_dir: Path, restarts: int, max_restarts: int, total: float,
                   verdict: Verdict | None = None, exclusions: list[Exclusion] | None = None,
                   errors: Path | None = None) -> str:
    """`errors`: the failing rank's TORCHELASTIC_ERROR_FILE (a foreign program's), read for the root cause."""
    stop = result.stop
    assert stop is not None
    verb = {"interrupt": "interrupted", "remote": "stopped", "signal": "stopped"}.get(stop.reason, "failed")
    lines = [f"run {verb} after {duration(total)}: {stop.detail}"]
    if stop.node_verdicts:
        lines.append("what each node's evidence says of its own ranks:")
        lines += [f"  {line}" for line in stop.node_verdicts]
    if errors is not None and (cause := error_file.read(errors)) is not None:
        lines += cause.lines()
    if verdict is not None:
        lines.append(verdict.line())
    if stop.evidence:
        lines.append("stall evidence (flight records and main-thread stacks):")
        lines += [f"  {line}" for line in stop.evidence]
    if max_restarts:
        lines.append(f"restarts: {restarts} of {max_restarts} used")
    lines += exclusion_lines(exclusions or [], run_dir)
    lines += rank_table(result)
    if stop.worker is not None:
        tail = result.tails[stop.worker.spec.rank].tail_lines(TAIL_LINES) if stop.worker.spec.rank in result.tails \
            else []
        if tail:
            lines.append(f"last {len(tail)} stderr lines of {stop.worker.label} (rank {stop.worker.spec.rank}):")
            lines += [f"  | {line}" for line in tail]
        else:
            lines.append(f"{stop.worker.label} wrote nothing to stderr")
    lines += fallout_lines(result, run_dir)
    lines.append(f"exit code {stop.exit_code}; logs in {run_dir}/")
    return "\n".join(lines)


def fallout_lines(result: GroupResult, run_dir: Path) -> list[str]:
    """Where the stderr lines kept off the console went (`supervisor.group.pump.Stream.mute`)."""
    return [f"{w.label} (rank {w.spec.rank}): {count} more stderr line{'s' * (count != 1)} after the failure, "
            f"in {run_dir / w.spec.log_name} only"
            for w in result.workers
            if w.spec.rank in result.tails and (count := result.tails[w.spec.rank].muted_lines)]


def success_report(result: GroupResult, run_dir: Path, restarts: int, max_restarts: int, total: float,
                   exclusions: list[Exclusion] | None = None) -> str:
    text = f"run finished in {duration(total)}"
    progress = progress_line(result)
    text += f": {progress}" if progress else " (no progress reported)"
    if max_restarts:
        text += f"; {restarts} of {max_restarts} restarts used"
    return "\n".join([f"{text}; logs in {run_dir}/", *exclusion_lines(exclusions or [], run_dir)])
