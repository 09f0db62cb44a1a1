"""`training.num_workers`: data-loading worker processes serve exactly the batches the rank would read itself, from any
resume step; they shrug off stop signals meant for the rank, and end with it, whether it finishes, raises or is told
to stop (SIGTERM to its whole process group)."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import time
import uuid
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

from rank_support import (
    MAIN,
    PYTHON,
    TINY,
    base_env,
    history,
    history_losses,
    kill_on_exit,
    merged,
    set_flags,
    tiny_config,
)
from trainer import loop
from trainer.data.batches import BatchSampler, StepLoader

WORKER_NAME = "pt_data_worker"  # the name torch gives its DataLoader worker processes
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@pytest.fixture
def sampler(tmp_path: Path) -> BatchSampler:
    """A rank's sampler over a memory-mapped token file, as the trainer builds it (rank 1 of 2, 2 micro-steps)."""
    path = tmp_path / "tokens.bin"
    np.random.default_rng(0).integers(0, 5000, 200_000).astype("<u2").tofile(path)
    tokens = np.memmap(path, dtype="<u2", mode="r")
    return BatchSampler(tokens, context_length=16, micro_batch_size=3, grad_accum=2, world_size=2, rank=1, seed=5)


def workers_of(pid: int) -> list[psutil.Process]:
    """The worker processes under `pid`, by their command line (a spawned worker takes WORKER_NAME only once its
    interpreter has started)."""
    return [p for p in psutil.Process(pid).children(recursive=True) if "spawn_main" in " ".join(p.cmdline())]


def blocked_signals(pid: int) -> set[int]:
    mask = next(int(line.split()[1], 16) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                if line.startswith("SigBlk:"))
    return {sig for sig in range(1, 65) if mask >> (sig - 1) & 1}


def test_workers_serve_exactly_the_inline_batches_ignore_stop_signals_and_end_on_close(
        sampler: BatchSampler) -> None:
    """A loader resumed at step 7 with 2 workers: the same batches as reading in this process, step for step, even
    after the workers were sent SIGINT and SIGTERM (blocked from birth); a step out of order restarts the stream
    there; closing, mid-stream both times, ends every worker with exit code 0 (a worker stopped while still sending
    a batch could abort: StepLoader's docstring, "Closing mid-stream")."""
    assert len(pickle.dumps(sampler)) < 4096  # the memmap travels as its file name, not its 400 KB of tokens
    inline = StepLoader(sampler, end_step=40)
    loader = StepLoader(sampler, end_step=40, num_workers=2)
    try:
        for step in range(7, 13):
            got = loader.get(step)
            assert got.shape == (2, 3, 17) and got.dtype == torch.int64
            assert torch.equal(got, inline.get(step))
            assert torch.equal(got, torch.from_numpy(np.stack([sampler.get(step, m) for m in range(2)])))
        workers = workers_of(os.getpid())
        assert len(workers) == 2
        for worker in workers:
            assert set(STOP_SIGNALS) <= blocked_signals(worker.pid)
            for sig in STOP_SIGNALS:
                worker.send_signal(sig)  # what a Ctrl-C or `kill -TERM -<pgid>` does to the whole group
        time.sleep(0.3)
        assert all(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers)
        for step in range(13, 19):
            assert torch.equal(loader.get(step), inline.get(step))
        closed = list(loader.iterator._workers)  # the multiprocessing.Process objects, which keep the exit code
        assert torch.equal(loader.get(3), inline.get(3))  # out of order: a new stream from step 3
        assert torch.equal(loader.get(4), inline.get(4))
        workers += workers_of(os.getpid())
        closed += loader.iterator._workers
    finally:
        loader.close()
    assert [w.exitcode for w in closed] == [0, 0, 0, 0]
    gone, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive and not workers_of(os.getpid())
    assert inline.loader is None  # 0 workers: nothing was ever started
    loader.close()  # idempotent


def test_a_run_that_raises_stops_its_workers(tmp_path: Path, token_cache_dir: Path, one_thread: None) -> None:
    cfg = tiny_config(tmp_path, token_cache_dir, training={"num_workers": 1, "max_steps": 6},
                      debug={"inject_fault": "raise", "inject_fault_step": 3})
    with pytest.raises(RuntimeError, match="injected fault at step 3"):
        loop.train(cfg)
    assert not workers_of(os.getpid())
    assert sorted(history_losses(Path(cfg.logging.run_dir))) == [0, 1, 2]


