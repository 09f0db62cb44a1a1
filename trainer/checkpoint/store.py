"""Checkpoints: atomic, resumable, checked against the run they are loaded into; and the final `save_pretrained` model.

Layout under `checkpoint.dir` (default `.checkpoints/`, relative to the working directory):

    step_000500/            one checkpoint; the name is the number of optimizer steps completed
        meta.json           step, format, dataset cache key, data position, parameter shapes, config, and each
                            file's size and checksum (readable without torch)
        state.pt            scheduler, grad scaler and every rank's RNG state; plus model and optimizer in the
                            "full" format (DDP / single process, written by rank 0)
        dcp/                model and optimizer via torch.distributed.checkpoint: in the "sharded" format (FSDP2),
                            and in the full format when meta.json says `"split": true`
    final/                  the trained model (safetensors) + tokenizer, loadable with AutoModelForCausalLM

A save is staged (`stage`: the state dicts taken, copied into host memory when written in the background) and then
written (`write`). A full-format save written in the background by several ranks is split: DDP replicates the state
on every rank, so each rank stages and writes only its share (`replicated_share`: whole parameters with their
optimizer state, balanced by bytes) into dcp/, instead of rank 0 copying and writing all of it alone; a load reads
every share back on any number of ranks, as it reads FSDP2's shards. A checkpoint is written into `.tmp-step_<n>/`,
fsynced, then renamed into place once every rank's files are written, so a process killed mid-save leaves the previous
checkpoints intact and only a stray `.tmp-*` folder (removed by the next save). Each rank checksums the files it
wrote right after writing them (still in the page cache); rank 0 records them all in meta.json before the rename. A
resume checks them first (`verify`: every rank reads its share of the files), and a checkpoint whose files differ
from the record, or that fails to load all the same, is `Unreadable` on every rank alike, so that the ranks pass
over it together (trainer.checkpoint.manager). `state.pt` is loaded with
`weights_only=True`. In the full format a checkpoint can also be one file holding the same content (what the NaN
guard asks for as `nan_grad_step_<n>.pt`); `--resume` accepts either. Names on disk and the choice of the checkpoint
to resume from are in `trainer/checkpoint/layout.py` (no torch: the supervisor checks `--resume` too).

Length: the save and the load of every format are one contract (what one writes the other reads, across formats,
world sizes and releases), kept in one place with the checks that refuse a checkpoint that does not fit the run.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from trainer import durable
from trainer.checkpoint.layout import (
    DCP_DIR,
    DCP_METADATA,
    FULL,
    META_FILE,
    OLD_PREFIX,
    SHARDED,
    STATE_FILE,
    STEP_PREFIX,
    TMP_PREFIX,
    CheckpointMeta,
    file_record,
    file_records,
    list_checkpoints,
    other_data,
    other_format,
    other_shape,
    record_files,
    record_name,
    record_path,
    verify_files,
)
from trainer.config import Config
from trainer.errors import UserError
from trainer.model.build import shape_signature
from trainer.model.distributed import DistContext, broadcast_object, gather_objects, is_sharded

FINAL_DIR = "final"


@dataclass
class TrainState:
    """The live objects a checkpoint captures. `model` is the unwrapped transformers model (inside the FSDP2 root
    when sharded: the loss module, see trainer.model.loss); `scaler` exists only for fp16."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler | None = None

    @property
    def format(self) -> str:
        return SHARDED if is_sharded(self.model) else FULL


def data_position(cfg: Config, world_size: int) -> dict[str, int]:
    """The settings that, with the step, decide which windows each rank reads next."""
    return {"seed": cfg.system.seed, "world_size": world_size, "micro_batch_size": cfg.training.batch_size,
            "grad_accum": cfg.training.grad_accum_nums, "context_length": cfg.data.context_length}


