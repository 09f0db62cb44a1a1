"""A checkpoint written in the background: one daemon thread per save, at most one in flight, and the staging buffers
it writes from.

Training blocks only while a save is staged (`store.stage`: the tensors copied into host memory, pinned on GPUs, by
DCP's `StateDictStager` through `HostStager`, which keeps its buffers from one save to the next: one copy of this
rank's model and optimizer state for the whole run). The write (`store.write`: DCP's shards, state.pt, the agreement
that every rank's files are written, the rename) then runs on a thread whose collectives use the writer group, never
the loop's.

How a write ends decides when the training thread hears of it:

* a failure every rank is told of (a full disk, any failure of DCP's write, which DCP reports to every rank) is
  raised by every rank at the next point where all of them wait for the write (the next save, the end of the run, a
  stop): together, so that no rank is left waiting in a collective for one that has given up;
* anything else (an injected fault, a bug) is this rank's own failure and is raised at the next step boundary, as an
  exception in the step would be.

A rank that fails (an exception leaves the loop) with a write in flight lets it end before it leaves, for as long as
a collective may take (`Checkpointer.settle`): the other ranks' writers go on meanwhile (their training threads wait
in the step for this rank, which is still there), so a failure a step after an interval save does not lose it. A rank
killed outright takes its part of the write with it: the other ranks fail on the lost peer and leave without waiting
for their writers (whose next collective may wait for it the writer group's whole timeout), and the unpublished
`.tmp-` folder (removed by rank 0's writer if it failed first, else by the next save) is never taken for a
checkpoint. The thread is a daemon, so nothing else keeps a leaving process waiting for it.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint._state_dict_stager import StateDictStager

from trainer.checkpoint.store import WriteFailed
from trainer.errors import UserError

COLLECTIVE_FAILURES = (UserError, WriteFailed)  # raised alike on every rank (`store.raise_if_main_failed`)


class HostStager:
    """DCP's `StateDictStager` for this rank's device (pinned host buffers and non-blocking copies from a GPU, so the
    copy costs the device-to-host bandwidth only; plain host buffers on a CPU rank), handed the tensors alone.

    The stager keeps one host buffer per tensor storage it has copied, reused at every later stage, until `close`.
    DCP's public wrapper around it, `DefaultStager`, is not used: some releases (torch 2.11) close the stager after
    every stage, which empties both that cache (each save would allocate its pinned buffers again) and the table its
    copy walks by, so that the second save fails with `KeyError: <class 'type'>`. The stager gets one flat dict of the
    state's tensors; the containers around them (dicts, lists, tuples) are rebuilt here and the other leaves (numbers,
    strings, RNG states), which training replaces rather than changes in place, are kept as they are."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.cuda = device, device.type == "cuda"
        self.stager = StateDictStager(pin_memory=self.cuda, share_memory=False)

    def stage(self, state: Any) -> Any:
        """A copy of `state` whose tensors are in host memory (the stager's buffers, reused from save to save)."""
        tensors: list[torch.Tensor] = []
        skeleton = _hollow(state, tensors)
        copies = self.stager.stage({str(i): t for i, t in enumerate(tensors)}, non_blocking=self.cuda)
        if self.cuda:  # the copies were queued on the current stream: done before anything reads them
            torch.cuda.current_stream(self.device).synchronize()
        return _fill(skeleton, [copies[str(i)] for i in range(len(tensors))])

    def close(self) -> None:
        self.stager.close()


class _Slot(int):
    """Where a tensor stood in a hollowed state: its index in the list of tensors taken out."""


def _hollow(x: Any, tensors: list[torch.Tensor]) -> Any:
    """`x` with each tensor replaced by its `_Slot` (appended to `tensors`); containers copied, leaves kept."""
    if isinstance(x, torch.Tensor):
        tensors.append(x)
        return _Slot(len(tensors) - 1)
    if isinstance(x, dict):
        out = copy.copy(x)  # a dict subclass keeps its attributes (a module state dict's `_metadata`)
        for key, value in x.items():
            out[key] = _hollow(value, tensors)
        return out
    if isinstance(x, (list, tuple)):
        items = [_hollow(value, tensors) for value in x]
        return items if isinstance(x, list) else _tuple_like(x, items)
    return x


def _fill(x: Any, copies: list[torch.Tensor]) -> Any:
    """The hollowed state with each `_Slot` replaced by its tensor's copy (in place: the skeleton is ours)."""
    if isinstance(x, _Slot):
        return copies[x]
    if isinstance(x, dict):
        for key, value in x.items():
            x[key] = _fill(value, copies)
        return x
    if isinstance(x, list):
        x[:] = [_fill(value, copies) for value in x]
        return x
    if isinstance(x, tuple):
        return _tuple_like(x, [_fill(value, copies) for value in x])
    return x


def _tuple_like(x: tuple, items: list[Any]) -> tuple:
    """A tuple of `x`'s type holding `items`: a named tuple takes them as arguments, any other tuple as one."""
    return type(x)(*items) if hasattr(type(x), "_fields") else type(x)(items)


class BackgroundWrite:
    """`job(awaited)` running on a daemon thread; `wait` joins it and raises what it raised. `awaited` is set once
    the training thread waits for the write (debug.inject_write_stall_step holds a write until then)."""

    def __init__(self, name: str, job: Callable[[threading.Event], Any]) -> None:
        self.name = name
        self.error: BaseException | None = None
        self.started = time.perf_counter()
        self.awaited = threading.Event()
        self.thread = threading.Thread(target=self.run, args=(job,), name=f"checkpoint-writer {name}", daemon=True)
        self.thread.start()

    def run(self, job: Callable[[threading.Event], Any]) -> None:
        try:
            job(self.awaited)
        except BaseException as e:  # handed to the training thread, which raises it
            self.error = e

    def done(self) -> bool:
        return not self.thread.is_alive()

    def raise_own_failure(self) -> None:
        """At a step boundary: this rank's own failure in the write (not one every rank was told of) ends the rank
        now, as a failure in the step would."""
        if self.done() and self.error is not None and not isinstance(self.error, COLLECTIVE_FAILURES):
            raise self.error

    def wait(self) -> float:
        """Join the write; seconds waited. Raises what the write raised (every rank alike for a collective failure)."""
        started = time.perf_counter()
        self.awaited.set()
        self.thread.join()
        if self.error is not None:
            raise self.error
        return time.perf_counter() - started

    def wait_at_most(self, seconds: float) -> bool:
        """Join the write for up to `seconds`, raising nothing (a failing rank's last look at it); True once it
        ended."""
        self.awaited.set()
        self.thread.join(seconds)
        return self.done()
