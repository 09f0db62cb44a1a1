"""What a rank reports about training: the log line, throughput and MFU, the history file and plot, TensorBoard.

The log line format is a contract (users grep it):
    INFO | [GPU 3] Step [120/1000] | Loss: 3.2145 | LR: 3.00e-04 | Grad Norm: 0.8123 | ETA: 0:14:02
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import threading
from contextlib import suppress
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

LOGGER_NAME = "trainer"
HISTORY_JSON = "training_history.json"
HISTORY_PNG = "training_history.png"
HISTORY_JOURNAL = "training_history.jsonl"
TENSORBOARD_DIR = "tensorboard"

# Dense bf16 tensor-core peaks (FLOP/s) from the vendor data sheets; the first substring found in the device name wins.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("A100", 312e12),
)


class StdoutHandler(logging.StreamHandler):
    """Writes each record to whatever `sys.stdout` is at that moment (so a redirect or a capture is followed)."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)
        self.setFormatter(logging.Formatter("%(levelname)s | %(message)s"))

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stdout

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def get_logger(level: str = "INFO") -> logging.Logger:
    """The rank's logger: `<LEVEL> | message` on stdout, which the supervisor prefixes with the device label."""
    logger = logging.getLogger(LOGGER_NAME)
    if not any(isinstance(h, StdoutHandler) for h in logger.handlers):
        logger.addHandler(StdoutHandler())
        logger.propagate = False
    logger.setLevel(level)
    return logger


def format_eta(seconds: float) -> str:
    """h:mm:ss, hours unbounded (a 30-hour run says 30:00:00)."""
    total = int(round(seconds)) if math.isfinite(seconds) and seconds > 0 else 0
    return f"{total // 3600}:{total % 3600 // 60:02d}:{total % 60:02d}"


def step_line(gpu_id: str, step: int, total: int, loss: float, lr: float, grad_norm: float, eta_s: float) -> str:
    """The per-rank step report, without the level prefix (the logger adds it)."""
    return (f"[GPU {gpu_id}] Step [{step}/{total}] | Loss: {loss:.4f} | LR: {lr:.2e} | Grad Norm: {grad_norm:.4f} | "
            f"ETA: {format_eta(eta_s)}")


def peak_memory(device: torch.device) -> tuple[int, int] | None:
    """(the caching allocator's peak reservation since start, the GPU's total memory) in bytes; None off CUDA.
    Reserved rather than allocated: it is what has to fit, the allocator's fragmentation included."""
    if device.type != "cuda":
        return None
    import torch  # a CUDA rank has it loaded; the rest of this module is read without torch (benchmarks, tests)

    return torch.cuda.max_memory_reserved(device), torch.cuda.get_device_properties(device).total_memory


def memory_part(peak_bytes: int, total_bytes: int) -> str:
    """The log line's memory field: `mem 41.2 GiB (52 %)` of the GPU's total."""
    return f"mem {peak_bytes / 1024**3:.1f} GiB ({100 * peak_bytes / total_bytes:.0f} %)"


def peak_flops(device_name: str) -> float | None:
    """The bf16 peak of a known GPU, None for anything else (no MFU is shown then)."""
    for key, flops in PEAK_BF16_FLOPS:
        if key in device_name:
            return flops
    return None


def mfu(tokens_per_s: float, flops_per_token: int, world_size: int, device_name: str) -> float | None:
    """Model FLOPs utilisation over the whole job: achieved training FLOP/s over the GPUs' summed peak."""
    peak = peak_flops(device_name)
    if peak is None:
        return None
    return tokens_per_s * flops_per_token / (peak * world_size)


