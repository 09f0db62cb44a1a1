"""NaN hunting to the root, what it costs: the in-run recompute (`training.nan_recompute`) and the loss-spike detector
(`training.spike_threshold`), against the same training without them, side by side in one run.

    python bench/bench_nan_root.py [--steps 60] [--runs 2]

In one process (a CPU rank's step, one thread): three identical tiny-Llama trainers (same seed, same batches) take
turns step by step in rotating order: the production NaN guard alone ("off"), with the parameters kept for a
recompute ("recompute", `KeptParameters.keep` every step, as trainer/loop.py calls it), and with the spike detector
judging every step's loss at the log steps ("spikes"). Printed: the median step and the median of the per-step
differences to "off", the kept copy's bytes against the training state's (parameters, gradients, AdamW's two
moments), and the time of one recompute (swap, forward and backward, swap back) against a step: the time per NaN.

On 2 CPU ranks under the supervisor (the debug preset, production checks, 120 steps): the same three settings, each run
`--runs` times in rotating order; the training's own tokens/s (`training_history.json`, median over the log steps),
every run's shown: on a shared machine the spread between runs is larger than either cost.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from bench_nan_guard import BATCH, SEQ, VOCAB, bench_model  # noqa: E402  (beside this file)

from trainer.config import Config  # noqa: E402
from trainer.diagnosis.nan_guard import NanGuard  # noqa: E402
from trainer.diagnosis.recompute import KeptParameters  # noqa: E402
from trainer.diagnosis.spikes import SpikeDetector  # noqa: E402

MODES = ("off", "recompute", "spikes")
SETTINGS = {"off": [], "recompute": ["--set", "training.nan_recompute=true"],
            "spikes": ["--set", "training.spike_threshold=6", "--set", "training.spike_window=8"]}


@dataclass
class Runner:
    """One model, fused AdamW and the production guard; `mode` adds the kept parameters or the spike detector."""

    mode: str
    log_interval: int
    times: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.model = bench_model()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-4, fused=True)
        cfg = Config()
        cfg.training.spike_threshold = 6.0 if self.mode == "spikes" else 0.0
        folder = Path(tempfile.mkdtemp(prefix="bench_nan_root_"))
        self.guard = NanGuard(self.model, cfg, rank=0, world_size=1, gpu_id="0", device=torch.device("cpu"),
                              run_dir=folder / "run", checkpoint_dir=folder / "ckpt")
        self.kept = KeptParameters(self.params) if self.mode == "recompute" else None
        self.spikes = SpikeDetector(6.0, 50) if self.mode == "spikes" else None

    def forward_backward(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        loss = self.model(input_ids=batch, labels=batch).loss
        loss.backward()
        return loss.detach(), torch.nn.utils.clip_grad_norm_(self.params, 1.0)

    def step(self, step: int, batch: torch.Tensor) -> None:
        start = time.perf_counter()
        self.guard.start_step(step, batch)
        loss, grad_norm = self.forward_backward(batch)
        found_inf = self.guard.check(loss, grad_norm)
        if self.kept is not None:
            self.kept.keep(found_inf, step)
        self.guard.step_optimizer(self.optimizer, found_inf)
        self.optimizer.zero_grad(set_to_none=True)
        self.guard.after_step(step, loss, grad_norm, found_inf, lambda path: None)
        if step % self.log_interval == 0:  # the loop's log step: it reads these on the host anyway
            loss.item(), grad_norm.item()
            self.guard.on_log(step)
            if self.spikes is not None:
                for at, value in self.guard.take_losses():
                    self.spikes.observe(at, value)
        self.times.append(time.perf_counter() - start)

    def recompute(self, batch: torch.Tensor) -> float:
        """Seconds of one recompute as the loop runs it: the kept parameters swapped in, forward and backward, the
        gradients dropped, the live parameters back."""
        assert self.kept is not None
        start = time.perf_counter()
        with self.kept.swapped():
            loss, grad_norm = self.forward_backward(batch)
            float(loss.item()), float(grad_norm.item())
        self.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    def state_bytes(self) -> int:
        """The training state: parameters, gradients and AdamW's two moments (4 bytes each in fp32)."""
        return sum(p.numel() * p.element_size() for p in self.params) * 4


