"""The latest state in the node's shared memory: a snapshot every `checkpoint.memory_interval` steps that a rank's death
does not take with it, which a restart on the same node loads at memory speed; the disk checkpoints stay the fallback.

Where: the folder the supervisor names in ``SUPERVISOR_MEMORY_DIR`` (under /dev/shm). The supervisor owns it: it makes
it new for each run, so whatever it holds is this run's, and removes it on every exit path, its sentinel included
when the supervisor itself is killed (`supervisor.group.reaper`). A run without it (by hand, under torchrun, or under
the supervisor with no restart to come) takes no snapshots: nothing would remove them, or nothing would read them.

What: two copies per rank, written in turn (`local<i>.<slot>.bin` and `.json`, slot 0 and 1): each snapshot
overwrites the older one, so the latest whole copy survives a rank killed while it writes the next, and ranks that
died a step apart (one wrote step n, the other was killed before) still share step n - 1. A copy is its tensors
(allocated once with `posix_fallocate`, so a full /dev/shm is an error at the start rather than a SIGBUS later, then
rewritten in place) and its header (the step, the checkpoint meta, each tensor's name, dtype, shape and offset, the
state beside the tensors (scheduler, gradient scaler, the optimizer's hyperparameters, the rank's RNGs) and an
xxh3-64 checksum of it all). A snapshot removes the copy's header before it rewrites the tensors and publishes the
new one (rename) after, so a copy cut short has no header: damaged, never taken for a complete one. DDP's state,
which every rank holds whole, is split among the node's ranks by bytes (`store.balanced_share`, by local rank): each
rank keeps its share, so the node holds the state twice; FSDP2's shards are each rank's own.

Restoring (collective, `restore`): the newest step of which every node holds a whole copy that fits this run (its
model, data, format and ranks: `layout.memory_copies` and `survey`), its copies checked against their checksums (each
by one rank of the node) and agreed; then each rank copies the tensors into its live model and optimizer state in
place. Anything wrong on any rank: every rank resumes from disk, rank 0 saying why in one line.

Cost: the copy of the rank's share, its checksum and the header, on the training thread (on a GPU the copy waits for
the step's kernels). `checkpoint.memory_interval=auto` times the first snapshots against the steps and keeps the cost
under `COST_SHARE` of the step time: a snapshot every step where that holds, else every few steps, alike on every rank
(decided after one timed snapshot where that one is far over on every rank: `EARLY`).
"""

from __future__ import annotations

import base64
import json
import logging
import math
import mmap
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch.distributed.tensor import DTensor

from trainer.checkpoint import store
from trainer.checkpoint.layout import FULL, MEMORY_DIR_ENV, human_bytes, memory_copies, memory_file
from trainer.config import Config
from trainer.model.distributed import DistContext, agree_any, gather_objects
from trainer.progress import restart_count

COST_SHARE = 0.02  # `auto`: a snapshot may cost this share of the step time
TIMED = 10  # `auto`: snapshots timed (after the first, which allocates) before the interval is decided
# `auto`: decided after one timed snapshot where, on every rank, that one took at least EARLY_S and asks an interval
# of at least EARLY steps (one copy of a large state, seconds on a GPU: far from the noise of a loaded machine, where a
# rank descheduled mid-copy makes a millisecond snapshot look like a tenth of a step)
EARLY, EARLY_S = 4, 0.25
SLOTS = 2  # copies per rank: the latest snapshot and the one before, whole while the next one is written
ALIGN = 64  # each tensor's offset in the copy: any dtype's view of it is aligned


