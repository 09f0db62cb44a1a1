"""Data parallelism on 2 CPU ranks (gloo): DDP gradients, no_sync, FSDP2 against DDP, sharded checkpoints, DDP's
checkpoint written in the background as each rank's share, and the final model gathered from shards; plus the rank
environment and device rules."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_checkpoint import snapshot
from test_checkpoint_async import same

from rank_support import SPAWNED_WORLD, assert_final_model_holds, save_full_params, spawn_ranks, tiny_config
from trainer.checkpoint import layout, store
from trainer.checkpoint.manager import Checkpointer
from trainer.config import Config
from trainer.metrics import get_logger
from trainer.model.build import build_model, shape_signature
from trainer.model.distributed import (
    DistContext,
    RankEnvironment,
    agree_any,
    await_store,
    gradient_sync,
    init_distributed,
    is_sharded,
    select_device,
    teardown,
    unwrap,
    wrap_model,
)
from trainer.model.loss import full_loss
from trainer.model.optim import build_optimizer, build_scheduler
from trainer.progress import ProgressReporter

WORLD = SPAWNED_WORLD


def test_rank_environment_from_torchrun_variables() -> None:
    env = RankEnvironment.from_environ({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4",
                                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
    assert env == RankEnvironment(rank=3, local_rank=1, world_size=4, launched=True)
    assert RankEnvironment.from_environ({}) == RankEnvironment()  # a single-process run


def test_cpu_device_and_label(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tiny_config(tmp_path, tmp_path)
    monkeypatch.delenv("GPU_RANK", raising=False)
    assert select_device(cfg, RankEnvironment(rank=1, local_rank=1, world_size=2, launched=True)) == (
        torch.device("cpu"), "1")
    monkeypatch.setenv("GPU_RANK", "6")
    assert select_device(cfg, RankEnvironment())[1] == "6"


def test_fsdp_mesh_is_the_ranks_own_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """fully_shard is handed a mesh of the rank's device on every call. Its default mesh is a CUDA one wherever CUDA
    exists, so CPU ranks on a GPU machine would fail (`invalid device ordinal`); on a machine without CUDA the default
    would pass unseen, hence the calls are watched, not only the parameters' meshes."""
    from trainer.model import distributed

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    given, real = [], distributed.fully_shard

    def watched(module: torch.nn.Module, **kwargs: Any) -> Any:
        given.append(kwargs.get("mesh"))
        return real(module, **kwargs)

    monkeypatch.setattr(distributed, "fully_shard", watched)
    cfg = tiny_config(tmp_path, tmp_path, training={"strategy": "fsdp"})
    ctx = init_distributed(cfg)
    try:
        model = wrap_model(fresh(cfg), cfg, ctx, None)
        meshes = {(p.device_mesh.device_type, tuple(p.device_mesh.shape)) for p in model.parameters()}
        assert meshes == {("cpu", (1,))}
        assert len(given) == cfg.model.num_layers + 1  # every layer, then the model
        assert all(mesh is not None and mesh.device_type == "cpu" for mesh in given), given
    finally:
        teardown()


def batch_for(rank: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(100 * seed + rank))


def flat_grads(model: torch.nn.Module) -> torch.Tensor:
    """All gradients as one vector (a sharded gradient is gathered to its full value first)."""
    grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in model.parameters()]
    return torch.cat([g.flatten() for g in grads])


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().flatten()
                      for p in model.parameters()])


def same_on_all_ranks(value: torch.Tensor) -> bool:
    gathered = [torch.empty_like(value) for _ in range(WORLD)]
    dist.all_gather(gathered, value)
    return all(torch.equal(gathered[0], g) for g in gathered)


def fresh(cfg: Config) -> torch.nn.Module:
    torch.manual_seed(cfg.system.seed)
    return build_model(cfg, 300, 0, torch.device("cpu"))


