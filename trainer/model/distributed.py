"""Process group set-up and teardown, the rank's device, and data-parallel wrapping (DDP or FSDP2).

One rank = one process = one device. The rank learns its place from torchrun's environment (the supervisor uses the
same contract); with none of those variables it is a single-process run and still gets a (one-member) process group,
so the rest of the code never branches on "distributed or not".

Three groups exist: the default one (NCCL on GPUs, gloo on CPUs) carries gradients; a CPU gloo "control" group
carries small host-side agreements (the stop flag, the run folder, checkpoint status) without ever syncing a GPU; and
a CPU gloo "writer" group is used only by the checkpoint writer's background thread (its shards' plan, the agreement
that every rank's files are written), so that a write in flight never interleaves its collectives with the loop's.
"""

from __future__ import annotations

import inspect
import os
import signal
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from trainer.config import Config
from trainer.config.choices import NCCL_ON_CPU
from trainer.errors import UserError
from trainer.model.build import decoder_layers

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
STORE_POLL_S = 0.002  # how often a rank knocks at the rendezvous store's port before it opens, for its first
STORE_POLL_FAST_S = 0.5  # half second (a restart's ranks arrive within milliseconds of rank 0)
STORE_POLL_SLOW_S = 0.05  # then: a rank waiting for rank 0's start-up knocks no more than 20 times a second
STORE_POLL_LIMIT_S = 60.0  # after that, torch's own connection retries (and its error) take over
DDP_BUFFER_SYNC_ARG = ("forward_sync_buffers" if "forward_sync_buffers" in
                       inspect.signature(DistributedDataParallel.__init__).parameters else "broadcast_buffers")


@dataclass(frozen=True)
class RankEnvironment:
    """Where this process sits in the job, from torchrun's variables (all defaults for a single-process run)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    launched: bool = False  # started by torchrun or the supervisor (the variables are present)

    @classmethod
    def from_environ(cls, environ: dict[str, str] | None = None) -> "RankEnvironment":
        env = os.environ if environ is None else environ
        if not all(name in env for name in TORCHRUN_VARIABLES):
            return cls()
        return cls(rank=int(env["RANK"]), local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
                   world_size=int(env["WORLD_SIZE"]), launched=True)


@dataclass
class DistContext:
    """Everything the loop needs to know about its place in the job."""

    env: RankEnvironment
    device: torch.device
    backend: str
    gpu_id: str  # the id in "[GPU <id>]": GPU_RANK, else the CUDA index, else the local rank
    control: Any  # the CPU gloo ProcessGroup for host-side agreements
    writer: Any  # the CPU gloo ProcessGroup of the background checkpoint writes (trainer.checkpoint.background)

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def is_main(self) -> bool:
        return self.env.rank == 0


def select_device(cfg: Config, env: RankEnvironment) -> tuple[torch.device, str]:
    """The one device this rank trains on, and its display id.

    Under the supervisor `CUDA_VISIBLE_DEVICES` holds exactly one GPU, so the device is `cuda:0`. Under plain torchrun
    on a multi-GPU machine every rank sees all GPUs and takes `cuda:<local rank>`. `system.device_id` picks a GPU only
    for a run started by hand without `CUDA_VISIBLE_DEVICES`.
    """
    want = cfg.system.device
    cpu = torch.device("cpu"), os.environ.get("GPU_RANK", str(env.local_rank))
    if want == "cpu":  # decided before asking CUDA: a CPU rank on a GPU machine never initialises the driver
        return cpu
    cuda = torch.cuda.is_available()
    if want == "cuda" and not cuda:
        raise UserError("system.device is 'cuda' but no CUDA GPU is visible; use --set system.device=cpu")
    if not cuda:
        return cpu
    count = torch.cuda.device_count()
    device_id = cfg.system.device_id
    if count == 1:
        index = 0
    elif not env.launched and device_id is not None and "CUDA_VISIBLE_DEVICES" not in os.environ:
        index = device_id
    else:
        index = env.local_rank
    if index >= count:
        raise UserError(f"GPU index {index} requested but only {count} GPU(s) are visible to this process")
    return torch.device("cuda", index), os.environ.get("GPU_RANK", str(index))


def init_distributed(cfg: Config) -> DistContext:
    """Join the job's process group (or create a one-member group) with explicit timeouts, plus the control group."""
    env = RankEnvironment.from_environ()
    device, gpu_id = select_device(cfg, env)
    backend = cfg.system.backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise UserError(NCCL_ON_CPU)
    timeout = timedelta(seconds=cfg.system.dist_timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if env.launched:
        if env.rank != 0:
            await_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), min(STORE_POLL_LIMIT_S,
                                                                                      timeout.total_seconds()))
        dist.init_process_group(backend, timeout=timeout, device_id=device if backend == "nccl" else None)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=timeout)  # a separate gloo group even when gloo carries data
    writer = dist.new_group(backend="gloo", timeout=timeout)
    return DistContext(env=env, device=device, backend=backend, gpu_id=gpu_id, control=control, writer=writer)


