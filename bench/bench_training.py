"""Training throughput of the real rank against a minimal hand-written DDP loop, side by side in one run.

Both sides train the same small Llama on 2 CPU ranks (gloo, one thread each) from the same token cache with the same
batches (BatchSampler, same seed), with AdamW (fused), gradient clipping and the warm-up + cosine schedule:
  * rank:    `pretrain_main.py --run-config` exactly as the supervisor starts it (NaN guard, stop agreement, progress
             channel, logging, history; no checkpoint in between, the end-of-run one is outside the timed steps);
  * minimal: the textbook loop (forward, loss, backward, clip, step, schedule) around DistributedDataParallel.
Throughput counts the steps after the first (warm-up) one: the rank's own tokens/s records, the loop's wall clock.
Each round runs the two sides back to back, so a busy machine penalises both alike; the figure is the median over
rounds of the per-round ratio (the medians of each side are printed too).

On a shared machine whole runs drift with the load, so a second measurement interleaves the two inside the same two
processes: blocks of the real loop iteration (`Trainer.iteration`) and of the minimal step take turns, and the
per-block ratios are compared.

    .venv/bin/python bench/bench_training.py [--rounds 3] [--steps 200]

Target: rank / minimal >= 0.97.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trainer.config import Config  # noqa: E402

WORLD = 2
LOG_INTERVAL = 20
MODEL = {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "ffn_hidden_size": 344,
         "max_position_embeddings": 256}


def bench_config(folder: Path, cache_dir: Path, steps: int) -> Config:
    return Config.from_dict({
        "preset": "bench",
        "system": {"device": "cpu", "dist_timeout_s": 300.0},
        "model": MODEL,
        "data": {"source": "stdlib", "vocab_size": 2048, "context_length": 128, "max_samples": 100,
                 "val_fraction": 0.01, "cache_dir": str(cache_dir)},
        "training": {"max_steps": steps, "batch_size": 8, "grad_accum_nums": 1, "learning_rate": 1e-3,
                     "warmup_steps": 5, "use_amp": False, "precision": "fp32", "strategy": "ddp",
                     "eval_interval": 0},
        "checkpoint": {"dir": str(folder / "ckpt"), "interval": 0, "save_final": False},
        "logging": {"log_interval": LOG_INTERVAL, "run_dir": str(folder)},
        "debug": {"nan_localize": False, "nan_dump": False},
    })


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(command: list[str], cwd: Path) -> list[subprocess.CompletedProcess]:
    """Start WORLD processes with torchrun's variables (as the supervisor does) and wait for all of them."""
    port = free_port()
    procs = []
    for rank in range(WORLD):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD),
               "LOCAL_WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        procs.append(subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=900)
        if proc.returncode != 0:
            for other in procs:
                other.kill()
            raise SystemExit(f"{' '.join(command)} failed ({proc.returncode}):\n{err[-3000:]}")
        results.append(subprocess.CompletedProcess(command, 0, out, err))
    return results


def rank_tokens_per_s(folder: Path, cfg: Config) -> float:
    """The real rank, from rank 0's training_history.json: tokens over time for every interval after step 0."""
    config = folder / "config.json"
    cfg.save(config)
    launch([sys.executable, str(ROOT / "pretrain_main.py"), "--run-config", str(config)], cwd=folder)
    records = json.loads((folder / "training_history.json").read_text())["steps"]
    tokens = seconds = 0.0
    for before, after in zip(records, records[1:]):
        steps = after["step"] - before["step"]
        tokens += steps * cfg.training.batch_size * cfg.data.context_length * WORLD
        seconds += steps * cfg.training.batch_size * cfg.data.context_length * WORLD / after["tokens_per_s"]
    return tokens / seconds


def minimal_tokens_per_s(folder: Path, cfg: Config) -> float:
    config = folder / "config.json"
    cfg.save(config)
    results = launch([sys.executable, __file__, "--minimal", str(config)], cwd=folder)
    return float(json.loads(results[0].stdout.strip().splitlines()[-1])["tokens_per_s"])


class MinimalDDP:
    """The hand-written reference: plain DDP training of the same model on the same batches (one rank)."""

    def __init__(self, cfg: Config) -> None:
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel
        from transformers import LlamaConfig, LlamaForCausalLM, get_cosine_with_min_lr_schedule_with_warmup

        from trainer.data.batches import BatchSampler
        from trainer.data.cache import TokenCache, prepare

        t, m = cfg.training, cfg.model
        self.cfg = cfg
        cache = TokenCache.open(prepare(cfg, show_progress=False).path)
        torch.manual_seed(cfg.system.seed)
        self.model = LlamaForCausalLM(LlamaConfig(
            vocab_size=cache.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size,
            num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads,
            max_position_embeddings=m.max_position_embeddings, use_cache=False, attn_implementation="sdpa"))
        self.ddp = DistributedDataParallel(self.model)
        decay = [p for p in self.model.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.model.parameters() if p.ndim < 2]
        self.optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                                            {"params": no_decay, "weight_decay": 0.0}],
                                           lr=t.learning_rate, betas=(t.beta1, t.beta2), fused=True)
        self.scheduler = get_cosine_with_min_lr_schedule_with_warmup(self.optimizer, t.warmup_steps, t.max_steps,
                                                                     min_lr_rate=t.min_lr_ratio)
        self.sampler = BatchSampler(cache.train, cfg.data.context_length, t.batch_size, 1, dist.get_world_size(),
                                    dist.get_rank(), cfg.system.seed)

    def step(self, step: int) -> float:
        import torch
        import torch.nn.functional as F

        batch = torch.from_numpy(self.sampler.get(step, 0))
        logits = self.ddp(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.training.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss)