@dataclass(frozen=True)
class Entry:
    """One tensor of a copy: where it lies in `local<i>.bin`."""

    name: str  # `model/<key>` or `optim/<parameter>/<state key>`
    dtype: str  # torch's name without the module: float32, bfloat16, ...
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def local_view(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a sharded parameter's (or its optimizer state's) local shard."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def live_tensors(state: store.TrainState) -> dict[str, torch.Tensor]:
    """Every tensor of the live model and optimizer state by name, as the tensors training updates in place (taken
    anew at each snapshot: a rollback or a resume replaces the optimizer's)."""
    tensors = {f"model/{key}": local_view(value) for key, value in state.model.state_dict().items()}
    names = {id(p): name for name, p in state.model.named_parameters()}
    for param, values in state.optimizer.state.items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim/{names[id(param)]}/{key}"] = local_view(value)
    return tensors


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def plan_layout(tensors: dict[str, torch.Tensor]) -> list[Entry]:
    entries, offset = [], 0
    for name, tensor in tensors.items():
        entries.append(Entry(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset,
                             nbytes(tensor)))
        offset += -(-nbytes(tensor) // ALIGN) * ALIGN
    return entries


def view(buffer: torch.Tensor, entry: Entry) -> torch.Tensor:
    return buffer[entry.offset:entry.offset + entry.nbytes].view(getattr(torch, entry.dtype)).view(entry.shape)


def encode(obj: Any) -> str:
    """What lies beside the tensors as JSON, its tensors (the RNG states) as the base64 of their bytes: a tenth of
    torch.save's time, which every snapshot paid (a quarter of its cost on the debug preset)."""
    def tensor(t: torch.Tensor) -> dict[str, Any]:
        return {"tensor": base64.b64encode(t.cpu().numpy().tobytes()).decode(), "dtype": str(t.dtype).removeprefix(
            "torch."), "shape": list(t.shape)}

    return json.dumps(obj, default=tensor)


def decode(text: str) -> Any:
    """`encode`'s object back, tuples as lists (the Python RNG's state is made a tuple again where it is set)."""
    def tensor(d: dict[str, Any]) -> Any:
        if d.keys() != {"tensor", "dtype", "shape"}:
            return d
        data = bytearray(base64.b64decode(d["tensor"]))
        return torch.frombuffer(data, dtype=getattr(torch, d["dtype"])).reshape(d["shape"]) if data else \
            torch.empty(d["shape"], dtype=getattr(torch, d["dtype"]))

    return json.loads(text, object_hook=tensor)


class MemoryCopy:
    """This rank's copies of the latest state in the node's shared memory, and the restore from the node's copies.
    Every rank holds one; `snapshot` and `restore` are called by every rank at the same steps."""

    def __init__(self, cfg: Config, ctx: DistContext, state: store.TrainState, cache_key: str,
                 log: logging.Logger) -> None:
        self.cfg, self.ctx, self.state, self.cache_key, self.log = cfg, ctx, state, cache_key, log
        folder = os.environ.get(MEMORY_DIR_ENV)
        setting = cfg.checkpoint.memory_interval
        self.folder = Path(folder) if folder and setting != 0 else None
        self.interval: int | None = setting if isinstance(setting, int) else None  # None: `auto`, not yet decided
        self.local_rank = ctx.env.local_rank
        self.local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        self.entries: list[Entry] = []
        self.listed = "[]"  # the entries as the header lists them (JSON, made once: they change only with the layout)
        # `share`'s split of the tensors among the node's ranks, by their names and sizes
        self.shares: dict[tuple[tuple[str, int], ...], set[str]] = {}
        # the mapped `local<i>.<slot>.bin`, and its entries' views (made once: a snapshot only copies into them)
        self.slots: list[tuple[mmap.mmap, list[torch.Tensor]]] = []
        self.next_slot = 0  # the one the next snapshot overwrites: never the latest complete one
        self.timed: list[tuple[float, float]] = []  # `auto`: (start, seconds) of each snapshot so far

    def path(self, local_rank: int, slot: int, suffix: str) -> Path:
        assert self.folder is not None
        return memory_file(self.folder, local_rank, slot, suffix)

    # -- snapshots ---------------------------------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        return self.folder is not None and (self.interval is None or step % self.interval == 0)

    def snapshot(self, step: int, meta: store.CheckpointMeta) -> None:
        """The state after `step` completed steps, copied into this rank's older copy, when one is due (collective the
        first time, when the copies are allocated, and once more under `auto`, when the interval is decided)."""
        if not self.due(step):
            return
        started = time.perf_counter()
        tensors = self.share(live_tensors(self.state))
        if not self.ready(tensors):
            return
        slot = self.next_slot
        mapped, targets = self.slots[slot]
        header = self.path(self.local_rank, slot, "json")
        try:
            header.unlink(missing_ok=True)  # until the new one is published, this copy is damaged, never complete
            with torch.no_grad():
                for entry, target in zip(self.entries, targets):
                    target.copy_(tensors[entry.name])
            extra = encode(self.beside_tensors())
            digest = xxhash.xxh3_64(memoryview(mapped)[:self.size])
            digest.update(extra.encode())
            tmp = header.with_suffix(".tmp")
            fields = json.dumps({
                "step": step, "slot": slot, "rank": self.ctx.rank, "world_size": self.ctx.world_size,
                "local_rank": self.local_rank, "local_world_size": self.local_world, "format": self.state.format,
                "bytes": self.size, "meta": vars(meta), "extra": extra, "xxh3_64": digest.hexdigest()})
            tmp.write_text(f'{fields[:-1]}, "entries": {self.listed}}}')
            tmp.rename(header)
        except OSError as e:  # the supervisor removed the folder (the run is ending), or it is full
            self.log.warning(f"[GPU {self.ctx.gpu_id}] memory snapshots stopped: {e.strerror or e} in {self.folder}; "
                             f"a restart resumes from the disk checkpoints")
            self.release()
            self.folder = None
            return
        self.next_slot = 1 - slot
        self.decide(started, time.perf_counter() - started)

    def share(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's part of the node's copy: its share of a state every rank holds whole (DDP), else all of it."""
        if self.state.format != FULL or self.local_world == 1:
            return tensors
        sizes = tuple((name, nbytes(t)) for name, t in tensors.items())
        if (mine := self.shares.get(sizes)) is None:
            mine = self.shares[sizes] = store.balanced_share(dict(sizes), self.local_rank, self.local_world)
        return {name: t for name, t in tensors.items() if name in mine}

    @property
    def size(self) -> int:
        return self.entries[-1].offset + self.entries[-1].nbytes if self.entries else 0

    def ready(self, tensors: dict[str, torch.Tensor]) -> bool:
        """The copies allocated for these tensors: at the first snapshot (every rank agrees: a node's copy without one
        rank's share is no copy) or when they changed. False where they could not be (snapshots are then off)."""
        entries = plan_layout(tensors)
        if [(e.name, e.dtype, e.shape) for e in entries] == [(e.name, e.dtype, e.shape) for e in self.entries]:
            return True
        first = not self.entries
        self.release()
        self.entries, self.listed = entries, json.dumps([asdict(e) for e in entries])
        problem = self.allocate()
        if first and agree_any(problem is not None, self.ctx):
            if self.ctx.is_main:
                self.log.warning(f"memory snapshots off: {problem or 'another rank could not allocate its copies'}; "
                                 f"a restart resumes from the disk checkpoints")
            self.release()
            self.folder = None
            return False
        if problem is not None:
            self.log.warning(f"[GPU {self.ctx.gpu_id}] memory snapshots stopped: {problem}")
            self.release()
            self.folder = None
            return False
        if first and self.ctx.is_main:
            self.log.info(f"memory snapshots in {self.folder}: 2 × {human_bytes(self.size)} per rank "
                          f"(checkpoint.memory_interval={self.cfg.checkpoint.memory_interval})")
        return True

    def allocate(self) -> str | None:
        """Map both `local<i>.<slot>.bin` at this copy's size, their pages reserved, and choose the older one for the
        next snapshot (after a restart, the copy it resumed from is kept until a newer one is complete); the problem,
        said, where they cannot be."""
        written = []
        for slot in range(SLOTS):
            path = self.path(self.local_rank, slot, "bin")
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
                try:
                    os.ftruncate(fd, self.size)
                    os.posix_fallocate(fd, 0, self.size)
                    mapped = mmap.mmap(fd, self.size)
                finally:
                    os.close(fd)
            except OSError as e:
                stat = os.statvfs(path.parent) if path.parent.is_dir() else None
                free = stat.f_bavail * stat.f_frsize if stat is not None else 0
                return (f"two copies of {human_bytes(self.size)} per rank do not fit in {path.parent} "
                        f"({e.strerror or e}; {human_bytes(free)} free)")
            buffer = torch.frombuffer(mapped, dtype=torch.uint8)
            self.slots.append((mapped, [view(buffer, entry) for entry in self.entries]))
            try:
                written.append(json.loads(self.path(self.local_rank, slot, "json").read_text())["step"])
            except (OSError, ValueError, KeyError, TypeError):
                written.append(-1)
        self.next_slot = written.index(min(written))
        return None

    def release(self) -> None:
        for mapped, _ in self.slots:
            mapped.close()
        self.slots, self.entries = [], []

    def beside_tensors(self) -> dict[str, Any]:
        """What a restore needs beside the tensors: the schedule, the gradient scaler, the optimizer's hyperparameters,
        this rank's RNGs."""
        state = self.state
        return {"scheduler": state.scheduler.state_dict(),
                "scaler": state.scaler.state_dict() if state.scaler is not None else None,
                "param_groups": [{k: v for k, v in group.items() if k != "params"}
                                 for group in state.optimizer.param_groups],
                "rng": store.rng_state(self.ctx.device)}

    def decide(self, started: float, seconds: float) -> None:
        """`auto`: after the first snapshots, the interval that keeps their cost under `COST_SHARE` of the step time,
        agreed on every rank (the largest wins: the copies of one node must be of the same steps). Where the first
        timed snapshot is already far too costly on every rank (`EARLY`, `EARLY_S`: a large model's state, seconds a
        copy on a GPU), that decides, rather than `TIMED` more snapshots at every step; both points are collective."""
        if self.interval is not None:
            return
        self.timed.append((started, seconds))
        if len(self.timed) not in (2, TIMED + 1):
            return
        timed = self.timed[1:]
        cost = statistics.median(s for _, s in timed)
        # between two snapshots' starts: the earlier snapshot, then a step
        step = statistics.median(b - a - s for (a, s), (b, _) in zip(self.timed, self.timed[1:]))
        mine = max(1, math.ceil(cost / (COST_SHARE * step))) if step > 0 else 1
        ranks = gather_objects((mine, cost), self.ctx)
        if len(self.timed) == 2 and not all(asks >= EARLY and took >= EARLY_S for asks, took in ranks):
            return
        self.interval = max(asks for asks, _ in ranks)
        if self.ctx.is_main:
            every = "every step" if self.interval == 1 else f"every {self.interval} steps"
            slowest = [r for r, (asks, _) in enumerate(ranks) if asks == self.interval]
            whose = f", as rank {slowest[0]}'s asks" if self.interval > mine else ""  # (these figures are rank 0's)
            self.log.info(f"memory snapshots {every}{whose}: {cost * 1000:.1f} ms each, {cost / step:.1%} of a "
                          f"{step * 1000:.0f} ms step (checkpoint.memory_interval=auto keeps it under "
                          f"{COST_SHARE:.0%})")

    def forget(self) -> None:
        """The live state was just loaded from disk: this rank's copies no longer hold its trajectory."""
        if self.folder is not None:
            for slot in range(SLOTS):
                self.path(self.local_rank, slot, "json").unlink(missing_ok=True)

    # -- restoring ---------------------------------------------------------------------------------------------------

    def restore(self, disk_step: int | None) -> store.CheckpointMeta | None:
        """Collective: the newest step of which every rank finds a whole copy of this run on its node (each rank checks
        its share of the copies), not older than the checkpoint on disk a resume would take (`disk_step`), loaded into
        the live model and optimizer; its meta, or None (rank 0 says why in one line where a copy was there, or a
        restart expected one)."""
        if self.folder is None:
            return None
        store.prime_optimizer(self.state)  # its state's tensors exist, to be named, checked and copied into
        live = live_tensors(self.state)
        try:
            copies, notes = self.survey(live)
        except OSError as e:
            copies, notes = {}, [f"{self.folder} cannot be read ({e.strerror or e})"]
        gathered = gather_objects((sorted(copies), notes), self.ctx)
        common = set.intersection(*(set(steps) for steps, _ in gathered))
        notes = [note for _, theirs in gathered for note in theirs]
        if not notes and not any(steps for steps, _ in gathered):  # nowhere a copy: a first start, or none taken yet
            if restart_count() > 0 and self.ctx.is_main:
                self.log.info(f"no memory copy in {self.folder} (no snapshot was taken before the failure)")
            return None
        step = max(common, default=None)
        if step is None:
            problem = notes[0] if notes else "the ranks' copies have no step in common (a node holds none)"
        elif disk_step is not None and step < disk_step:
            problem = f"its newest whole copy, of step {step}, is older than the checkpoint on disk (step {disk_step})"
        else:
            problem = self.agreed_damage(copies[step])
        if problem is not None:
            if self.ctx.is_main:
                self.log.warning(f"the memory copy in {self.folder} is not used: {problem}; resuming from disk")
            return None
        self.load(live, copies[step])
        return store.CheckpointMeta.from_dict(next(iter(copies[step].values()))["meta"])

    def survey(self, live: dict[str, torch.Tensor]) -> tuple[dict[int, dict[int, dict[str, Any]]], list[str]]:
        """The steps of which the node holds a whole copy that fits this run (the copies this rank loads: every local
        rank's share of a replicated state, or its own shards), each with its copies' headers by local rank; and why
        a copy found was left out, said."""
        assert self.folder is not None
        here = store.data_position(self.cfg, self.ctx.world_size)
        copies, notes = {}, []
        for step, headers in memory_copies(self.folder).items():
            own = {i: h for i, h in headers.items() if i == self.local_rank}
            needed = headers if self.state.format == FULL else own
            problem = next((p for i, h in needed.items() if (p := self.misfit(i, h, here, live)) is not None), None)
            names = {e["name"] for h in needed.values() for e in h["entries"]}
            if problem is None and (missing := sorted(set(live) - names)):
                problem = f"the copies of step {step} hold no {missing[0]} ({len(missing)} tensors missing)"
            if problem is not None:
                notes.append(problem)
            elif needed:
                copies[step] = needed
        if not copies and not notes and any(self.folder.glob("*.bin")):
            notes.append(f"no whole copy in {self.folder}: a header is missing (written once a snapshot is complete: "
                         f"a rank died during one, or the copy was removed)")
        return copies, notes

    def misfit(self, i: int, header: dict[str, Any], here: dict[str, int], live: dict[str, torch.Tensor]) -> str | None:
        """Why local rank `i`'s copy of its step is not of this run's model, data, format and ranks, or cut short,
        said; None where it fits."""
        where = self.path(i, header["slot"], "json")
        meta = store.CheckpointMeta.from_dict(header["meta"])
        if meta.cache_key != self.cache_key:
            return f"{where} is of another dataset"
        if meta.model_shapes != store.shape_signature(self.state.model) or header["format"] != self.state.format:
            return f"{where} is of another model or format"
        if store.sample_order(meta.data) != store.sample_order(here):
            return f"{where} is of another sample order ({meta.data})"
        if self.state.format != FULL and (header["rank"] != self.ctx.rank
                                          or header["world_size"] != self.ctx.world_size):
            return (f"{where} holds the shards of rank {header['rank']} of {header['world_size']}, this rank is "
                    f"{self.ctx.rank} of {self.ctx.world_size}")
        for e in header["entries"]:
            tensor = live.get(e["name"])
            if tensor is None or list(tensor.shape) != e["shape"] or str(tensor.dtype) != f"torch.{e['dtype']}":
                return f"{where}: {e['name']} does not fit this model's state"
        data = where.with_suffix(".bin")
        size = data.stat().st_size if data.exists() else 0
        if size < header["bytes"]:
            return f"{data} is {size:,} bytes, its header needs {header['bytes']:,}"
        return None

    def agreed_damage(self, headers: dict[int, dict[str, Any]]) -> str | None:
        """Collective: the copies of one step checked against their headers' checksums, each by one rank of the node
        (every byte read once); the first damage found on any rank, on every rank alike."""
        mine = [i for i in headers if self.state.format != FULL or i % self.local_world == self.local_rank]
        problem = next((p for i in mine if (p := self.damage(i, headers[i])) is not None), None)
        return next((p for p in gather_objects(problem, self.ctx) if p is not None), None)

    def damage(self, i: int, header: dict[str, Any]) -> str | None:
        path = self.path(i, header["slot"], "bin")
        try:
            with open(path, "rb") as f, mmap.mmap(f.fileno(), header["bytes"], access=mmap.ACCESS_READ) as data:
                digest = xxhash.xxh3_64(data)
        except (OSError, ValueError) as e:
            return f"{path} cannot be read ({e})"
        digest.update(header["extra"].encode())
        if digest.hexdigest() != header["xxh3_64"]:
            return f"{path} has checksum {digest.hexdigest()}, its header recorded {header['xxh3_64']}"
        return None

    def load(self, live: dict[str, torch.Tensor], headers: dict[int, dict[str, Any]]) -> None:
        """Copy the checked copies into the live state in place, then what lies beside the tensors (the RNGs only on
        the rank that wrote them, in a world of the same size)."""
        with torch.no_grad():
            for i, header in headers.items():
                entries = [Entry(e["name"], e["dtype"], tuple(e["shape"]), e["offset"], e["nbytes"])
                           for e in header["entries"]]
                path = self.path(i, header["slot"], "bin")
                with open(path, "rb") as f, mmap.mmap(f.fileno(), header["bytes"], access=mmap.ACCESS_COPY) as data:
                    buffer = torch.frombuffer(data, dtype=torch.uint8)
                    for entry in entries:
                        live[entry.name].copy_(view(buffer, entry))
                    del buffer
        own = headers.get(self.local_rank) or next(iter(headers.values()))
        extra = decode(own["extra"])
        state = self.state
        state.scheduler.load_state_dict(extra["scheduler"])
        if state.scaler is not None and extra["scaler"]:
            state.scaler.load_state_dict(extra["scaler"])
        for group, saved in zip(state.optimizer.param_groups, extra["param_groups"]):
            group.update(saved)
        if own["rank"] == self.ctx.rank and own["world_size"] == self.ctx.world_size:
            version, internal, gauss = extra["rng"]["python"]
            store.set_rng_state({**extra["rng"], "python": (version, tuple(internal), gauss)}, self.ctx.device)