def sample_order(data: dict[str, int]) -> tuple[int, int, int]:
    """What, with the step, decides which windows a step trains on (`trainer.data.batches`): the seed, the window
    length and the global batch. How the ranks split a step's windows (world size, accumulation, micro-batch) does
    not, so a run resumed on fewer ranks with the same global batch continues the same order."""
    return data["seed"], data["context_length"], data["world_size"] * data["grad_accum"] * data["micro_batch_size"]


# ---------------------------------------------------------------------------------------------------------------------
# Checking a checkpoint against the run


def read_meta(path: Path) -> CheckpointMeta:
    """A checkpoint folder's meta.json (a `.pt` file keeps its meta in its payload)."""
    return CheckpointMeta.from_dict(json.loads((path / META_FILE).read_text()))


@dataclass(frozen=True)
class Verification:
    """What `verify` found of a checkpoint's files."""

    problem: str | None  # the first file that differs from meta.json's record, said; None when none does
    files: int  # the files recorded: 0 for a checkpoint written before files were recorded (not verified)
    bytes: int  # their bytes, every one read
    seconds: float


class Unreadable(Exception):
    """A checkpoint that is damaged, as every rank agrees: its files differ from their record, or it does not load
    (damage its checks could not find: one written before files were recorded, or changed since it was checked)."""


def agreed(problem: str | None, ctx: DistContext) -> str | None:
    """Collective: the lowest rank's problem, or None where no rank has one, on every rank alike."""
    return next((p for p in gather_objects(problem, ctx) if p is not None), None)


def verify(path: Path, ctx: DistContext) -> Verification:
    """Collective: check the checkpoint `path`'s files against meta.json's record of them before anything is loaded,
    each rank its share (`balanced_share`, by bytes, so the ranks read at once), sizes first, then checksums. Rank 0
    reads the record, so that every rank checks the same one; every rank gets the same verdict."""
    started = time.perf_counter()
    files = broadcast_object(file_records(path) if ctx.is_main else None, ctx) or {}
    sizes = {name: entry["bytes"] for name, entry in files.items()}
    mine = sorted(balanced_share(sizes, ctx.rank, ctx.world_size))
    folder = path if path.is_dir() else path.parent  # a `.pt` file's record names it in its folder
    problem = agreed(verify_files(folder, mine, files, record_name(path)) if mine else None, ctx)
    return Verification(problem, len(files), sum(sizes.values()), time.perf_counter() - started)


def check_compatible(path: Path, meta: CheckpointMeta, cache_key: str, state: TrainState) -> None:
    """Refuse a checkpoint from another dataset, another model shape or another sharding format, with one clear line."""
    if meta.cache_key != cache_key:
        raise other_data(path, meta.cache_key, cache_key)
    here = shape_signature(state.model)
    if meta.model_shapes != here:
        missing = sorted(set(meta.model_shapes) - set(here))
        extra = sorted(set(here) - set(meta.model_shapes))
        differ = [n for n in here if n in meta.model_shapes and meta.model_shapes[n] != here[n]]
        if differ:
            n = differ[0]
            detail = f"{n} is {meta.model_shapes[n]} there and {here[n]} here ({len(differ)} parameters differ)"
        else:
            detail = f"parameters only there: {missing[:3]}, only here: {extra[:3]}"
        raise other_shape(path, detail)
    if meta.format != state.format:
        raise other_format(path, meta.format)


# ---------------------------------------------------------------------------------------------------------------------
# Files


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def publish(tmp: Path, final: Path) -> None:
    durable.publish(tmp, final, aside=final.with_name(OLD_PREFIX + final.name))


def one_line(error: BaseException) -> str:
    """An error as one short line for the log (a collective's errors run to many)."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:200]}" if text else type(error).__name__


def dcp_failure(error: CheckpointException) -> BaseException:
    """The error behind DCP's report of a collective failure (a BaseException holding each failed rank's): the lowest
    rank's, which every rank was told of."""
    return error.failures[min(error.failures)][0] if error.failures else RuntimeError(str(error))