def await_store(addr: str, port: int, limit: float) -> None:
    """Return once the rendezvous store (rank 0's, or torchrun's agent's) accepts connections, or after `limit` s.

    torch's store client that finds the port still closed retries on an exponential backoff with jitter (about 0.1 s,
    growing towards seconds), so a rank that arrives a few milliseconds before rank 0 has opened it, as every rank of
    a restart's forked ranks do, waited 0.3-0.7 s for nothing: half of a restart's fault-to-step time. Knocking here
    (a connection opened and closed, which the store ignores), every 2 ms for half a second, then every 50 ms (a rank
    that waits for rank 0's imports need not flood node 0 with connections), lets the client connect at once or
    within 50 ms. The name is resolved once a second at most, not at each knock."""
    started = time.monotonic()
    deadline, resolved_at, targets = started + limit, -1.0, []
    while (now := time.monotonic()) < deadline:
        if now - resolved_at >= 1.0:
            try:
                targets = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
            except OSError:
                targets = []  # not resolvable yet (a Kubernetes service published late): asked again in a second
            resolved_at = now
        for family, kind, proto, _, address in targets:
            try:
                with socket.socket(family, kind, proto) as knock:
                    knock.settimeout(max(0.01, deadline - now))
                    knock.connect(address)
                return
            except OSError:
                continue
        time.sleep(STORE_POLL_S if now - started < STORE_POLL_FAST_S else STORE_POLL_SLOW_S)


def teardown() -> None:
    """Leave the process group; called on every exit path so no rank leaves sockets or NCCL communicators behind."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------------------
# Host-side agreements on the control group (never touch the GPU)


def agree_any(flag: bool, ctx: DistContext) -> bool:
    """True on every rank when any rank passed True (all-reduce MAX of a CPU int)."""
    value = torch.tensor([int(flag)], dtype=torch.int32)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=ctx.control)
    return bool(value.item())


class StopRequest:
    """SIGTERM only sets a flag; the loop acts on it at the next step boundary, together with every other rank."""

    def __init__(self) -> None:
        self.requested = False
        self.signal: str | None = None  # the name of the signal this rank received (the others learn of it by vote)
        self.previous: Any = None

    def _handler(self, signum: int, frame: Any) -> None:
        self.requested = True
        self.signal = signal.Signals(signum).name

    @contextmanager
    def installed(self) -> Iterator["StopRequest"]:
        self.previous = signal.signal(signal.SIGTERM, self._handler)
        try:
            yield self
        finally:
            signal.signal(signal.SIGTERM, self.previous)


class StopVote:
    """The per-step stop agreement, overlapped with the step's compute.

    `cast` starts an all-reduce MAX of this rank's stop flag on the control group at the start of a step; `result`
    waits for it at the end of the step, by when it has long finished, so the vote adds no latency to the step. Every
    rank acts on the same vote at the same step: a stop requested before a step starts ends that step, one requested
    during a step ends the next.
    """

    def __init__(self, ctx: DistContext) -> None:
        self.ctx = ctx
        self.flag = torch.zeros(1, dtype=torch.int32)
        self.work: Any = None

    def cast(self, requested: bool) -> None:
        self.flag.fill_(int(requested))
        self.work = dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, group=self.ctx.control, async_op=True)

    def result(self) -> bool:
        self.work.wait()
        return bool(self.flag.item())


def broadcast_object(obj: Any, ctx: DistContext, src: int = 0, group: Any = None) -> Any:
    """Rank `src`'s value of a small picklable object, on every rank (over `group`, by default the control group)."""
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=ctx.control if group is None else group)
    return box[0]


def gather_objects(obj: Any, ctx: DistContext, group: Any = None) -> list[Any]:
    """Every rank's value of a small picklable object, in rank order, on every rank (by default over the control
    group)."""
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, obj, group=ctx.control if group is None else group)
    return out


def all_reduce_mean(value: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """The mean over ranks of a device tensor (gloo has no AVG, so SUM then divide)."""
    value = value.detach().clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value / ctx.world_size


# ---------------------------------------------------------------------------------------------------------------------
# Data-parallel wrapping


def wrap_model(model: torch.nn.Module, cfg: Config, ctx: DistContext,
               param_dtype: torch.dtype | None) -> torch.nn.Module:
    """DDP (replicated weights) or FSDP2 (`fully_shard` per decoder layer, then the root).

    A one-member DDP group would only add bucket copies, so a single-process DDP run trains the bare model.
    `param_dtype` is the compute dtype (bf16/fp16) FSDP gathers weights in; gradients are reduced in fp32.
    The mesh is built from the rank's own device: left to itself, `fully_shard` builds a CUDA mesh whenever CUDA
    exists, even for CPU ranks on gloo (and then selects the GPU numbered LOCAL_RANK, which may not exist).
    """
    if cfg.training.strategy == "fsdp":
        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return model
    if ctx.world_size == 1:
        return model
    # The only buffers are RoPE tables, identical on every rank: no broadcast before each forward.
    # (torch 2.13 renamed the switch; older releases only know broadcast_buffers.)
    no_buffer_sync = {DDP_BUFFER_SYNC_ARG: False}
    return DistributedDataParallel(
        model,
        device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
        gradient_as_bucket_view=True,  # gradients live in the communication buckets: no second copy
        **no_buffer_sync,
    )


@contextmanager
def gradient_sync(model: torch.nn.Module, enabled: bool) -> Iterator[None]:
    """DDP: skip the gradient all-reduce on accumulation micro-steps (all but the last).

    FSDP2 keeps reducing every micro-step on purpose: skipping would hold unsharded gradients for the whole model
    (2 bytes per parameter, 16 GB at 8B) until the last micro-step, while the reduce-scatter overlaps with backward.
    """
    base = getattr(model, "_orig_mod", model)  # torch.compile wraps the module
    if isinstance(base, DistributedDataParallel) and not enabled:
        with base.no_sync():
            yield
        return
    yield


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module under torch.compile and DDP (FSDP2 shards in place, so it is its own module)."""
    model = getattr(model, "_orig_mod", model)
    return model.module if isinstance(model, DistributedDataParallel) else model


def is_sharded(model: torch.nn.Module) -> bool:
    """True for an FSDP2 root and for the model inside the loss module that is the root (its layers are sharded)."""
    return any(isinstance(m, FSDPModule) for m in unwrap(model).modules())
