"""Training on a real GPU through the supervisor: each precision, DDP (world size 1) and FSDP2 with gradient
checkpointing resumed mid-run onto the same loss trajectory, torch.compile, the losses that never hold the full logits
against the full one, and the final model generating on the GPU.

Resume tolerance: the resumed run's losses match the uninterrupted run's within TOLERANCE (absolute, bf16). The
checkpoint restores weights, optimizer state, schedule, data position and RNG exactly, but GPU kernels are not
bit-exact from run to run (atomics in the embedding and attention backward sum in a varying order), so the
trajectories may drift by rounding; the trainer sets no deterministic-algorithms mode, which would be the way to make
them bit-exact (`torch.use_deterministic_algorithms(True)` with `CUBLAS_WORKSPACE_CONFIG=:4096:8`).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpu_support import Machine, banner, gpu_layer, supervise
from rank_support import history, history_losses
from trainer.checkpoint import layout, store
from trainer.metrics import peak_flops

pytestmark = pytest.mark.gpu

TOLERANCE = 0.02  # absolute, on losses around 4-6
STEPS, INTERVAL, CUT_AT = 8, 4, 5  # checkpoint after 4 steps; the cut run fails at the start of step 5


def trained(machine: Machine, tmp_path: Path, cache_dir: Path, tag: str = "", *extra: str, **overrides) -> tuple:
    run = supervise(machine, tmp_path, gpu_layer(tmp_path, cache_dir, **overrides), *extra, tag=tag)
    assert run.code == 0, run.output[-4000:]
    assert run.survivors == []
    return run, history_losses(run.run_dir())


def final_state(ckpt: Path) -> dict:
    latest = layout.latest_checkpoint(ckpt)
    return torch.load(latest / store.STATE_FILE, map_location="cpu", weights_only=True)


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32", "auto"])
def test_precision(precision: str, machine: Machine, tmp_path: Path, token_cache_dir: Path) -> None:
    run, losses = trained(machine, tmp_path, token_cache_dir, training={"precision": precision, "max_steps": 4})
    expected = precision
    if precision == "auto":  # bf16 wherever the GPU has it (Ampere and later: Hopper included), else fp16
        expected = "bf16" if machine.capability >= (8, 0) else "fp16"
        if machine.capability[0] == 9:
            assert expected == "bf16"
    assert banner(run, machine, "precision").startswith(f"precision: {expected} | strategy: ddp")
    assert all(math.isfinite(v) for v in losses.values()) and losses[3] < losses[0], losses
    scaler = final_state(tmp_path / "ckpt")["scaler"]
    if expected == "fp16":  # the gradient scaler ran and its state is checkpointed
        assert scaler is not None and scaler["scale"] > 0
    else:
        assert scaler is None
    records = history(run.run_dir())["steps"]
    assert records and all(r["peak_mem_gib"] > 0 for r in records), "the GPU's peak memory is recorded"
    if expected == "bf16" and peak_flops(machine.gpu.name) is not None:
        assert re.search(r"tokens/s \| MFU \d+\.\d% \| mem [\d.]+ GiB \(\d+ %\)$", run.output, re.M), run.output[-3000:]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_resume_continues_the_loss_trajectory(strategy: str, machine: Machine, tmp_path: Path,
                                              token_cache_dir: Path) -> None:
    shape = {"model": {"num_layers": 2, "gradient_checkpointing": strategy == "fsdp"},
             "training": {"strategy": strategy, "max_steps": STEPS}}
    full_ckpt, cut_ckpt = tmp_path / "full", tmp_path / "cut"
    run, full = trained(machine, tmp_path, token_cache_dir, "-full",
                        checkpoint={"dir": str(full_ckpt), "interval": INTERVAL}, **shape)
    expected = f"precision: bf16 | strategy: {strategy} | grad accumulation: 1"
    assert banner(run, machine, "precision").startswith(expected)
    checkpointing = "full" if strategy == "fsdp" else "none"
    assert f"| activation checkpointing {checkpointing} |" in banner(run, machine, "compute")
    assert abs(full[STEPS - 1] - full[0]) > 10 * TOLERANCE, "the trajectory must move for the comparison to mean much"

    layer = gpu_layer(tmp_path, token_cache_dir, checkpoint={"dir": str(cut_ckpt), "interval": INTERVAL},
                      debug={"inject_fault": "raise", "inject_fault_step": CUT_AT}, **shape)
    cut = supervise(machine, tmp_path, layer, tag="-cut")  # (the failing rank lets step 4's write end first)
    assert cut.code == 1, cut.output[-4000:]
    assert layout.latest_checkpoint(cut_ckpt) == layout.step_path(cut_ckpt, INTERVAL)
    meta = json.loads((layout.step_path(cut_ckpt, INTERVAL) / layout.META_FILE).read_text())
    assert meta["format"] == (layout.SHARDED if strategy == "fsdp" else layout.FULL)

    resumed, again = trained(machine, tmp_path, token_cache_dir, "-resumed", "--resume", "auto",
                             checkpoint={"dir": str(cut_ckpt), "interval": INTERVAL}, **shape)
    assert f"resumed from {layout.step_path(cut_ckpt, INTERVAL)} at step {INTERVAL}" in resumed.output
    assert sorted(again) == list(range(INTERVAL, STEPS))
    drift = {step: abs(again[step] - full[step]) for step in again}
    assert max(drift.values()) < TOLERANCE, f"resumed vs uninterrupted loss differences: {drift}"


def test_compiled_model_trains(machine: Machine, tmp_path: Path, token_cache_dir: Path) -> None:
    run, losses = trained(machine, tmp_path, token_cache_dir, system={"device": "cuda", "compile": True},
                          training={"max_steps": 6})
    assert banner(run, machine, "compute").startswith("compute: torch.compile each decoder layer")
    assert all(math.isfinite(v) for v in losses.values()) and losses[5] < losses[0], losses


def importable(machine: Machine, module: str) -> bool:
    return subprocess.run([sys.executable, "-c", f"import {module}"], env=machine.env, capture_output=True,
                          timeout=120).returncode == 0


@pytest.mark.parametrize("loss", ["chunked", "liger"])
def test_a_loss_without_the_full_logits_matches_the_full_loss(loss: str, machine: Machine, tmp_path: Path,
                                                              token_cache_dir: Path) -> None:
    """Step 0 sees the same weights and the same batch, so the loss and the gradient norm of the chunked loss (and of
    liger's fused kernel, where installed) are the full logits' up to bf16 rounding; the banner says which ran."""
    if loss == "liger" and not importable(machine, "liger_kernel"):
        pytest.skip("liger-kernel is not installed in this interpreter (pip install '.[liger]')")
    first = {}
    for kind in ("full", loss):
        run, _ = trained(machine, tmp_path, token_cache_dir, f"-{kind}", training={"loss": kind, "max_steps": 2},
                         checkpoint={"dir": str(tmp_path / f"ckpt-{kind}")})
        assert f"| loss {kind} |" in banner(run, machine, "compute")
        first[kind] = next(r for r in history(run.run_dir())["steps"] if r["step"] == 0)
    assert abs(first[loss]["loss"] - first["full"]["loss"]) < TOLERANCE, first
    assert first[loss]["grad_norm"] == pytest.approx(first["full"]["grad_norm"], rel=0.02), first


GENERATE = """
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).to("cuda").eval()
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
prompt = tokenizer("def main():", return_tensors="pt").to("cuda")
with torch.no_grad():
    out = model.generate(**prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id)
print(json.dumps({"device": str(out.device), "prompt": prompt["input_ids"].shape[1], "total": out.shape[1],
                  "text": tokenizer.decode(out[0])}))
"""


def test_final_model_loads_and_generates_on_the_gpu(machine: Machine, tmp_path: Path, token_cache_dir: Path) -> None:
    run, _ = trained(machine, tmp_path, token_cache_dir, training={"max_steps": 4},
                     checkpoint={"dir": str(tmp_path / "ckpt"), "save_final": True})
    final = tmp_path / "ckpt" / store.FINAL_DIR
    assert f"final model saved: {final}" in run.output
    done = subprocess.run([sys.executable, "-c", GENERATE, str(final)], env=machine.env, capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["device"] == "cuda:0" and result["total"] == result["prompt"] + 8
    assert "main" in result["text"]
