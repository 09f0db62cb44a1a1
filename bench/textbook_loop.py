"""The textbook single-GPU training loop `bench_gpu.py` measures the rank against, and the line of the reference script.

Two ways to get the loop's figures: the loop written here (transformers `LlamaForCausalLM` with SDPA, bf16 autocast,
fused AdamW, clipping, gradient accumulation, random tokens), run as a child process so that each run has its own
memory and compile cache:

    python bench/textbook_loop.py '{"layers": 16, "hidden": 2048, ...}' 1 [--smoke]   # shape fields, compile 0/1

prints one JSON line (tokens/s, peak bytes, device); or the reference script `gpu_textbook_loop.py` given to
`bench_gpu.py --anchor`, whose last line `parse_anchor_line` reads.
"""

from __future__ import annotations

import json
import re
import sys
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any


def plain_loop(shape: Any, compiled: bool, smoke: bool) -> dict[str, object]:
    """The textbook single-device loop on random tokens; tokens/s over the steps after `shape.warmup`. `shape` has
    `bench_gpu.Shape`'s fields (layers, hidden, heads, kv_heads, ffn, vocab, context, batch, accum, steps, warmup)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    device = torch.device("cpu" if smoke else "cuda")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.ffn,
                         num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                         num_key_value_heads=shape.kv_heads, max_position_embeddings=shape.context,
                         tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    forward = torch.compile(model) if compiled else model
    tokens = torch.randint(0, shape.vocab, (shape.steps, shape.accum, shape.batch, shape.context), device=device)

    def step(i: int) -> None:
        for micro in tokens[i]:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = forward(input_ids=micro, labels=micro).loss  # transformers shifts the labels itself
            (loss / shape.accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for i in range(shape.warmup):
        step(i)
    synchronize()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    for i in range(shape.warmup, shape.steps):
        step(i)
    synchronize()
    seconds = time.perf_counter() - started
    timed = shape.steps - shape.warmup
    return {"tokens_per_s": timed * shape.accum * shape.batch * shape.context / seconds,
            "peak_bytes": torch.cuda.max_memory_reserved() if device.type == "cuda" else None,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}


# What gpu_textbook_loop.py prints last: `anchor[ compile]: params 1100.0M | 62,800 tokens/s | MFU 44.7% | peak mem
# 44.6 GiB`.
ANCHOR_LINE = re.compile(r"^anchor(?P<compile> compile)?:\s*params\s+(?P<params>[\d.]+)M\s*\|"
                         r"\s*(?P<rate>[\d,.]+)\s+tokens/s\s*\|\s*MFU\s+(?P<mfu>[\d.]+)%\s*\|"
                         r"\s*peak mem\s+(?P<peak>[\d.]+)\s*GiB\s*$", re.M)


@dataclass(frozen=True)
class AnchorFigures:
    compiled: bool
    params_m: float
    tokens_per_s: float
    mfu: float  # a fraction
    peak_gib: float


def parse_anchor_line(output: str) -> AnchorFigures | None:
    """The last figures line in the anchor script's output; None when there is none (it failed before printing)."""
    found = list(ANCHOR_LINE.finditer(output))
    if not found:
        return None
    m = found[-1]
    return AnchorFigures(compiled=m["compile"] is not None, params_m=float(m["params"]),
                         tokens_per_s=float(m["rate"].replace(",", "")), mfu=float(m["mfu"]) / 100,
                         peak_gib=float(m["peak"]))


if __name__ == "__main__":
    print(json.dumps(plain_loop(SimpleNamespace(**json.loads(sys.argv[1])), sys.argv[2] == "1", "--smoke" in sys.argv)))
