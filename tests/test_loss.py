"""The training objective (trainer.model.loss): the chunked lm_head + cross-entropy against the full one (values and
gradients, alone and under DDP and FSDP2 on 2 CPU ranks), and which path each setting picks where."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from rank_support import assert_final_model_holds, save_full_params, spawn_ranks, tiny_config
from trainer.checkpoint import store
from trainer.config import Config
from trainer.errors import UserError
from trainer.model.build import build_model, shape_signature
from trainer.model.distributed import init_distributed, is_sharded, teardown, unwrap, wrap_model
from trainer.model.loss import CausalLMLoss, choose_loss, chunked_cross_entropy, liger_installed

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_chunked_cross_entropy_equals_the_full_one() -> None:
    """Uneven chunks (5 tokens of 23), fp32: the same mean loss and the same gradients for hidden and weight."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(23, 16, generator=gen, requires_grad=True)
    weight = torch.randn(50, 16, generator=gen, requires_grad=True)
    targets = torch.randint(0, 50, (23,), generator=gen)
    full = F.cross_entropy(hidden @ weight.t(), targets)
    full_grads = torch.autograd.grad(full, (hidden, weight))
    chunked = chunked_cross_entropy(hidden, weight, targets, chunk_tokens=5)
    chunked_grads = torch.autograd.grad(chunked, (hidden, weight))
    assert torch.allclose(chunked, full, rtol=1e-6, atol=1e-6)
    for got, want in zip(chunked_grads, full_grads):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def fresh(cfg: Config) -> torch.nn.Module:
    torch.manual_seed(cfg.system.seed)
    return build_model(cfg, 300, 0, CPU)


def loss_and_grads(root: torch.nn.Module, model: torch.nn.Module, batch: torch.Tensor) -> tuple[float, torch.Tensor]:
    """The loss of one forward/backward through `root`, and the inner model's gradients as one (gathered) vector."""
    loss = root(batch)
    loss.backward()
    grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in model.parameters()]
    return loss.item(), torch.cat([g.flatten() for g in grads])


def test_the_loss_module_chunked_equals_full(tmp_path: Path, token_cache_dir: Path) -> None:
    cfg = tiny_config(tmp_path, token_cache_dir, model={"num_layers": 2})
    batch = torch.randint(0, 300, (3, 33), generator=torch.Generator().manual_seed(1))
    results = {}
    for kind in ("full", "chunked"):
        model = fresh(cfg)
        results[kind] = loss_and_grads(CausalLMLoss(model, kind), model, batch)
    assert abs(results["full"][0] - results["chunked"][0]) < 1e-5
    assert torch.allclose(results["full"][1], results["chunked"][1], rtol=1e-4, atol=1e-6)


def test_which_loss_each_setting_picks(tmp_path: Path, token_cache_dir: Path) -> None:
    def pick(device: torch.device, **overrides: dict) -> tuple[str, str | None]:
        cfg = tiny_config(tmp_path, token_cache_dir, **overrides)
        choice = choose_loss(cfg, fresh(cfg), device)
        return choice.kind, choice.note

    assert pick(CPU) == ("full", None)  # CPU ranks: unchanged
    assert pick(CPU, training={"loss": "chunked"}) == ("chunked", None)
    assert pick(CUDA)[0] == ("liger" if liger_installed() else "chunked")
    assert pick(CUDA, debug={"nan_localize": True})[0] == "full"  # every module, lm_head included, is traced
    assert pick(CUDA, debug={"inject_nan_module": "lm_head", "inject_nan_step": 1})[0] == "full"
    with pytest.raises(UserError, match="liger needs a CUDA GPU"):
        pick(CPU, training={"loss": "liger"})
    if not liger_installed():
        kind, note = pick(CUDA, training={"loss": "liger"})
        assert kind == "chunked" and "liger-kernel is not installed" in note
    cfg = tiny_config(tmp_path, token_cache_dir, training={"loss": "chunked"})
    biased = fresh(cfg)
    biased.lm_head = torch.nn.Linear(32, 300, bias=True)  # logits no longer hidden × weight: only `full` is right
    with pytest.raises(UserError, match="use --set training.loss=full"):
        choose_loss(cfg, biased, CUDA)
    assert choose_loss(tiny_config(tmp_path, token_cache_dir), biased, CUDA).kind == "full"


def worker(rank: int, root: Path, cache_dir: Path, tokenizer: Path) -> None:
    """One of two ranks: under DDP and FSDP2 the chunked loss gives the full loss's value and gradients; under FSDP2
    the inner model keeps its parameter names, checkpoints as sharded, and saves a complete final model."""
    batch = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(rank))
    ctx = init_distributed(tiny_config(root, cache_dir))
    try:
        for strategy in ("ddp", "fsdp"):
            cfg = tiny_config(root, cache_dir, model={"num_layers": 2}, training={"strategy": strategy})
            results = {}
            for kind in ("full", "chunked"):
                model = fresh(cfg)
                wrapped = wrap_model(CausalLMLoss(model, kind), cfg, ctx, None)
                assert unwrap(wrapped).model is model
                results[kind] = loss_and_grads(wrapped, model, batch)
            assert abs(results["full"][0] - results["chunked"][0]) < 1e-5, strategy
            assert torch.allclose(results["full"][1], results["chunked"][1], rtol=1e-4, atol=1e-6), strategy
        assert is_sharded(model) and shape_signature(model) == shape_signature(fresh(cfg))
        store.save_final(root / "final", model, ctx, tokenizer.read_text(), eos_id=0)
        save_full_params(model, rank, root / "fsdp_params.pt")
    finally:
        teardown()


def test_chunked_loss_under_ddp_and_fsdp_on_two_cpu_ranks(tmp_path: Path, token_cache_dir: Path) -> None:
    spawn_ranks(worker, tmp_path, token_cache_dir)
    assert_final_model_holds(tmp_path / "final", tmp_path / "fsdp_params.pt")