@dataclass(frozen=True)
class WriteFailure:
    """Why rank 0 could not write, as every rank is told. `disk` failures (a full disk, a failing one, a folder gone)
    are one line for the user; anything else is a bug whose traceback the ranks keep."""

    message: str
    disk: bool


FULL_BELOW = 16 << 20  # free bytes under which a failed write is taken for a full disk


def failure_of(action: Callable[[], Any], folder: Path) -> WriteFailure | None:
    """Run `action`, which writes into `folder`; say what went wrong instead of raising, so the other ranks can be
    told before anyone raises. A full disk is named as one: torch's zip writer says only `unexpected pos`."""
    try:
        action()
    except Exception as e:
        free = durable.free_bytes(folder)
        if free is not None and free < FULL_BELOW:
            return WriteFailure(f"No space left on device in {folder} ({free:,} bytes free)", disk=True)
        if isinstance(e, OSError):
            return WriteFailure(f"{e.strerror or e} in {folder}", disk=True)
        return WriteFailure(f"{type(e).__name__}: {e}", disk=False)
    return None


class WriteFailed(RuntimeError):
    """Rank 0 failed to write for a reason other than its disk (a bug), as every rank is told."""


def raise_if_main_failed(failure: WriteFailure | None, ctx: DistContext, what: str, fix: str,
                         group: Any = None) -> None:
    """Collective (over `group`, by default the control group): every rank raises when rank 0 failed; otherwise the
    others would wait forever in their next collective for a rank that has given up."""
    failure = broadcast_object(failure, ctx, group=group)
    if failure is None:
        return
    if failure.disk:
        raise UserError(f"cannot write {what}: {failure.message}; {fix}")
    raise WriteFailed(f"{what} failed on rank 0: {failure.message}")


DISK_FIX = "free space there, or set checkpoint.dir to a folder on a disk with room (earlier checkpoints are intact)"


def prune(root: Path, keep: int) -> None:
    """Keep the newest `keep` step checkpoints, and drop what killed saves left behind (rank 0, between saves)."""
    for path in list_checkpoints(root)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)
    for leftover in root.glob(f"{TMP_PREFIX}{STEP_PREFIX}*"):
        remove(leftover)


def load_payload(path: Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=True)


def rng_state(device: torch.device) -> dict[str, Any]:
    """The generators a rank draws from; the CUDA one only on a GPU rank (a CPU rank never touches the driver)."""
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        "python": random.getstate(),
    }


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
    random.setstate(state["python"])


def payload(state: TrainState, meta: CheckpointMeta, rngs: list[dict[str, Any]],
            weights: dict[str, Any] | None) -> dict[str, Any]:
    """state.pt's content; `weights` (the model and optimizer, `weights_to_stage`) where they are kept there."""
    return {
        "meta": asdict(meta),
        "scheduler": state.scheduler.state_dict(),
        "scaler": state.scaler.state_dict() if state.scaler is not None else None,
        "rng": rngs,
        **(weights or {}),
    }


# ---------------------------------------------------------------------------------------------------------------------
# Save and load


Fault = Callable[[str], None]  # called with the phase a save reaches: staging, checkpoint (written), publishing


def no_fault(phase: str) -> None:
    """The fault hook of a save without fault injection."""


@dataclass
class Staged:
    """One checkpoint's content taken off the live state after a step, and where it goes: all its write needs, so
    that training may go on changing the live tensors while it is written (trainer.checkpoint.background)."""

    path: Path  # the final name: a `step_<n>/` folder, or a `.pt` file in the full format
    meta: CheckpointMeta
    payload: dict[str, Any] | None  # state.pt's content, on rank 0 only
    shards: dict[str, Any] | None  # the sharded format: this rank's model and optimizer shards, for DCP
    nbytes: int  # the tensor bytes this rank holds staged

    @property
    def single_file(self) -> bool:
        return self.path.suffix == ".pt" and self.meta.format == FULL

    @property
    def tmp(self) -> Path:
        return self.path.with_name(TMP_PREFIX + self.path.name)