class EtaClock:
    """Remaining time from the average step time. The first step (warm-up, allocator, first collectives) is slow, so
    once a second step has finished it is left out of the average."""

    def __init__(self, start_step: int, total: int, now: float) -> None:
        self.total = total
        self.start_step, self.start_time = start_step, now
        self.first_done: tuple[int, float] | None = None  # (steps done, time) when the first step finished

    def update(self, steps_done: int, now: float) -> float:
        """`steps_done` = optimizer steps completed so far; returns seconds left."""
        if self.first_done is None:
            self.first_done = (steps_done, now)
        base_step, base_time = self.first_done
        if steps_done <= base_step:
            base_step, base_time = self.start_step, self.start_time
        per_step = (now - base_time) / max(1, steps_done - base_step)
        return per_step * (self.total - steps_done)


class Throughput:
    """Tokens per second over the interval since the previous report."""

    def __init__(self, tokens_per_step: int, step: int, now: float) -> None:
        self.tokens_per_step = tokens_per_step
        self.step, self.time = step, now

    def update(self, steps_done: int, now: float) -> float | None:
        steps, elapsed = steps_done - self.step, now - self.time
        self.step, self.time = steps_done, now
        return steps * self.tokens_per_step / elapsed if steps > 0 and elapsed > 0 else None


@dataclass
class StepRecord:
    step: int
    loss: float | None = None  # averaged over ranks
    lr: float | None = None
    grad_norm: float | None = None
    tokens_per_s: float | None = None
    val_loss: float | None = None
    peak_mem_gib: float | None = None  # the allocator's peak reservation on this GPU (rank 0's), GiB; None on CPUs


class Journal:
    """The history as it happens: one JSON line per step record, loss spike and published checkpoint, appended to
    `training_history.jsonl` the moment it is made, and one where each group resumed. training_history.json is
    written when a group of ranks ends; a rank 0 killed outright (SIGKILL, the OOM killer, the supervisor's SIGKILL of
    a rank held in a collective by a dead peer) never writes it, and the next group of the run
    (`History.continue_from`) and a replay (`recorded`) read the journal back instead, so no fault costs the run its
    curve. Each line is one ``os.write`` on a descriptor opened with O_APPEND (the checkpoint writer's thread appends
    too); a line cut short by a crash is skipped when read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: int | None = None
        self.broken = False  # a write failed (a full disk): said once, then the journal is left
        self.lock = threading.Lock()  # the training thread and the checkpoint writer's

    def append(self, kind: str, entry: dict[str, Any]) -> None:
        line = json.dumps({"kind": kind, **entry}, separators=(",", ":"), allow_nan=True) + "\n"
        with self.lock:
            if self.broken:
                return
            try:
                if self.fd is None:
                    self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                os.write(self.fd, line.encode())
            except OSError as e:
                self.broken = True
                History.cannot_write(self.path, e)

    def read(self) -> list[dict[str, Any]]:
        """Every whole entry written so far, oldest first; none when there is no journal (or it cannot be read)."""
        try:
            text = self.path.read_text(errors="replace")
        except OSError:
            return []
        entries = []
        for line in text.splitlines():
            with suppress(ValueError):
                entry = json.loads(line)
                if isinstance(entry, dict) and isinstance(entry.get("kind"), str):
                    entries.append(entry)
        return entries

    def close(self) -> None:
        with self.lock:
            if self.fd is not None:
                with suppress(OSError):
                    os.close(self.fd)
                self.fd = None


@dataclass
class Recorded:
    """What a run folder's groups recorded (`recorded`): step records by step, spikes, published checkpoints."""

    steps: dict[int, dict[str, Any]]
    spikes: list[dict[str, Any]]
    checkpoints: list[dict[str, Any]]


