"""The training loop, in this process on a one-member gloo group: accumulation, exact resume, the agreed stop, the
NaN guard's skip, no host reads inside a step, the optimizer groups and the schedule."""

from __future__ import annotations

import math
import os
import re
import signal
from pathlib import Path

import pytest
import torch

from rank_support import history, history_losses, tiny_config
from trainer import loop
from trainer.checkpoint import layout, store
from trainer.config import Config
from trainer.diagnosis.host_sync import HostSyncCounter
from trainer.model import optim
from trainer.model.distributed import StopRequest, init_distributed, teardown
from trainer.progress import ProgressReporter


def final_weights(cfg: Config) -> dict[str, torch.Tensor]:
    latest = layout.latest_checkpoint(Path(cfg.checkpoint.dir))
    assert latest is not None
    return store.load_payload(latest / store.STATE_FILE)["model"]


def test_accumulation_matches_one_big_batch(tmp_path: Path, token_cache_dir: Path, one_thread: None) -> None:
    """2 micro-steps of 2 sequences = 1 step of 4: the sampler hands out the same samples, the loss is averaged."""
    runs = {}
    for accum, batch in ((2, 2), (1, 4)):
        cfg = tiny_config(tmp_path / f"a{accum}", token_cache_dir,
                          training={"grad_accum_nums": accum, "batch_size": batch, "max_steps": 4})
        assert loop.train(cfg) == 0
        runs[accum] = (history_losses(Path(cfg.logging.run_dir)), final_weights(cfg))
    (losses_a, weights_a), (losses_b, weights_b) = runs[2], runs[1]
    assert losses_a.keys() == losses_b.keys() == {0, 1, 2, 3}
    assert all(math.isclose(losses_a[s], losses_b[s], rel_tol=1e-5) for s in losses_a)
    assert all(torch.allclose(weights_a[k], weights_b[k], atol=1e-6) for k in weights_a)


def test_resume_reproduces_the_uninterrupted_losses(tmp_path: Path, token_cache_dir: Path,
                                                    one_thread: None) -> None:
    straight = tiny_config(tmp_path / "straight", token_cache_dir, training={"max_steps": 6},
                           checkpoint={"interval": 3, "keep": 5})
    assert loop.train(straight) == 0
    expected = history_losses(Path(straight.logging.run_dir))
    resumed = tiny_config(tmp_path / "resumed", token_cache_dir, training={"max_steps": 6},
                          checkpoint={"resume": str(Path(straight.checkpoint.dir) / "step_000003")})
    assert loop.train(resumed) == 0
    got = history_losses(Path(resumed.logging.run_dir))
    assert got.keys() == {3, 4, 5}
    assert all(got[s] == expected[s] for s in got)  # bit-identical on CPU


def test_every_checkpointing_policy_gives_the_same_losses(tmp_path: Path, token_cache_dir: Path,
                                                         one_thread: None) -> None:
    """none, selective, full (and the boolean of older configs) recompute the same numbers: bit-identical in fp32."""
    losses = {}
    for policy in ("none", "selective", "full", True):
        cfg = tiny_config(tmp_path / str(policy), token_cache_dir, training={"max_steps": 3},
                          model={"gradient_checkpointing": policy, "num_layers": 2})
        assert loop.train(cfg) == 0
        losses[policy] = history_losses(Path(cfg.logging.run_dir))
    assert len(losses["none"]) == 3
    assert losses["selective"] == losses["full"] == losses[True] == losses["none"]


def test_chunked_loss_trains_like_the_full_loss(tmp_path: Path, token_cache_dir: Path, one_thread: None) -> None:
    """The chunked lm_head + cross-entropy through the whole loop (accumulation, clipping, AdamW): the same losses."""
    losses = {}
    for kind in ("full", "chunked"):
        cfg = tiny_config(tmp_path / kind, token_cache_dir, training={"max_steps": 4, "loss": kind,
                                                                       "grad_accum_nums": 2, "batch_size": 2})
        assert loop.train(cfg) == 0
        losses[kind] = history_losses(Path(cfg.logging.run_dir))
    assert losses["full"].keys() == losses["chunked"].keys() == {0, 1, 2, 3}
    assert all(math.isclose(losses["full"][s], losses["chunked"][s], rel_tol=1e-5) for s in losses["full"])