def in_process(steps: int, log_interval: int) -> list[str]:
    runners = {mode: Runner(mode, log_interval) for mode in MODES}
    generator = torch.Generator().manual_seed(1)
    for step in range(steps + log_interval):  # the first log interval warms up
        batch = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
        order = MODES[step % 3:] + MODES[:step % 3]
        for mode in order:
            runners[mode].step(step, batch)
    for r in runners.values():
        del r.times[:log_interval]
    off = runners["off"]
    base = statistics.median(off.times)
    keeper = runners["recompute"]
    redo = [keeper.recompute(torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)) for _ in range(10)]
    lines = [f"one process: tiny Llama (hidden 256, 4 layers, vocab {VOCAB}), batch {BATCH}x{SEQ}, 1 thread, {steps} "
             f"steps in rotating order, log every {log_interval}",
             f"{'configuration':<14}{'median step ms':>16}{'vs off':>9}{'median of per-step differences':>34}"]
    for mode, r in runners.items():
        median = statistics.median(r.times)
        differences = statistics.median(a - b for a, b in zip(r.times, off.times))
        lines.append(f"{mode:<14}{median * 1e3:>16.2f}{median / base - 1:>+9.2%}"
                     f"{differences * 1e6:>+24.0f} us ({differences / base:+.2%})")
    kept, state = keeper.kept.nbytes, keeper.state_bytes()
    lines.append(f"recompute memory: the kept parameters, {kept / 2**20:.1f} MiB = {kept / state:.0%} of the training "
                 f"state ({state / 2**20:.1f} MiB: parameters, gradients, AdamW's moments), 4 bytes a parameter")
    lines.append(f"recompute time per NaN: {statistics.median(redo) * 1e3:.1f} ms median of 10 = "
                 f"{statistics.median(redo) / base:.2f}x the median step (forward and backward, no optimizer)")
    keep, judge = calls_alone(keeper, runners["spikes"], log_interval)
    lines.append(f"timed alone, best of 200 (a shared machine only adds time): keep() {keep * 1e6:.0f} us a step = "
                 f"{keep / base:.2%} of the median step; the spike detector's {log_interval} losses at a log step "
                 f"{judge * 1e6:.0f} us = {judge / log_interval / base:.4%} a step")
    return lines


def calls_alone(keeper: Runner, judge: Runner, log_interval: int) -> tuple[float, float]:
    """Seconds of `KeptParameters.keep` on a finite step, and of the spike detector judging one log interval's
    losses; the fastest of 200 each."""
    assert keeper.kept is not None and judge.spikes is not None
    finite = torch.zeros(())
    keeps, judged = [], []
    for n in range(200):
        start = time.perf_counter()
        keeper.kept.keep(finite, n)
        keeps.append(time.perf_counter() - start)
        start = time.perf_counter()
        for at in range(log_interval):
            judge.spikes.observe(at, 5.0 + 0.01 * (at % 3))
        judged.append(time.perf_counter() - start)
    return min(keeps), min(judged)


def tokens_per_s(run: Path) -> float:
    steps = json.loads((run / "training_history.json").read_text())["steps"]
    return statistics.median(s["tokens_per_s"] for s in steps if s["tokens_per_s"])


def supervised(runs: int) -> list[str]:
    folder = Path(tempfile.mkdtemp(prefix="bench_nan_root_"))
    rates: dict[str, list[float]] = {mode: [] for mode in MODES}
    for n in range(runs):
        for mode in MODES[n % 3:] + MODES[:n % 3]:
            logs = folder / f"{mode}-{n}"
            cmd = [sys.executable, "-m", "supervisor", "--debug", "--nproc", "2", "--no-footer", "--log-dir",
                   str(logs), "--max-steps", "120", "--set", "debug.nan_localize=false", "--set",
                   "debug.nan_dump=false", "--set", "logging.log_interval=5", "--set", "logging.plot=false",
                   "--set", "checkpoint.save_final=false", "--set", f"checkpoint.dir={folder / 'ckpt' / mode}-{n}",
                   *SETTINGS[mode]]
            done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout[-3000:]}")
            rates[mode].append(tokens_per_s(next(logs.iterdir())))
    base = statistics.median(rates["off"])
    lines = [f"2 CPU ranks under the supervisor: the debug preset (887k parameters), production checks, 120 steps, "
             f"{runs} run(s) of each in rotating order",
             f"{'configuration':<14}{'tokens/s (median of runs)':>27}{'vs off':>9}   each run"]
    for mode, values in rates.items():
        lines.append(f"{mode:<14}{statistics.median(values):>27,.0f}{statistics.median(values) / base:>9.3f}   "
                     + ", ".join(f"{v:,.0f}" for v in values))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="timed steps per configuration, in one process")
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--runs", type=int, default=2, help="supervised runs per configuration")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for line in [*in_process(args.steps, args.log_interval), "", *supervised(args.runs)]:
        print(line, flush=True)


if __name__ == "__main__":
    main()
