"""A compile that fails cannot strand a run (trainer.compile_check), with a real failure: inductor's CPU kernels are
C++ that it compiles at the first forward, and a rank whose C++ compiler does not exist fails there as a node without
one does (`CXX=/nonexistent`; its own, fresh inductor cache, so nothing compiled earlier hides the compiler's absence).

* two CPU ranks where only rank 0 fails (rank 1 compiles with dynamo's `eager` backend, which needs no compiler),
  `system.compile=auto` having chosen compiled layers as it does on a GPU: both go back to eager, rank 0 alone logs
  one warning naming rank 0 and the cause, and both train their steps;
* by hand, `system.compile=true` on such a node: one `error:` line, exit 2 (slow: a whole rank's start-up); what
  every rank makes of the ranks' outcomes (`verdict`), and what counts as the compiler's failure.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch

from rank_support import base_env, run_main, spawn_ranks, tiny_config
from trainer.compile_check import compile_failure, verdict
from trainer.errors import UserError

STEPS = 2
CAUSE = "InvalidCxxCompiler: No working C++ compiler found"


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def worker(rank: int, folder: Path, cache_dir: Path, tokenizer: Path) -> None:
    """Rank 0 has no C++ compiler; rank 1 compiles with dynamo's `eager` backend. Both run the loop's first steps."""
    import torch._inductor.config as inductor

    from trainer.distributed import StopVote, init_distributed, teardown
    from trainer.loop import StopRequest, Trainer
    from trainer.metrics import EtaClock, Throughput
    from trainer.model import compile_layers, decoder_layers
    from trainer.progress import ProgressReporter

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder / f"inductor-{rank}")
    if rank == 0:
        inductor.cpp.cxx = (None, "/nonexistent")  # what CXX=/nonexistent sets when inductor is imported
    cfg = tiny_config(folder, cache_dir, training={"max_steps": STEPS})
    assert cfg.system.compile == "auto"
    ctx = init_distributed(cfg)
    try:
        trainer = Trainer(cfg, ctx, folder / "run", ProgressReporter(fd=None), StopRequest())
        assert not trainer.compiled  # auto never compiles on CPUs: here it chose compiled layers, as on a GPU
        compile_layers(trainer.module)
        trainer.compiled = True
        if rank == 1:
            for layer in decoder_layers(trainer.module):
                layer.compile(backend="eager")
        warnings = Warnings()
        trainer.log.addHandler(warnings)
        vote, now = StopVote(ctx), 0.0
        eta, throughput = EtaClock(0, STEPS, now), Throughput(trainer.tokens_per_step, 0, now)
        for step in range(STEPS):
            trainer.iteration(step, vote, eta, throughput)
        trainer.log.removeHandler(warnings)
        outcome = {"compiled": trainer.compiled, "completed": trainer.completed, "warnings": warnings.lines,
                   "eager": all(layer._compiled_call_impl is None for layer in decoder_layers(trainer.module))}
    finally:
        teardown()
    (folder / f"outcome-{rank}.json").write_text(json.dumps(outcome))


def test_a_compiler_missing_on_one_rank_sends_every_rank_eager(tmp_path: Path, token_cache_dir: Path) -> None:
    spawn_ranks(worker, tmp_path, token_cache_dir)
    outcomes = [json.loads((tmp_path / f"outcome-{rank}.json").read_text()) for rank in (0, 1)]
    for outcome in outcomes:
        assert {k: outcome[k] for k in ("compiled", "completed", "eager")} == {
            "compiled": False, "completed": STEPS, "eager": True}, outcome
    assert outcomes[1]["warnings"] == []
    [warning] = outcomes[0]["warnings"]
    assert warning.startswith(f"torch.compile failed on CPU0 (rank 0): {CAUSE}"), warning
    assert "every rank trains eager instead (system.compile=auto" in warning


def test_true_stops_every_rank_alike_and_auto_warns_once() -> None:
    causes = [("GPU0", None), ("GPU1", "CppCompileError: C++ compile error"), ("GPU2", "CppCompileError: again")]
    assert verdict([("GPU0", None), ("GPU1", None)], True) is None
    assert verdict(causes, "auto") == (
        "torch.compile failed on 2 of 3 ranks (first GPU1 (rank 1)): CppCompileError: C++ compile error; every rank "
        "trains eager instead (system.compile=auto; set it to false to skip compiling, or true to stop on such a "
        "failure)")
    with pytest.raises(UserError, match=r"^torch\.compile failed on GPU1 \(rank 1\): CppCompileError: C\+\+ compile "
                                        r"error; make the compiler work on this node .* set system\.compile=auto"):
        verdict(causes[:2], True)


def test_what_counts_as_the_compilers_failure() -> None:
    from torch._dynamo.exc import BackendCompilerFailed
    from torch._inductor.exc import InvalidCxxCompiler

    wrapped = BackendCompilerFailed(lambda: None, InvalidCxxCompiler(), None)
    assert compile_failure(wrapped) == f"InvalidCxxCompiler: {str(InvalidCxxCompiler()).splitlines()[0]}"
    assert compile_failure(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")) is None
    try:
        raise RuntimeError("shapes do not match")  # raised here, not by inductor or Triton
    except RuntimeError as e:
        assert compile_failure(e) is None


@pytest.mark.slow
def test_compile_true_by_hand_without_a_compiler_is_one_error_line(tmp_path: Path, token_cache_dir: Path) -> None:
    cfg = tiny_config(tmp_path, token_cache_dir)
    done = run_main(["--debug", "--max-steps", "2", "--set", "system.compile=true",
                     "--set", f"data.cache_dir={token_cache_dir}", "--set", f"checkpoint.dir={cfg.checkpoint.dir}",
                     "--set", f"logging.run_dir={tmp_path / 'run'}"], tmp_path,
                    env=base_env(CXX="/nonexistent", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor")))
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: torch.compile failed on CPU0 (rank 0): {CAUSE}"), \
        done.stderr[-3000:]
    assert not list(Path(cfg.checkpoint.dir).glob("step_*"))
