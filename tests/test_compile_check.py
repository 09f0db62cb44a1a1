"""A compile that fails cannot strand a run (trainer.compile_check), with a real failure: inductor's CPU kernels are
C++ that it compiles at the first forward, and a rank whose C++ compiler does not exist fails there as a node without
one does (`CXX=/nonexistent`; its own, fresh inductor cache, so nothing compiled earlier hides the compiler's absence).

* in this process, a model of two compiled blocks whose compiler is not there: `auto` goes back to eager with one
  warning and trains, `true` raises the UserError (a few seconds: the default tier);
* slow: two CPU ranks through the real loop where only rank 0 fails (rank 1 compiles with dynamo's `eager` backend,
  which needs no compiler), `auto` having chosen compiled layers as on a GPU: both go back to eager, rank 0 alone
  logs one warning naming rank 0 and the cause, both train their steps; and by hand, `system.compile=true` on such a
  node: one `error:` line, exit 2;
* what every rank makes of the ranks' outcomes (`verdict`), and what counts as the compiler's failure.
"""

from __future__ import annotations

import json
import logging
import os
import re
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

    from trainer.loop import Trainer
    from trainer.metrics import EtaClock, Throughput
    from trainer.model.build import compile_layers, decoder_layers
    from trainer.model.distributed import StopRequest, StopVote, init_distributed, teardown
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


@pytest.mark.slow
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


class Block(torch.nn.Module):
    """A decoder layer's stand-in: its element-wise tail is a C++ kernel for inductor on a CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(self.proj(x)) * 1.375


class Stack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("setting", ["auto", True])
def test_a_compiler_that_is_not_there_on_a_rank(setting: bool | str, tmp_path: Path, token_cache_dir: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """In this process, on a one-member group: inductor asked to build its C++ kernels with a compiler that does not
    exist (what CXX=/nonexistent sets) fails inside the first forward; `check` goes back to eager with one warning
    (auto) or stops with the UserError (true)."""
    import torch._inductor.config as inductor

    from trainer.compile_check import check
    from trainer.model.build import compile_layers
    from trainer.model.distributed import init_distributed, teardown

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GPU_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    cfg = tiny_config(tmp_path, token_cache_dir, system={"compile": setting})
    model = Stack()
    compile_layers(model)
    log, warnings = logging.getLogger("compile-check-test"), Warnings()
    log.addHandler(warnings)
    ctx = init_distributed(cfg)
    try:
        with inductor.patch({"cpp.cxx": (None, "/nonexistent"), "fx_graph_cache": False}):
            if setting is True:
                with pytest.raises(UserError, match=re.escape(f"torch.compile failed on CPU0 (rank 0): {CAUSE}")):
                    check(lambda: model(torch.randn(4, 8, requires_grad=True)).sum().backward(), cfg, ctx, model, log)
                return
            assert not check(lambda: model(torch.randn(4, 8, requires_grad=True)).sum().backward(), cfg, ctx, model,
                             log)
        assert all(layer._compiled_call_impl is None for layer in model.layers)
        model(torch.randn(4, 8)).sum().backward()  # eager now, with no compiler
        [warning] = warnings.lines
        assert warning.startswith(f"torch.compile failed on CPU0 (rank 0): {CAUSE}"), warning
    finally:
        teardown()
        log.removeHandler(warnings)
        torch.compiler.reset()


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