def recorded(run_dir: Path, before: int | None = None) -> Recorded:
    """What the groups of the run in `run_dir` recorded, from its journal (`Journal`), else from its
    training_history.json (a folder without a journal). Each group journals where it resumed: what the groups before
    it made from there on belongs to a trajectory it replaced (a step trained again after a restart or a rollback; a
    run started anew in the folder, from step 0). `before`: a group about to resume at that step (the same cut)."""
    entries = Journal(run_dir / HISTORY_JOURNAL).read() or saved_entries(run_dir)
    if before is not None:
        entries.append({"kind": "group", "from": before})
    steps: dict[int, dict[str, Any]] = {}
    spikes: list[dict[str, Any]] = []
    checkpoints: list[dict[str, Any]] = []
    for entry in entries:
        body = {k: v for k, v in entry.items() if k != "kind"}
        with suppress(KeyError, TypeError, ValueError):
            if entry["kind"] == "group":
                start = int(body["from"])
                steps = {s: r for s, r in steps.items() if s < start}
                # a spike the resumed state already holds the outcome of (a rollback: its checkpoint is older)
                spikes = [s for s in spikes if s.get("resumed_from", s["step"]) < start]
                checkpoints = [c for c in checkpoints if c["step"] <= start]
            elif entry["kind"] == "step":
                steps[int(body["step"])] = body
            elif entry["kind"] == "spike" and isinstance(body.get("step"), int) and body not in spikes:
                spikes.append(body)
            elif entry["kind"] == "checkpoint" and isinstance(body.get("step"), int):
                checkpoints.append(body)
    return Recorded(steps, spikes, checkpoints)


def saved_entries(run_dir: Path) -> list[dict[str, Any]]:
    """training_history.json's steps and spikes as journal entries (a run folder that kept no journal)."""
    try:
        saved = json.loads((run_dir / HISTORY_JSON).read_text())
        return [{"kind": "step", **r} for r in saved["steps"]] + \
            [{"kind": "spike", **s} for s in saved.get("spikes", [])]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []  # none (a resume into a new folder) or unreadable


