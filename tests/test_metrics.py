"""Metrics: the exact log line, ETA and throughput arithmetic, MFU, and the history files."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path

import pytest

from rank_support import LOG_LINE
from trainer.checkpoint.manager import SaveRecord
from trainer.metrics import (
    HISTORY_JOURNAL,
    HISTORY_JSON,
    HISTORY_PNG,
    LOGGER_NAME,
    TENSORBOARD_DIR,
    EtaClock,
    History,
    StepRecord,
    Throughput,
    format_eta,
    memory_part,
    mfu,
    peak_flops,
    step_line,
)


def test_step_line_is_the_contract_format() -> None:
    line = "INFO | " + step_line("3", 120, 1000, 3.21449, 3e-4, 0.81234, 842.4)
    assert line == ("INFO | [GPU 3] Step [120/1000] | Loss: 3.2145 | LR: 3.00e-04 | Grad Norm: 0.8123 | "
                    "ETA: 0:14:02")
    assert LOG_LINE.match(line)
    assert LOG_LINE.match("WARNING | " + step_line("0", 1, 2, float("nan"), 1e-3, float("nan"), 0.0))


def test_eta_format() -> None:
    assert format_eta(5) == "0:00:05"
    assert format_eta(30 * 3600) == "30:00:00"
    assert format_eta(-1) == format_eta(float("nan")) == "0:00:00"


def test_eta_leaves_out_the_slow_first_step() -> None:
    clock = EtaClock(start_step=0, total=10, now=0.0)
    assert clock.update(1, now=5.0) == 5.0 * 9  # only the first step is known so far
    assert clock.update(3, now=7.0) == 1.0 * 7  # 2 steps in 2 s since the first one finished


def test_throughput_over_the_interval() -> None:
    meter = Throughput(tokens_per_step=1000, step=0, now=0.0)
    assert meter.update(10, now=2.0) == 5000.0
    assert meter.update(10, now=3.0) is None


def test_mfu_uses_the_bf16_peak_of_known_gpus() -> None:
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("Tesla T4") is None and mfu(1e5, 10**9, 1, "Tesla T4") is None
    assert mfu(tokens_per_s=8 * 312e12 / 1e9 / 2, flops_per_token=10**9, world_size=8,
               device_name="A100") == 0.5


def test_history_json_png_and_tensorboard(tmp_path: Path) -> None:
    history = History(tmp_path, {"preset": "debug"}, tensorboard=True)
    history.add(StepRecord(step=0, loss=5.0, lr=0.0, grad_norm=1.0, tokens_per_s=None))
    history.add(StepRecord(step=1, loss=4.5, lr=1e-3, grad_norm=0.9, tokens_per_s=1000.0, val_loss=4.7,
                           peak_mem_gib=3.0))
    history.save("completed")
    history.close()
    data = json.loads((tmp_path / HISTORY_JSON).read_text())
    assert data["run"] == {"preset": "debug", "status": "completed"}
    assert data["steps"][1] == {"step": 1, "loss": 4.5, "lr": 1e-3, "grad_norm": 0.9, "tokens_per_s": 1000.0,
                                "val_loss": 4.7, "peak_mem_gib": 3.0}
    assert data["steps"][0]["peak_mem_gib"] is None  # CPU ranks: no GPU memory to report
    assert (tmp_path / HISTORY_PNG).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((tmp_path / TENSORBOARD_DIR).glob("events.out.tfevents.*"))


def test_history_without_the_plot(tmp_path: Path) -> None:
    history = History(tmp_path, {"preset": "debug"}, plot=False)
    history.add(StepRecord(step=0, loss=5.0, lr=0.0, grad_norm=1.0, tokens_per_s=None))
    history.save("completed")
    assert sorted(p.name for p in tmp_path.iterdir()) == [HISTORY_JSON, HISTORY_JOURNAL]


def test_history_that_cannot_be_written_is_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A full disk or a folder gone: the run's end must not fail for its history (the checkpoints are its result)."""
    (tmp_path / "run").write_text("a file where the run folder should be")
    history = History(tmp_path / "run", {"preset": "debug"}, plot=True)
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        for step in range(2):  # the journal's failure is said once
            history.add(StepRecord(step=step, loss=2.0, lr=1e-3, grad_norm=0.5))
        history.save("completed")
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        f"cannot write {tmp_path / 'run' / name}" for name in (HISTORY_JOURNAL, HISTORY_JSON, HISTORY_PNG)]
    assert not list(tmp_path.glob("**/*.tmp*"))