def tensor_bytes(tree: Any) -> int:
    """The bytes of the tensors in a nested state dict (a sharded tensor counts its local shard)."""
    if isinstance(tree, torch.Tensor):
        local = tree.to_local() if hasattr(tree, "to_local") else tree
        return local.numel() * local.element_size()
    if isinstance(tree, dict):
        return sum(tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(tensor_bytes(v) for v in tree)
    return 0


def balanced_share(cost: dict[str, int], rank: int, world_size: int) -> set[str]:
    """This rank's names when each name goes to one rank, the largest first onto the rank with the fewest bytes so
    far: balanced by bytes, and the same on every rank (a pure function of the names and their costs)."""
    load = [0] * world_size
    mine = set()
    for name in sorted(cost, key=lambda n: (-cost[n], n)):
        owner = min(range(world_size), key=lambda r: (load[r], r))
        load[owner] += cost[name]
        if owner == rank:
            mine.add(name)
    return mine


def replicated_share(model_sd: dict[str, Any], optim_sd: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """This rank's share of a state every rank holds whole (DDP's), for DCP: each parameter, with its optimizer
    state, goes to one rank, the largest first onto the rank with the fewest bytes so far (the same on every rank: a
    pure function of the names and sizes); the optimizer's param_groups go to rank 0. The shares of all ranks are
    the whole state, each key in exactly one of them."""
    states = optim_sd.get("state", {})
    names = list(dict.fromkeys([*model_sd, *states]))
    mine = balanced_share({n: tensor_bytes(model_sd.get(n)) + tensor_bytes(states.get(n)) for n in names}, rank,
                          world_size)
    optimizer: dict[str, Any] = {"state": {n: s for n, s in states.items() if n in mine}}
    if rank == 0:
        optimizer.update({k: v for k, v in optim_sd.items() if k != "state"})
    return {"model": {n: t for n, t in model_sd.items() if n in mine}, "optimizer": optimizer}


def weights_to_stage(state: TrainState, meta: CheckpointMeta, ctx: DistContext) -> dict[str, Any]:
    """The model and optimizer state dicts a save of `meta`'s kind takes on this rank, as views of the live tensors:
    for dcp/, its FSDP2 shards or (`meta.split`) its share of the replicated state; otherwise the whole of them, for
    state.pt."""
    if not meta.in_dcp:
        return {"model": state.model.state_dict(), "optimizer": state.optimizer.state_dict()}
    model_sd, optim_sd = get_state_dict(state.model, state.optimizer)
    if meta.split:
        return replicated_share(model_sd, optim_sd, ctx.rank, ctx.world_size)
    return {"model": model_sd, "optimizer": optim_sd}


def prime_optimizer(state: TrainState) -> None:
    """Give an optimizer that has not stepped yet its state now, as its first step would create it: DCP's own
    initialisation (what `get_state_dict` does to an optimizer without state: a step at learning rate 0 on zero
    gradients, which moves no weight and leaves zero moments), with the step counts it advanced set back to 0. The
    state's tensors then exist before training (updated in place from then on), so staging buffers keyed by them can
    be allocated before the first step; that step computes exactly what it would have."""
    if state.optimizer.state:
        return
    get_state_dict(state.model, state.optimizer)
    for param_state in state.optimizer.state.values():
        if isinstance(param_state.get("step"), torch.Tensor):
            param_state["step"].zero_()


def stage(path: Path, state: TrainState, meta: CheckpointMeta, ctx: DistContext,
          copy: Callable[[Any], Any] | None = None, fault: Fault = no_fault) -> Staged:
    """The first part of a save, on the training thread (collective): gather every rank's RNG state, make the
    temporary folder, take the state dicts (this rank's share of them when `meta.split`), and, given `copy` (a DCP
    stager's `stage`), copy their tensors off the live ones into host memory. Without `copy` the staged dicts are
    views of the live tensors: write them before the next optimizer step."""
    rngs = gather_objects(rng_state(ctx.device), ctx)
    staged = Staged(path, meta, None, None, 0)
    error = None
    if ctx.is_main:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            remove(staged.tmp)  # what a save killed half-way left behind
            if not staged.single_file:
                staged.tmp.mkdir()
        except OSError as e:
            error = f"cannot write checkpoints into {path.parent}: {e}"
    error = broadcast_object(error, ctx)
    if error:
        raise UserError(error)
    fault("staging")
    weights = weights_to_stage(state, meta, ctx) if meta.in_dcp or ctx.is_main else None
    if meta.in_dcp:
        staged.shards = weights
    if ctx.is_main:
        staged.payload = payload(state, meta, rngs, None if meta.in_dcp else weights)
    if copy is not None:
        staged.shards = copy(staged.shards) if staged.shards is not None else None
        staged.payload = copy(staged.payload) if staged.payload is not None else None
    staged.nbytes = tensor_bytes(staged.shards) + tensor_bytes(staged.payload)
    return staged


def write(staged: Staged, ctx: DistContext, group: Any = None, fault: Fault = no_fault) -> None:
    """The second part of a save (collective over `group`: the control group on the training thread, the writer
    group in the background): DCP's shards on every rank, state.pt on rank 0, then `meta.json`, the fsync and the
    rename, only once every rank's files are written (DCP's save returns on rank 0 after every rank's shards are).
    `fault` fires once the state is written (`checkpoint`) and once meta.json is too (`publishing`), before the
    rename: a rank killed there leaves an unpublished `.tmp-` folder and the previous checkpoint the latest. A
    failure of DCP's write is every rank's alike (DCP tells them all), so each says it as rank 0 does its own (a full
    disk named as one, `failure_of`). Each rank records its own shards once they are written (`layout.record_files`:
    read back while still in the page cache), rank 0 its state.pt and DCP's .metadata; rank 0 gathers them all into
    meta.json."""
    tmp, path = staged.tmp, staged.path
    files: dict[str, dict[str, Any]] = {}  # each file written, as meta.json records it

    def write_shards() -> None:
        try:
            dcp.save(staged.shards, checkpoint_id=tmp / DCP_DIR, process_group=group)
        except CheckpointException as e:  # (a BaseException) DCP's report of each rank's failure
            raise dcp_failure(e) from e

    def record_shards() -> None:  # DCP names a rank's files after its rank in `group`, which holds every rank in order
        own = sorted((tmp / DCP_DIR).glob(f"__{ctx.rank}_*.distcp"))
        files.update(record_files(tmp, [f.relative_to(tmp).as_posix() for f in own]))

    def gather_records(own: WriteFailure | None) -> WriteFailure | None:
        """Every rank's records into `files`, and the first rank's failure to make them (a rank gone: the gather's)."""
        gathered: list[tuple[dict[str, Any], WriteFailure | None]] = []
        failure = failure_of(lambda: gathered.extend(gather_objects((files, own), ctx, group)), path.parent)
        for theirs, their_failure in gathered:
            files.update(theirs)
            failure = failure or their_failure
        return failure

    def write_state() -> None:
        torch.save(staged.payload, tmp if staged.single_file else tmp / STATE_FILE)
        if not staged.single_file:
            dcp_metadata = [f"{DCP_DIR}/{DCP_METADATA}"] if staged.shards is not None else []
            files.update(record_files(tmp, [STATE_FILE, *dcp_metadata]))

    def write_meta() -> None:  # meta.json last: only a complete checkpoint ever has one
        if not staged.single_file:
            meta = replace(staged.meta, files=dict(sorted(files.items())))
            (tmp / META_FILE).write_text(json.dumps(asdict(meta), indent=1) + "\n")
        else:  # the file's record beside it, in place before the file itself is
            record = record_path(tmp)
            durable.write_json_durably(record, file_record(tmp))
            os.replace(record, record_path(path))

    failure = failure_of(write_shards, path.parent) if staged.shards is not None else None
    if staged.shards is not None and failure is None:  # (a failure of DCP's is every rank's: none gathers)
        failure = gather_records(failure_of(record_shards, path.parent))
    if ctx.is_main and failure is None:
        failure = failure_of(write_state, path.parent)
    fault("checkpoint")
    if ctx.is_main and failure is None:
        failure = failure_of(write_meta, path.parent)
    fault("publishing")
    if ctx.is_main and failure is None:
        failure = failure_of(lambda: publish(tmp, path), path.parent)
    if failure is not None and ctx.is_main:
        remove(tmp)  # a partial save is no use to anyone, and on a full disk it holds the space the run needs
    raise_if_main_failed(failure, ctx, f"checkpoint {path}", DISK_FIX, group)


def save(path: Path, state: TrainState, meta: CheckpointMeta, ctx: DistContext, fault: Fault = no_fault) -> Path:
    """Write a checkpoint atomically on the training thread; collective (every rank calls it, rank 0 writes unless
    sharded). `path` is a folder (`step_<n>/`), or a single file when it ends in `.pt` and the format is full (the
    NaN guard's `nan_grad_step_<n>.pt`; a sharded checkpoint is always a folder, whatever its name)."""
    write(stage(path, state, meta, ctx, fault=fault), ctx, fault=fault)
    return path


DCP_PACKAGE = str(Path(dcp.__file__).parent)


@contextmanager
def dcp_tracebacks_left_out() -> Iterator[None]:
    """DCP logs a traceback on the root logger for each way it fails to read a damaged `.metadata` before it raises;
    the load says its failure in one line instead (`Unreadable`), so those records are dropped while it reads."""
    def keep(record: logging.LogRecord) -> bool:
        return not (record.exc_info and record.pathname.startswith(DCP_PACKAGE))

    root = logging.getLogger()
    root.addFilter(keep)
    try:
        yield
    finally:
        root.removeFilter(keep)


def comparable(meta: CheckpointMeta) -> dict[str, Any]:
    """A meta as JSON reads it back, without the files' record (which meta.json alone holds)."""
    return json.loads(json.dumps({**asdict(meta), "files": {}}))


def record_problem(path: Path, state_file: Path, content: Any, meta: CheckpointMeta | None) -> str | None:
    """What makes state.pt's `content` unlike a checkpoint's, or meta.json (`meta`) unlike the copy state.pt keeps of
    it, said; None where they agree. meta.json has no checksum of its own: a hand edit (another step, `split` turned
    off) shows as a difference from that copy, and must not resume a state under the wrong step."""
    if not isinstance(content, dict) or "meta" not in content:
        return (f"{state_file} is a torch.save file but not a checkpoint (it holds no checkpoint record); give a "
                f"step_<n> folder or a .pt file a run saved")
    try:
        saved = CheckpointMeta.from_dict(content["meta"])
    except (ValueError, TypeError) as e:
        return f"{state_file}'s checkpoint record {e}"
    if missing := [key for key in ("scheduler", "rng", *(() if saved.in_dcp else ("model", "optimizer")))
                   if key not in content]:
        return f"{state_file} lacks the {', '.join(missing)} a checkpoint holds"
    if meta is not None:
        here, there = comparable(meta), comparable(saved)
        if differ := sorted(key for key in here.keys() | there.keys() if here.get(key) != there.get(key)):
            return (f"{path / META_FILE} differs from the copy state.pt keeps of it ({', '.join(differ)}): it was "
                    f"changed after the save")
    return None


def load(path: Path, state: TrainState, ctx: DistContext, cache_key: str) -> CheckpointMeta:
    """Restore `state` from a checkpoint after checking it belongs to this run (collective). One that does not read
    back raises `Unreadable` on every rank alike, however torch failed on it (a zip archive cut short, a shard
    missing, DCP's `.metadata` cut short, on some ranks or on all), so that the ranks pass over it together."""
    state_file = path if path.is_file() else path / STATE_FILE
    meta = None if path.is_file() else read_meta(path)  # a `.pt` file keeps its meta among its tensors
    if meta is not None:
        check_compatible(path, meta, cache_key, state)  # before a state.pt that may hold every weight is read
    content, problem = None, None
    try:
        content = load_payload(state_file)
    except Exception as e:  # damage the checks did not see
        problem = f"{state_file} cannot be read ({one_line(e)})"
    else:
        problem = record_problem(path, state_file, content, meta)
    if problem := agreed(problem, ctx):
        raise Unreadable(problem)
    if meta is None:
        meta = CheckpointMeta.from_dict(content["meta"])
        check_compatible(path, meta, cache_key, state)
    if not meta.in_dcp:
        state.model.load_state_dict(content["model"])
        state.optimizer.load_state_dict(content["optimizer"])
    else:  # every rank reads what it holds: its FSDP2 shards, or the whole of a split state from every rank's share
        model_sd, optim_sd = get_state_dict(state.model, state.optimizer)
        try:
            with dcp_tracebacks_left_out():
                dcp.load({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=path / DCP_DIR)
        except CheckpointException as e:  # (a BaseException) what failed on any rank, told to every rank
            problem = f"{path / DCP_DIR} cannot be read ({one_line(dcp_failure(e))})"
        except Exception as e:
            problem = f"{path / DCP_DIR} cannot be read ({one_line(e)})"
        if problem := agreed(problem, ctx):
            raise Unreadable(problem)
        set_state_dict(state.model, state.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    state.scheduler.load_state_dict(content["scheduler"])
    if state.scaler is not None and content.get("scaler"):
        state.scaler.load_state_dict(content["scaler"])
    rngs = content["rng"]
    if meta.world_size == ctx.world_size and ctx.rank < len(rngs):
        set_rng_state(rngs[ctx.rank], ctx.device)
    return meta


# ---------------------------------------------------------------------------------------------------------------------
# The final model


def save_final(out_dir: Path, model: torch.nn.Module, ctx: DistContext, tokenizer_json: str,
               eos_id: int | None) -> Path:
    """`save_pretrained` (safetensors) plus the tokenizer, atomically, into `out_dir` (collective when sharded).

    The tokenizer comes as its JSON text, read when the run started: the token cache it came from may be gone by the
    end of a long run (cleaned up, rebuilt elsewhere), and the final model must not depend on it."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a progress bar per shard would garble the rank's log

    state_dict = None
    if is_sharded(model):  # gather full weights onto rank 0's CPU
        state_dict = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    failure = failure_of(lambda: write_final(out_dir, model, state_dict, tokenizer_json, eos_id),
                         out_dir.parent) if ctx.is_main else None
    if failure is not None:
        remove(out_dir.with_name(TMP_PREFIX + out_dir.name))
    raise_if_main_failed(failure, ctx, f"the final model {out_dir}", DISK_FIX)
    return out_dir


def write_final(out_dir: Path, model: torch.nn.Module, state_dict: dict[str, Any] | None, tokenizer_json: str,
                eos_id: int | None) -> None:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tmp = out_dir.with_name(TMP_PREFIX + out_dir.name)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    use_cache = model.config.use_cache
    model.config.use_cache = True  # for generation; training never needs the key/value cache
    try:
        model.save_pretrained(tmp, state_dict=state_dict)
    finally:
        model.config.use_cache = use_cache
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer_json))
    if eos_id is not None:
        eos = tokenizer.convert_ids_to_tokens(eos_id)
        tokenizer.eos_token = tokenizer.bos_token = tokenizer.pad_token = eos
    tokenizer.save_pretrained(tmp)
    publish(tmp, out_dir)