@pytest.mark.slow
def test_closing_mid_stream_never_aborts_a_worker(tmp_path: Path) -> None:
    """30 closes, each 3 steps into a stream of 0.5 MB steps with 2 workers: every worker exits with code 0. Before
    close() took the batches in flight, about one worker exit in 16 aborted (a feeder thread still sending), so this
    run of 60 would have caught it 98 times in 100. About 2 minutes on 2 cores."""
    path = tmp_path / "tokens.bin"
    np.random.default_rng(0).integers(0, 5000, 4_000_000).astype("<u2").tofile(path)
    sampler = BatchSampler(np.memmap(path, dtype="<u2", mode="r"), context_length=2048, micro_batch_size=8,
                           grad_accum=4, world_size=1, rank=0, seed=5)
    loader = StepLoader(sampler, end_step=1000, num_workers=2)
    exit_codes = []
    try:
        for n in range(30):
            for step in range(10 * n, 10 * n + 3):
                loader.get(step)
            workers = list(loader.iterator._workers)
            loader.close()
            exit_codes += [w.exitcode for w in workers]
    finally:
        loader.close()
    assert exit_codes == [0] * 60


# ---------------------------------------------------------------------------------------------------------------------
# Real ranks, started by hand


STEPS = 100_000  # never reached: both runs are stopped a few steps in (the length sets the LR schedule)


def start_rank(tmp_path: Path, cache_dir: Path, name: str, workers: int, token: str) -> subprocess.Popen:
    """`python pretrain_main.py --debug --set ...` in a session of its own (so its process group can be signalled),
    its environment marked with `token` (every process it starts inherits the mark)."""
    layer = merged(TINY, {"data": {"cache_dir": str(cache_dir)},
                          "training": {"num_workers": workers, "max_steps": STEPS},
                          "checkpoint": {"dir": str(tmp_path / name / "ckpt")},
                          "logging": {"run_dir": str(tmp_path / name / "run")}})
    return subprocess.Popen([PYTHON, MAIN, "--debug", *set_flags(layer)], cwd=tmp_path,
                            env=base_env(DATALOADER_TEST_TOKEN=token), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def read_until_step(proc: subprocess.Popen, step: int, names: dict[int, str]) -> None:
    """Read the rank's log until its line for `step`, noting every process it has started meanwhile."""
    assert proc.stdout is not None
    for line in proc.stdout:
        for process in psutil.Process(proc.pid).children(recursive=True):
            try:
                names[process.pid] = process.name()  # the latest: a spawned worker renames itself
            except psutil.NoSuchProcess:
                continue
        if f"Step [{step}/" in line:
            return
    raise AssertionError(f"the rank exited before step {step} ({proc.wait()}): {proc.stderr.read()[-3000:]}")


def marked(token: str) -> list[psutil.Process]:
    """Every process whose environment carries `token`: whatever a rank started, even once re-parented."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get("DATALOADER_TEST_TOKEN") == token:
                found.append(process)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found


def test_rank_with_a_worker_trains_like_inline_survives_a_group_sigterm_and_leaves_nothing(
        tmp_path: Path, token_cache_dir: Path) -> None:
    """Two runs side by side, num_workers=1 and num_workers=0. The first is stopped by SIGTERM to its whole process
    group (its workers get it too and must not die of it): it checkpoints and exits 0, and once it has exited none
    of its processes remains. The second is then stopped past the same step: the losses are equal step for step."""
    from trainer.data.cache import prepare

    prepare(tiny_config(tmp_path / "prepare", token_cache_dir), show_progress=False)  # before the runs race for it
    token = uuid.uuid4().hex
    ahead = start_rank(tmp_path, token_cache_dir, "ahead", 1, token)
    inline = start_rank(tmp_path, token_cache_dir, "inline", 0, uuid.uuid4().hex)
    names: dict[int, str] = {}  # what the run with a worker started: pid -> name
    with kill_on_exit(ahead, inline):
        read_until_step(ahead, 5, names)
        os.killpg(ahead.pid, signal.SIGTERM)  # as `kill -TERM -<pgid>` or a batch scheduler would
        out, err = ahead.communicate(timeout=120)
        assert ahead.returncode == 0, err[-3000:]
        stop_step = max(history_losses(tmp_path / "ahead" / "run"))
        read_until_step(inline, stop_step + 1, {})
        inline.send_signal(signal.SIGTERM)
        _, inline_err = inline.communicate(timeout=120)
        assert inline.returncode == 0, inline_err[-3000:]

    assert list(names.values()).count(WORKER_NAME) == 1, names  # num_workers=1 took effect
    assert "stopping after step" in out and history(tmp_path / "ahead" / "run")["run"]["status"] == "stopped"
    assert (tmp_path / "ahead" / "ckpt" / f"step_{stop_step + 1:06d}").is_dir()
    got = history_losses(tmp_path / "ahead" / "run")
    expected = history_losses(tmp_path / "inline" / "run")
    assert sorted(got) == list(range(stop_step + 1)) and stop_step >= 5
    assert all(got[s] == expected[s] for s in got)  # bit-identical to reading in the rank

    deadline = time.monotonic() + 10
    while (left := marked(token)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, [p.cmdline() for p in left]