class History:
    """Rank 0's record of the run: `training_history.json`, an optional `training_history.png`, optional TensorBoard
    scalars and the same scalars to an optional W&B run (`trainer.wandb_run.start_wandb`).

    `checkpoints`: the checkpoint writer's records (dataclasses: step, size, how long training was blocked, how long
    the write took), a list it appends to as each save is published, kept in the JSON under "checkpoints";
    `resume_load_s`: how long loading the checkpoint resumed from took, in the JSON's "run" (a resumed run only);
    `spikes`: each loss spike and what it did (a rollback: the step it went back to, the batches it skipped)."""

    def __init__(self, run_dir: Path, run_info: dict[str, Any], tensorboard: bool = False, plot: bool = True,
                 wandb_run: Any = None, checkpoints: list[Any] | None = None,
                 resume_load_s: float | None = None) -> None:
        self.run_dir = run_dir
        self.run_info = run_info if resume_load_s is None else {**run_info, "resume_load_s": resume_load_s}
        self.checkpoints = [] if checkpoints is None else checkpoints
        self.writes_plot = plot
        self.records: list[StepRecord] = []
        self.spikes: list[dict[str, Any]] = []  # the loss spikes and what each did (`trainer.diagnosis.spikes`)
        self.earlier_checkpoints: list[dict[str, Any]] = []  # published by the run's earlier groups
        self.journal = Journal(run_dir / HISTORY_JOURNAL)
        self.wandb_run = wandb_run
        self.status = "running"
        self.writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(run_dir / TENSORBOARD_DIR))

    def continue_from(self, step: int) -> None:
        """A group restarted in the same run folder (the supervisor's --max-restarts) resumes at `step`: keep the
        records before it, the spikes and the checkpoints the earlier groups recorded (`recorded`), so that
        training_history.json and its plot show the run's whole curve, not the last group's part of it; and journal
        that this group resumed there."""
        earlier = recorded(self.run_dir, step)
        self.journal.append("group", {"from": step})
        with suppress(TypeError):  # a record of fields this release does not know: this group's records only
            self.records = [StepRecord(**earlier.steps[s]) for s in sorted(earlier.steps)] + self.records
        self.spikes = earlier.spikes + self.spikes
        self.earlier_checkpoints = earlier.checkpoints

    def rewind(self, step: int) -> None:
        """A rollback to the checkpoint at `step`: the records from it on belong to a trajectory the run left."""
        self.records = [r for r in self.records if r.step < step]

    def add(self, record: StepRecord) -> None:
        self.records.append(record)
        self.journal.append("step", asdict(record))
        scalars = {f"train/{name}" if name != "val_loss" else "val/loss": value
                   for name, value in asdict(record).items() if name != "step" and value is not None}
        if self.writer is not None:
            for tag, value in scalars.items():
                self.writer.add_scalar(tag, value, record.step)
        if self.wandb_run is not None:
            self.wandb_run.log(scalars, step=record.step)

    def spike(self, record: dict[str, Any]) -> None:
        """A loss spike and what it did."""
        self.spikes.append(record)
        self.journal.append("spike", record)

    def published(self, record: Any) -> None:
        """A checkpoint published (a `SaveRecord`, appended to `checkpoints` by its writer), journaled."""
        self.journal.append("checkpoint", asdict(record))

    def save(self, status: str, plot: bool = True) -> None:
        """Write the JSON and the plot if asked for (atomically; called at the end and when the run fails; `plot`
        False leaves the plot to a later save). What cannot be written (a full disk) is a warning: the run's result is
        its checkpoints and final model, and a finished run does not fail for want of its history."""
        self.status = status
        data = {"run": {**self.run_info, "status": status}, "steps": [asdict(r) for r in self.records],
                "checkpoints": self.earlier_checkpoints + [asdict(r) for r in list(self.checkpoints)],
                "spikes": self.spikes}
        tmp = self.run_dir / (HISTORY_JSON + ".tmp")
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(data, indent=1, allow_nan=True) + "\n")
            tmp.replace(self.run_dir / HISTORY_JSON)
        except OSError as e:
            with suppress(OSError):  # a folder gone or a file in its way: no temporary file either
                tmp.unlink(missing_ok=True)
            self.cannot_write(self.run_dir / HISTORY_JSON, e)
        if self.writes_plot and plot:
            try:
                self.plot(self.run_dir / HISTORY_PNG)
            except Exception as e:  # whatever matplotlib raises on a write that fails: the plot is a convenience
                self.cannot_write(self.run_dir / HISTORY_PNG, e)
        if self.writer is not None:
            try:
                self.writer.flush()
            except OSError as e:
                self.cannot_write(self.run_dir / TENSORBOARD_DIR, e)

    @staticmethod
    def cannot_write(path: Path, error: Exception) -> None:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else f"{type(error).__name__}: {error}"
        logging.getLogger(LOGGER_NAME).warning(f"cannot write {path} ({reason}); left out (the checkpoints are not "
                                               f"affected)")

    def close(self) -> None:
        self.journal.close()
        if self.writer is not None:
            self.writer.close()
        if self.wandb_run is not None:  # a stopped run (SIGTERM, checkpointed) ended as asked: not a W&B failure
            self.wandb_run.finish(exit_code=0 if self.status in ("completed", "stopped") else 1)

    def plot(self, path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(2, 2, figsize=(11, 7))
        panels = [("loss", "loss"), ("lr", "learning rate"), ("grad_norm", "gradient norm (pre-clip)"),
                  ("tokens_per_s", "tokens/s")]
        for ax, (key, title) in zip(axes.flat, panels):
            points = [(r.step, getattr(r, key)) for r in self.records if getattr(r, key) is not None]
            if points:
                ax.plot(*zip(*points), label="train" if key == "loss" else None)
            if key == "loss":
                val = [(r.step, r.val_loss) for r in self.records if r.val_loss is not None]
                if val:
                    ax.plot(*zip(*val), marker="o", label="validation")
                if points or val:  # a run that trained no step (its checkpoint was at the end) has nothing to label
                    ax.legend()
            ax.set_title(title)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        fig.suptitle(f"{self.run_info.get('run_dir', '')}  {self.run_info.get('preset', '')}".strip())
        fig.tight_layout()
        tmp = path.with_name(path.name + ".tmp.png")
        try:
            fig.savefig(tmp, dpi=100)
            tmp.replace(path)
        finally:
            plt.close(fig)
            with suppress(OSError):  # a folder gone or a file in its way: no temporary file either
                tmp.unlink(missing_ok=True)