def worker(rank: int, root: Path, cache_dir: Path, tokenizer: Path) -> None:
    """One of two ranks; any failed assertion fails the spawn (and the test) with this rank's traceback."""
    cfg = tiny_config(root, cache_dir, model={"num_layers": 2})
    ctx = init_distributed(cfg)
    try:
        assert (ctx.rank, ctx.world_size, ctx.backend) == (rank, WORLD, "gloo")
        assert agree_any(rank == 1, ctx) and not agree_any(False, ctx)  # the control-plane vote

        # DDP: the gradient is the mean of the ranks' local gradients, identical everywhere.
        local = fresh(cfg)
        full_loss(local, batch_for(rank)).backward()
        expected = flat_grads(local)
        dist.all_reduce(expected)
        expected /= WORLD
        ddp = wrap_model(fresh(cfg), cfg, ctx, None)
        with gradient_sync(ddp, enabled=False):  # an accumulation micro-step: no all-reduce
            full_loss(ddp, batch_for(rank)).backward()
        assert not same_on_all_ranks(flat_grads(unwrap(ddp)))
        unwrap(ddp).zero_grad(set_to_none=False)
        with gradient_sync(ddp, enabled=True):
            full_loss(ddp, batch_for(rank)).backward()
        ddp_grads = flat_grads(unwrap(ddp))
        assert same_on_all_ranks(ddp_grads)
        assert torch.allclose(ddp_grads, expected, atol=1e-6)

        # FSDP2 (fully_shard per decoder layer, then the root) computes the same gradients and the same update.
        sharded_cfg = tiny_config(root, cache_dir, model={"num_layers": 2}, training={"strategy": "fsdp"})
        fsdp = wrap_model(fresh(sharded_cfg), sharded_cfg, ctx, None)
        assert is_sharded(fsdp)
        assert {(p.device_mesh.device_type, tuple(p.device_mesh.shape)) for p in fsdp.parameters()} == {("cpu", (2,))}
        full_loss(fsdp, batch_for(rank)).backward()
        assert torch.allclose(flat_grads(fsdp), ddp_grads, atol=1e-6)
        norm = torch.nn.utils.clip_grad_norm_(list(fsdp.parameters()), 0.1).full_tensor()  # the pre-clip norm
        assert torch.allclose(norm, torch.nn.utils.clip_grad_norm_(list(ddp.parameters()), 0.1), rtol=1e-5)
        assert torch.allclose(norm, ddp_grads.norm(), rtol=1e-5)
        optimizers = [build_optimizer(m, cfg) for m in (unwrap(ddp), fsdp)]
        for optimizer in optimizers:
            optimizer.step()
        assert torch.allclose(flat_params(fsdp), flat_params(unwrap(ddp)), atol=1e-6)

        # DDP's replicated state, saved synchronously (rank 0's state.pt) and in the background (split: each rank
        # stages and writes its share into dcp/) while the live state moves on; both load the same here.
        ddp_state = store.TrainState(unwrap(ddp), optimizers[0], build_scheduler(optimizers[0], cfg))
        cache = SimpleNamespace(key="k")
        checkpoints = Checkpointer(split_cfg(cfg, root), ctx, ddp_state, cache, get_logger(),  # type: ignore[arg-type]
                                   ProgressReporter(fd=None))
        store.save(root / "sync" / "step_000001", ddp_state, checkpoints.meta(1), ctx)
        checkpoints.save(1)
        with gradient_sync(ddp, enabled=True):
            full_loss(ddp, batch_for(rank, seed=2)).backward()
        optimizers[0].step()
        checkpoints.finish()
        assert same(*load_split_and_whole(cfg, ctx, root))

        # Sharded checkpoint (torch.distributed.checkpoint) round trip into a fresh sharded model and optimizer.
        state = store.TrainState(fsdp, optimizers[1], build_scheduler(optimizers[1], sharded_cfg))
        meta = store.CheckpointMeta(step=1, format=state.format, cache_key="k", world_size=WORLD, data={},
                                         model_shapes=shape_signature(fsdp), config={})
        path = store.save(root / "ckpt" / "step_000001", state, meta, ctx)
        restored_model = wrap_model(fresh(sharded_cfg), sharded_cfg, ctx, None)
        restored_optim = build_optimizer(restored_model, sharded_cfg)
        restored = store.TrainState(restored_model, restored_optim, build_scheduler(restored_optim, sharded_cfg))
        assert store.load(path, restored, ctx, "k").format == layout.SHARDED
        assert torch.equal(flat_params(restored_model), flat_params(fsdp))
        for s in (state, restored):  # same optimizer state → same next update
            full_loss(s.model, batch_for(rank, seed=1)).backward()
            s.optimizer.step()
        assert torch.equal(flat_params(restored_model), flat_params(fsdp))

        # The final model is gathered from the shards onto rank 0 and saved with save_pretrained.
        store.save_final(root / "final", fsdp, ctx, tokenizer.read_text(), eos_id=0)
        save_full_params(fsdp, rank, root / "fsdp_params.pt")
    finally:
        teardown()


def split_cfg(cfg: Config, root: Path) -> Config:
    """`cfg` saving in the background into root/split."""
    return replace(cfg, checkpoint=replace(cfg.checkpoint, dir=str(root / "split"), async_save=True))


def load_split_and_whole(cfg: Config, ctx: DistContext, root: Path) -> tuple[dict[str, torch.Tensor], ...]:
    """The worker's split checkpoint and its synchronous one, each loaded into a fresh DDP model and optimizer."""
    got = []
    for path in (root / "split" / "step_000001", root / "sync" / "step_000001"):
        model = fresh(cfg)
        optimizer = build_optimizer(model, cfg)
        state = store.TrainState(model, optimizer, build_scheduler(optimizer, cfg))
        assert store.load(path, state, ctx, "k").split == (path.parent.name == "split")
        got.append(snapshot(state))
    return tuple(got)


def test_ddp_and_fsdp_on_two_cpu_ranks(tmp_path: Path, token_cache_dir: Path) -> None:
    spawn_ranks(worker, tmp_path, token_cache_dir)
    split = tmp_path / "split" / "step_000001"
    assert "model" not in store.load_payload(split / store.STATE_FILE)  # in dcp/, a share from each rank:
    shares = [f.stat().st_size for f in (split / layout.DCP_DIR).glob("*.distcp")]
    assert len(shares) == WORLD and all(0.35 < share / sum(shares) < 0.65 for share in shares), shares
    cfg = tiny_config(tmp_path, token_cache_dir, model={"num_layers": 2})
    ctx = init_distributed(cfg)  # one rank loads what two wrote
    try:
        assert same(*load_split_and_whole(cfg, ctx, tmp_path))
    finally:
        teardown()
    assert_final_model_holds(tmp_path / "final", tmp_path / "fsdp_params.pt")
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(tmp_path / "final").eos_token_id == 0


def test_a_rank_waits_for_the_store_port_to_open_then_joins_at_once() -> None:
    """`await_store` returns once the port accepts a connection (the listener sees the knock), and after its limit
    when nothing ever listens (torch's own retries and error then take over), without raising either way."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        port = server.getsockname()[1]
        opened = threading.Timer(0.2, server.listen)
        opened.start()
        await_store("localhost", port, limit=30)
        opened.join()
        server.settimeout(5)
        knock, _ = server.accept()  # the connection that found it open
        knock.close()
    started = time.monotonic()
    await_store("127.0.0.1", port, limit=0.3)  # closed for good
    assert time.monotonic() - started >= 0.3