@pytest.mark.slow
def test_compiled_layers_train_like_eager_ones(tmp_path: Path, token_cache_dir: Path, one_thread: None,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """system.compile=true on a CPU rank (inductor's C++ backend, about a minute): with selective checkpointing and
    the chunked loss inside the compiled run, the same losses as eager, and the log reports the compile time."""
    losses = {}
    for compiled in (False, True):
        cfg = tiny_config(tmp_path / str(compiled), token_cache_dir,
                          system={"compile": compiled}, training={"max_steps": 3, "loss": "chunked"},
                          model={"num_layers": 2, "gradient_checkpointing": "selective"})
        assert loop.train(cfg) == 0
        losses[compiled] = history_losses(Path(cfg.logging.run_dir))
    out = capsys.readouterr().out
    assert "compute: torch.compile each decoder layer | loss chunked | activation checkpointing selective" in out
    assert re.search(r"torch\.compile: the first forward and backward \(step 0\) took [\d.]+ s, -?[\d.]+ s more than "
                     r"a compiled one \(the compilation\)", out), out
    assert all(math.isclose(losses[True][s], losses[False][s], rel_tol=1e-5) for s in losses[False])


def test_a_failing_run_still_writes_its_history(tmp_path: Path, token_cache_dir: Path, one_thread: None) -> None:
    cfg = tiny_config(tmp_path, token_cache_dir, training={"max_steps": 5}, logging={"plot": True},
                      debug={"inject_fault": "raise", "inject_fault_step": 2})
    with pytest.raises(RuntimeError, match="injected fault at step 2"):
        loop.train(cfg)
    record = history(Path(cfg.logging.run_dir))
    assert record["run"]["status"] == "failed" and [r["step"] for r in record["steps"]] == [0, 1]
    assert (Path(cfg.logging.run_dir) / "training_history.png").is_file()


def test_a_passed_over_checkpoint_is_said_by_the_rank_only_without_a_supervisor(
        tmp_path: Path, token_cache_dir: Path, one_thread: None, capsys: pytest.CaptureFixture[str]) -> None:
    """--resume auto past a damaged latest checkpoint: by hand (or under torchrun) rank 0 says so; under a supervisor
    (a progress channel) it does not, as the supervisor said it before starting the ranks."""
    sections = {"training": {"max_steps": 4}, "checkpoint": {"interval": 2, "keep": 3}}
    assert loop.train(tiny_config(tmp_path, token_cache_dir, **sections)) == 0
    resumed = tiny_config(tmp_path, token_cache_dir, **{**sections, "checkpoint": {"interval": 2, "keep": 3,
                                                                                   "resume": "auto"}})
    state = layout.step_path(Path(resumed.checkpoint.dir), 4) / store.STATE_FILE
    intact = state.read_bytes()
    read, write = os.pipe()
    try:
        for progress, said in ((ProgressReporter(fd=write), 0), (ProgressReporter(fd=None), 1)):
            state.write_bytes(intact[:len(intact) // 2])  # cut short; each resume writes step 4 whole again
            capsys.readouterr()
            assert loop.train(resumed, progress=progress) == 0
            out = capsys.readouterr().out
            assert out.count("the newest intact checkpoint") == said, out
            assert f"resumed from {state.parent.with_name('step_000002')} at step 2" in out
    finally:
        os.close(read)
        os.close(write)


class SigtermAt(ProgressReporter):
    """Sends this process a real SIGTERM when the loop reports a given step."""

    def __init__(self, step: int) -> None:
        super().__init__(fd=None)
        self.at = step

    def step(self, step: int, total: int, **record: float | None) -> None:
        if step == self.at:
            signal.raise_signal(signal.SIGTERM)


def test_sigterm_finishes_the_step_saves_and_returns_0(tmp_path: Path, token_cache_dir: Path,
                                                        one_thread: None) -> None:
    """The signal lands after step 1's vote was cast: step 2 still runs (the vote overlaps it), then every rank stops
    and the state after 3 steps is saved."""
    cfg = tiny_config(tmp_path, token_cache_dir, training={"max_steps": 50})
    assert loop.train(cfg, progress=SigtermAt(2)) == 0
    assert [p.name for p in layout.list_checkpoints(Path(cfg.checkpoint.dir))] == ["step_000003"]
    record = history(Path(cfg.logging.run_dir))
    assert record["run"]["status"] == "stopped" and [r["step"] for r in record["steps"]] == [0, 1, 2]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is only installed while training


def test_a_nan_step_is_skipped_and_training_goes_on(tmp_path: Path, token_cache_dir: Path, one_thread: None,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tiny_config(tmp_path, token_cache_dir, training={"max_steps": 4},
                      debug={"inject_nan_module": "model.layers.0.mlp", "inject_nan_step": 1})
    assert loop.train(cfg) == 0
    losses = history_losses(Path(cfg.logging.run_dir))
    assert math.isnan(losses[1]) and all(math.isfinite(losses[s]) for s in (0, 2, 3))
    out = capsys.readouterr().out
    assert "fault injection ON: NaN in model.layers.0.mlp output at step 1 on rank 0" in out
    assert "WARNING | non-finite step 1 skipped" in out


def test_a_step_reads_nothing_back_from_the_device(tmp_path: Path, token_cache_dir: Path, one_thread: None) -> None:
    """Between log steps the step never waits for the device (on a GPU every host read would stall the queue)."""
    cfg = tiny_config(tmp_path, token_cache_dir, training={"max_steps": 10, "grad_accum_nums": 2})
    ctx = init_distributed(cfg)
    try:
        trainer = loop.Trainer(cfg, ctx, tmp_path / "run", ProgressReporter(fd=None), StopRequest())
        trainer.train_step(0)
        with HostSyncCounter() as counter:
            trainer.train_step(1)
        assert counter.count == 0
    finally:
        teardown()


def test_weight_decay_on_matrices_only_and_the_schedule(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, tmp_path, training={"max_steps": 100, "warmup_steps": 10, "learning_rate": 1e-3,
                                                    "min_lr_ratio": 0.1, "weight_decay": 0.1})
    from trainer.model.build import build_model

    model = build_model(cfg, 300, 0, torch.device("cpu"))
    optimizer = optim.build_optimizer(model, cfg)
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and all(p.ndim >= 2 for p in decay["params"])
    assert no_decay["weight_decay"] == 0.0 and no_decay["params"] and all(p.ndim == 1 for p in no_decay["params"])
    assert optimizer.defaults["fused"]
    scheduler = optim.build_scheduler(optimizer, cfg)
    lrs = []
    for _ in range(100):
        lrs.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert lrs[0] == 0.0 and lrs[5] == pytest.approx(5e-4) and lrs[10] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))  # cosine decay
    assert scheduler.get_last_lr()[0] == pytest.approx(1e-4)  # learning_rate · min_lr_ratio at max_steps
    assert optim.resolve_precision(cfg, torch.device("cpu")) == optim.Precision("fp32", None)
