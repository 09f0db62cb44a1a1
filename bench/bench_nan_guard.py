"""The NaN guard's cost on CPU: step time with the production guard on vs off, and host synchronisations per step.

Two identical tiny-Llama trainers (same seed, same batches) take turns step by step — on/off, then off/on, so drift in
a shared machine's speed hits both alike. Printed: both medians, the median of the per-step differences (the steadier
figure on a busy machine), and the guard's own calls timed alone. Each step follows trainer/loop.py's order;
every `--log-interval` steps both do the loop's log-step host reads (loss and grad norm), and the guarded one also
calls `on_log`. Host synchronisations are counted with `trainer.diagnosis.host_sync.HostSyncCounter` (a TorchDispatchMode
counting `aten._local_scalar_dense` — item/bool/float — plus wrapped `Tensor.tolist`/`Tensor.cpu`) around whole steps.
A debug-mode row shows what localisation costs. Single process: the multi-rank guard adds one all-gather of 4 float32
per rank per step (3 flags and the local loss), which this does not time.

    .venv/bin/python bench/bench_nan_guard.py [--steps 60] [--log-interval 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from trainer.config import Config  # noqa: E402
from trainer.diagnosis.host_sync import HostSyncCounter  # noqa: E402
from trainer.diagnosis.nan_guard import NanGuard  # noqa: E402

VOCAB, SEQ, BATCH = 2048, 128, 4


def bench_model() -> LlamaForCausalLM:
    """The model these benchmarks step: 4 Llama layers of 256, seeded, on the CPU."""
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=SEQ)
    return LlamaForCausalLM(config)


@dataclass
class Runner:
    """One model + fused AdamW, stepping with the guard ("production", "debug") or without it ("off")."""

    mode: str
    log_interval: int
    times: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.model = bench_model()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=True)
        cfg = Config()
        cfg.debug.nan_localize = self.mode == "debug"
        folder = Path(tempfile.mkdtemp(prefix="bench_nan_guard_"))
        self.guard = None if self.mode == "off" else NanGuard(
            self.model, cfg, rank=0, world_size=1, gpu_id="0", device=torch.device("cpu"), run_dir=folder / "run",
            checkpoint_dir=folder / "ckpt")

    def step(self, step: int, batch: torch.Tensor) -> None:
        start = time.perf_counter()
        if self.guard:
            self.guard.start_step(step, batch)
        loss = self.model(input_ids=batch, labels=batch).loss
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        if self.guard:
            found_inf = self.guard.check(loss.detach(), grad_norm)
            self.guard.step_optimizer(self.optimizer, found_inf)
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.guard:
            self.guard.after_step(step, loss.detach(), grad_norm, found_inf, lambda path: None)
        if step % self.log_interval == 0:  # the loop's log step: it reads these on the host anyway
            loss.item(), grad_norm.item()
            if self.guard:
                self.guard.on_log(step)
        self.times.append(time.perf_counter() - start)


def guard_call_cost(runner: Runner, repeats: int) -> float:
    """Seconds the guard adds to a step, timed on its own: check() plus step_optimizer() with found_inf = 0 against
    a plain optimizer.step() on the same gradients, interleaved; the fastest of each (a shared machine only ever
    adds time, so the minimum is the cleanest estimate of a few-microsecond difference)."""
    assert runner.guard is not None
    batch = torch.randint(0, VOCAB, (BATCH, SEQ))
    loss = runner.model(input_ids=batch, labels=batch).loss
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(runner.model.parameters(), 1.0)
    guarded, plain = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        runner.guard.step_optimizer(runner.optimizer, runner.guard.check(loss.detach(), grad_norm))
        middle = time.perf_counter()
        runner.optimizer.step()
        plain.append(time.perf_counter() - middle)
        guarded.append(middle - start)
    runner.guard.pending.clear()  # these were not training steps
    runner.optimizer.zero_grad(set_to_none=True)
    return min(guarded) - min(plain)


def syncs_per_step(runner: Runner, steps: int) -> float:
    """Host synchronisations per step over `steps` steps (log steps included)."""
    with HostSyncCounter() as counter:
        for step in range(steps):
            runner.step(step, torch.randint(0, VOCAB, (BATCH, SEQ)))
    return counter.count / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="timed steps per configuration")
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    runners = {mode: Runner(mode, args.log_interval) for mode in ("off", "production", "debug")}
    syncs = {mode: syncs_per_step(r, 2 * args.log_interval) for mode, r in runners.items()}  # also the warm-up
    off, on = runners["off"], runners["production"]
    for r in runners.values():
        r.times.clear()
    generator = torch.Generator().manual_seed(1)
    for step in range(args.steps):
        batch = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
        for r in ((on, off) if step % 2 else (off, on)):
            r.step(step, batch)
    for step in range(max(args.steps // 4, 5)):  # debug mode is far slower: fewer steps, not interleaved
        runners["debug"].step(step, torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator))

    base = statistics.median(off.times)
    cost = guard_call_cost(on, repeats=200)
    print(f"NaN guard on CPU: tiny Llama (hidden 256, 4 layers, vocab {VOCAB}), batch {BATCH}x{SEQ}, "
          f"{args.threads} thread(s), {args.steps} interleaved steps, log every {args.log_interval}")
    print(f"{'configuration':<22}{'median step ms':>16}{'vs off':>10}{'host syncs/step':>18}")
    for mode, r in runners.items():
        median = statistics.median(r.times)
        print(f"{mode:<22}{median * 1e3:>16.2f}{median / base - 1:>+10.2%}{syncs[mode]:>18.2f}")
    pairs = [a - b for a, b in zip(on.times, off.times)]
    print(f"production - off, median of per-step differences: {statistics.median(pairs) * 1e6:+.0f} us "
          f"({statistics.median(pairs) / base:+.2%})")
    print(f"guard calls timed alone (check + step_optimizer vs optimizer.step, best of 200): "
          f"{cost * 1e6:+.0f} us per step = {cost / base:+.3%} of the median step")
    print("host syncs counted with trainer.diagnosis.host_sync.HostSyncCounter (item/bool/float via aten._local_scalar_dense, "
          "Tensor.tolist, Tensor.cpu) over whole steps, log steps included")


if __name__ == "__main__":
    main()