def test_a_restarted_group_continues_the_history_of_its_run_folder(tmp_path: Path) -> None:
    first = History(tmp_path, {"preset": "debug"}, plot=False)
    for step in range(4):  # saved up to step 3; the group that resumes step_000002 runs steps 2 and 3 again
        first.add(StepRecord(step=step, loss=5.0 - step))
    first.save("failed")
    again = History(tmp_path, {"preset": "debug"}, plot=False)
    again.continue_from(2)
    again.add(StepRecord(step=2, loss=2.5))
    again.save("completed")
    assert [(r["step"], r["loss"]) for r in json.loads((tmp_path / HISTORY_JSON).read_text())["steps"]] == [
        (0, 5.0), (1, 4.0), (2, 2.5)]
    fresh = History(tmp_path / "elsewhere", {"preset": "debug"}, plot=False)
    fresh.continue_from(2)  # nothing there to continue
    assert fresh.records == []


def test_a_group_whose_rank_0_was_killed_is_continued_from_its_journal(tmp_path: Path) -> None:
    """The first group never saved training_history.json (rank 0 killed outright): the next group continues from the
    journal, a step's last record winning (steps 2 and 3 again after a rollback to step 2), a line cut short by the
    kill skipped; its spikes and published checkpoints with it. A run started anew in the folder keeps none."""
    first = History(tmp_path, {"preset": "debug"}, plot=False)
    for step in range(4):
        first.add(StepRecord(step=step, loss=5.0 - step))
    first.spike({"step": 3, "loss": 9.0, "mean": 2.0, "std": 0.1, "policy": "rollback", "resumed_from": 2})
    for step in (2, 3):
        first.add(StepRecord(step=step, loss=1.0 - step / 10))
    checkpoint = SaveRecord(step=4, path="ckpt/step_000004", bytes=1, blocked_s=0.0, write_s=0.1, waited_s=0.0,
                            background=True)
    first.published(checkpoint)
    first.add(StepRecord(step=4, loss=0.5))
    first.journal.close()
    with open(tmp_path / HISTORY_JOURNAL, "a") as journal:
        journal.write('{"kind":"step","step":5,"lo')  # the kill, mid-line
    assert not (tmp_path / HISTORY_JSON).exists()
    again = History(tmp_path, {"preset": "debug"}, plot=False)
    again.continue_from(4)  # resumed after four steps (the memory copy): step 4 is trained again
    again.add(StepRecord(step=4, loss=0.4))
    again.save("completed")
    saved = json.loads((tmp_path / HISTORY_JSON).read_text())
    assert [(r["step"], r["loss"]) for r in saved["steps"]] == [(0, 5.0), (1, 4.0), (2, 0.8), (3, 0.7), (4, 0.4)]
    assert [s["step"] for s in saved["spikes"]] == [3]
    assert saved["checkpoints"] == [asdict(checkpoint)]
    anew = History(tmp_path, {"preset": "debug"}, plot=False)
    anew.continue_from(0)  # a run started again from step 0 in the same folder: none of it is kept
    assert anew.records == [] and anew.spikes == [] and anew.earlier_checkpoints == []


def test_memory_field_of_the_summary_line() -> None:
    assert memory_part(int(41.6 * 1024**3), 80 * 1024**3) == "mem 41.6 GiB (52 %)"