def minimal_loop(config_path: str) -> None:
    """One rank of the minimal side of the end-to-end comparison."""
    import torch.distributed as dist

    cfg = Config.load(config_path)
    dist.init_process_group("gloo")
    reference = MinimalDDP(cfg)
    started = 0.0
    for step in range(cfg.training.max_steps):
        if step == 1:  # the first step is warm-up, as on the rank's side
            dist.barrier()
            started = time.perf_counter()
        reference.step(step)
    dist.barrier()
    elapsed = time.perf_counter() - started
    t = cfg.training
    tokens = (t.max_steps - 1) * t.batch_size * cfg.data.context_length * dist.get_world_size()
    if dist.get_rank() == 0:
        print(json.dumps({"tokens_per_s": tokens / elapsed}))
    dist.destroy_process_group()


def interleaved(config_path: str, blocks: int, block_steps: int) -> None:
    """One rank of the interleaved comparison: the real loop's iteration (`Trainer.iteration`: step, NaN guard,
    stop vote, progress, ETA) and the minimal step take turns in blocks inside the same two processes, so both see the
    same machine at the same moments."""
    import torch.distributed as dist

    from trainer.loop import Trainer
    from trainer.metrics import EtaClock, Throughput
    from trainer.model.distributed import StopRequest, StopVote, init_distributed, teardown
    from trainer.progress import ProgressReporter

    cfg = Config.load(config_path)
    ctx = init_distributed(cfg)
    trainer = Trainer(cfg, ctx, Path(config_path).parent, ProgressReporter(fd=None), StopRequest())
    reference = MinimalDDP(cfg)
    vote = StopVote(ctx)
    eta = EtaClock(0, cfg.training.max_steps, time.perf_counter())
    throughput = Throughput(trainer.tokens_per_step, 0, time.perf_counter())
    sides = {"rank": lambda s: trainer.iteration(s, vote, eta, throughput), "minimal": reference.step}
    for side in sides.values():  # warm-up
        side(0)
    times: dict[str, list[float]] = {name: [] for name in sides}
    for block in range(blocks):
        for name, run in sides.items():
            first = 1 + block * block_steps
            dist.barrier()
            started = time.perf_counter()
            for step in range(first, first + block_steps):
                run(step)
            dist.barrier()
            times[name].append(time.perf_counter() - started)
    if ctx.is_main:
        print(json.dumps(times))
    teardown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--blocks", type=int, default=8, help="interleaved blocks per side")
    parser.add_argument("--block-steps", type=int, default=15, help="steps per interleaved block")
    parser.add_argument("--minimal", metavar="CONFIG", help=argparse.SUPPRESS)  # internal: one minimal-loop rank
    parser.add_argument("--interleaved", metavar="CONFIG", help=argparse.SUPPRESS)  # internal: one interleaved rank
    args = parser.parse_args()
    if args.minimal:
        minimal_loop(args.minimal)
        return
    if args.interleaved:
        interleaved(args.interleaved, args.blocks, args.block_steps)
        return
    with tempfile.TemporaryDirectory(prefix="bench-training-") as tmp:
        root = Path(tmp)
        cache_dir = root / "cache"
        from trainer.data.cache import prepare

        prepare(bench_config(root, cache_dir, args.steps), show_progress=False)  # build once, outside the timing
        results: dict[str, list[float]] = {"minimal": [], "rank": []}
        for r in range(args.rounds):
            for side, measure in (("minimal", minimal_tokens_per_s), ("rank", rank_tokens_per_s)):
                folder = root / f"{side}-{r}"
                folder.mkdir()
                results[side].append(measure(folder, bench_config(folder, cache_dir, args.steps)))
                print(f"round {r + 1}/{args.rounds} {side:>7}: {results[side][-1]:10,.0f} tokens/s", flush=True)
        folder = root / "interleaved"
        folder.mkdir()
        steps = 1 + args.blocks * args.block_steps
        config = folder / "config.json"
        bench_config(folder, cache_dir, steps).save(config)
        out = launch([sys.executable, __file__, "--interleaved", str(config), "--blocks", str(args.blocks),
                      "--block-steps", str(args.block_steps)], cwd=folder)
        blocks = json.loads(out[0].stdout.strip().splitlines()[-1])
    minimal, rank = (statistics.median(results[k]) for k in ("minimal", "rank"))
    ratios = [r / m for r, m in zip(results["rank"], results["minimal"])]
    m = MODEL
    print(f"\nmodel: Llama {m['num_layers']} layers, hidden {m['hidden_size']}, context 128, batch 8 per rank; "
          f"{WORLD} CPU ranks (gloo, 1 thread each); {args.steps} steps, {args.rounds} rounds")
    print(f"minimal DDP loop : {minimal:10,.0f} tokens/s (median)")
    print(f"pretrain_main.py : {rank:10,.0f} tokens/s (median)")
    print(f"ratio            : {statistics.median(ratios):10.3f}  (median of per-round ratios "
          f"{', '.join(f'{r:.3f}' for r in ratios)}; target >= 0.97)")
    block_ratios = [m / r for r, m in zip(blocks["rank"], blocks["minimal"])]
    tokens = args.block_steps * 8 * 128 * WORLD
    print(f"\ninterleaved in the same 2 processes ({args.blocks} blocks of {args.block_steps} steps per side):")
    print(f"minimal DDP step : {tokens / statistics.median(blocks['minimal']):10,.0f} tokens/s (median block)")
    print(f"Trainer.iteration: {tokens / statistics.median(blocks['rank']):10,.0f} tokens/s (median block)")
    print(f"ratio            : {statistics.median(block_ratios):10.3f}  (median of per-block ratios; target >= 0.97)")


if __name__ == "__main__":
    main()
