"""Config-driven fault injection, for the test suite and for users rehearsing their cluster.

Two kinds, both off by default and set with ``--set debug.<key>=<value>``:

* **NaN injection** — ``inject_nan_module`` (a name from ``model.named_modules()``, e.g. ``model.layers.1.mlp``),
  ``inject_nan_step``, ``inject_nan_rank``: that module's forward output is multiplied by NaN at that step on that
  rank. Multiplying (rather than overwriting) keeps the autograd graph, so the NaN flows on through the rest of the
  forward pass *and* back through backward into the gradients, as a real overflow would. Only training-mode forwards
  are touched, so an evaluation run at the same step stays clean.
* **Process faults** — ``inject_fault`` (``raise | exit | sigkill | segv | hang | slow | oom | gpu_lost``),
  ``inject_fault_step``, ``inject_fault_rank`` and ``inject_fault_code`` (the exit status for ``exit``). By default
  (``inject_fault_during=step``) they fire at the start of that optimizer step, before its first micro-batch, so
  every other rank is left waiting in that step's collectives — exactly the situation the supervisor has to detect
  and clean up. With ``inject_fault_during=checkpoint`` they fire instead inside the checkpoint save that follows that
  step, once its temporary files are written and before they are published: the moment a crash must never leave a
  checkpoint that looks complete (a step no checkpoint follows is refused with the config, `check_injection`). The
  save's other phases can be aimed at too: ``staging`` (its temporary folder made, the state not yet copied off the
  live tensors; on the training thread) and ``publishing`` (every file written, meta.json too, just before the
  rename). A save written in the background (``checkpoint.async_save``) meets the last two on its writer thread, while
  training goes on.
  Two kinds rehearse the operator's diagnoses rather than a crash: ``slow`` sleeps ``inject_fault_delay_s`` before
  every step from ``inject_fault_step`` on (a straggler), and ``oom`` raises ``torch.OutOfMemoryError`` from a forward
  hook on the model in that step (as the caching allocator would), so the out-of-memory report runs on CPU ranks too.
  ``gpu_lost`` rehearses a GPU fault: the rank dies with the CUDA error a broken device gives, and its GPU reads as
  lost in the fake NVML state from then on (``SUPERVISOR_FAKE_GPU_STATE``, `fake_gpu_state`), so the supervisor's
  diagnosis and exclusion run on CPU ranks that pretend to be GPUs. ``corrupt`` rehearses a device that computes a
  wrong result once: the input embeddings' output of that step on that rank is multiplied by NaN the first time only,
  so the step is non-finite and its recompute (``training.nan_recompute``) is not.

A loss spike: ``inject_spike_step`` multiplies the loss of that step's batch by ``inject_spike_scale`` on every rank,
forward and backward alike. The step is the batch's (`trainer.data.batches.data_step`): the run meets it at that
loop step unless batches were skipped before it, and a rollback that skips it never meets it again, as with a bad
batch of the corpus.

A third rehearses a slow disk at its worst: ``inject_write_stall_step`` holds the checkpoint after that step, written
in the background on ``inject_fault_rank``, before it writes anything, until training waits for it (the next save, a
stop, the end of the run, or the rank's failure). The write is then certainly in flight at whatever comes meanwhile
(a signal, a fault at a later step: it composes with ``inject_fault``), and what waits for it says so.

``inject_fault_restart`` limits a process fault (and the stall) to one group of a supervised run (0: the first, n:
after the n-th restart, `trainer.progress.restart_count`); by default it fires in every group that reaches its step.

Steps are the loop's own step numbers (whatever ``before_step`` and ``during_checkpoint`` are called with).
"""

from __future__ import annotations

import ctypes
import difflib
import faulthandler
import os
import signal
import sys
import threading
import time
from typing import Any

import torch

from trainer.config import DebugConfig, check_injection
from trainer.diagnosis import fake_gpu_state
from trainer.errors import UserError
from trainer.progress import gpu_id, restart_count

# What CUDA reports once a device's memory has failed (cudaErrorECCUncorrectable), in PyTorch's words; one of the
# texts `supervisor.diagnosis.gpu_fault` takes for a device that is gone
GPU_LOST_ERROR = "CUDA error: uncorrectable ECC error encountered"


def poison(output: Any) -> Any:
    """``output`` with every floating-point tensor multiplied by NaN; tuples, lists and dicts keep their shape."""
    if isinstance(output, torch.Tensor):
        return output * float("nan") if output.is_floating_point() else output
    if isinstance(output, tuple) and hasattr(output, "_fields"):  # a namedtuple
        return type(output)(*(poison(item) for item in output))
    if isinstance(output, (tuple, list)):
        return type(output)(poison(item) for item in output)
    if isinstance(output, dict):  # includes transformers' ModelOutput, which supports item assignment
        for key in list(output.keys()):
            output[key] = poison(output[key])
        return output
    return output


class FaultInjector:
    """Config-driven fault injection (``debug.inject_*``); a no-op unless one of them is set."""

    def __init__(self, debug: DebugConfig, rank: int) -> None:
        self.debug = debug
        self.rank = rank
        self.step: int | None = None
        self.nan_on = debug.inject_nan_module is not None or debug.inject_nan_step is not None
        this_group = debug.inject_fault_restart in (None, restart_count())
        self.fault_on = (debug.inject_fault is not None or debug.inject_fault_step is not None) and this_group
        self.stall_on = debug.inject_write_stall_step is not None and this_group
        self.spike_on = debug.inject_spike_step is not None
        check_injection(debug)  # the config's own validation ran it too; a DebugConfig built by hand may not have
        self.enabled = self.nan_on or self.fault_on or self.stall_on or self.spike_on
        self.hook: torch.utils.hooks.RemovableHandle | None = None
        self.data_step: int | None = None  # the batch of the step under way (after skipped batches)
        self.corrupted = False  # `corrupt` fires once

    def describe(self) -> str | None:
        """The banner line that makes a run with injection on say so; None when off."""
        if not self.enabled:
            return None
        d = self.debug
        parts = []
        if self.nan_on:
            parts.append(f"NaN in {d.inject_nan_module} output at step {d.inject_nan_step} on rank {d.inject_nan_rank}")
        if self.fault_on:
            if d.inject_fault == "slow":
                parts.append(f"slow ({d.inject_fault_delay_s:g} s before every step) from step {d.inject_fault_step} "
                             f"on rank {d.inject_fault_rank}")
            else:
                code = f" (code {d.inject_fault_code})" if d.inject_fault == "exit" else ""
                group = {None: "", 0: " (first group only)"}.get(d.inject_fault_restart,
                                                                  f" (after restart {d.inject_fault_restart} only)")
                parts.append(f"{d.inject_fault}{code} {self.where(d.inject_fault_step)} on rank {d.inject_fault_rank}"
                             f"{group}")
        if self.stall_on:
            parts.append(f"the checkpoint write after step {d.inject_write_stall_step} stalls on rank "
                         f"{d.inject_fault_rank} until training waits for it")
        if self.spike_on:
            parts.append(f"the loss of step {d.inject_spike_step}'s batch × {d.inject_spike_scale:g} on every rank")
        return "fault injection ON: " + "; ".join(parts)

    def attach(self, model: torch.nn.Module) -> None:
        """Hook the named module of the *unwrapped* model (before DDP/FSDP, whose wrappers change the names)."""
        if self.fault_on and self.debug.inject_fault == "oom" and self.rank == self.debug.inject_fault_rank:
            model.register_forward_pre_hook(self._raise_oom)
        if self.fault_on and self.debug.inject_fault == "corrupt" and self.rank == self.debug.inject_fault_rank:
            model.get_input_embeddings().register_forward_hook(self._corrupt_once)
        if not self.nan_on:
            return
        name = self.debug.inject_nan_module
        modules = dict(model.named_modules())
        if name not in modules:
            names = [n for n in modules if n]
            matches = difflib.get_close_matches(str(name), names, n=3, cutoff=0.6)
            hint = (f"did you mean {', '.join(repr(m) for m in matches)}?" if matches
                    else f"names look like {', '.join(names[:4])}, ...")
            raise UserError(f"debug.inject_nan_module: the model has no module '{name}'; {hint}")
        # prepend: run before any other forward hook on this module (the NaN guard's), so they see the NaN output
        self.hook = modules[name].register_forward_hook(self._inject_nan, prepend=True)

    def _inject_nan(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        if (module.training and self.step == self.debug.inject_nan_step
                and self.rank == self.debug.inject_nan_rank):
            return poison(output)
        return None

    def _corrupt_once(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        if module.training and self.step == self.debug.inject_fault_step and not self.corrupted:
            self.corrupted = True
            return poison(output)
        return None

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The micro-batch's loss, multiplied by `inject_spike_scale` when this is the spike's batch."""
        if self.spike_on and self.data_step == self.debug.inject_spike_step:
            return loss * self.debug.inject_spike_scale
        return loss

    def _raise_oom(self, module: torch.nn.Module, args: Any) -> None:
        if module.training and self.step == self.debug.inject_fault_step and self.debug.inject_fault_during == "step":
            raise torch.OutOfMemoryError(f"injected out-of-memory error at step {self.step} on rank {self.rank}")

    def lose_gpu(self, where: str) -> None:
        """Mark this rank's GPU lost in the fake NVML state (when the test seam is on), then fail as CUDA does."""
        state, gpu = os.environ.get(fake_gpu_state.FAKE_STATE_ENV), gpu_id()
        if state and gpu is not None:
            fake_gpu_state.mark(state, int(gpu), lost=True)
        raise RuntimeError(f"{GPU_LOST_ERROR} (injected {where} on rank {self.rank})")

    def where(self, step: int | None) -> str:
        """Where the process fault fires, in the words the banner and the fault's own message use."""
        during = self.debug.inject_fault_during
        if during == "checkpoint":
            return f"during the checkpoint after step {step}"
        if during != "step":
            return f"while {during} the checkpoint after step {step}"
        return f"at step {step}"

    def before_step(self, step: int, data_step: int | None = None) -> None:
        """Record the step for the NaN hook (and its batch's, `data_step`, for the spike); fire a step fault when this
        is its step and rank."""
        self.step = step
        self.data_step = step if data_step is None else data_step
        d = self.debug
        if (self.fault_on and d.inject_fault == "slow" and self.rank == d.inject_fault_rank
                and step >= (d.inject_fault_step or 0)):
            time.sleep(d.inject_fault_delay_s)
        elif d.inject_fault_during == "step":
            self._fire_if_due(step)

    def during_checkpoint(self, step: int, phase: str = "checkpoint") -> None:
        """Called by the checkpoint save that follows `step` as it reaches each phase: `staging`, `checkpoint` (files
        written, nothing published yet), `publishing` (just before the rename)."""
        if self.debug.inject_fault_during == phase:
            self._fire_if_due(step)

    def stall_write(self, step: int, awaited: threading.Event) -> None:
        """On the writer thread, before the background write of the checkpoint after `step` begins: with
        `inject_write_stall_step` at this step and rank, hold until `awaited` (training waits for the write)."""
        d = self.debug
        if not self.stall_on or step != d.inject_write_stall_step or self.rank != d.inject_fault_rank:
            return
        print(f"fault injection: the checkpoint write after step {step} stalls on rank {self.rank} until training "
              f"waits for it", file=sys.stderr, flush=True)
        awaited.wait()

    def _fire_if_due(self, step: int) -> None:
        d = self.debug
        if not self.fault_on or step != d.inject_fault_step or self.rank != d.inject_fault_rank:
            return
        where = self.where(step)
        print(f"fault injection: {d.inject_fault} {where} on rank {self.rank}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        if d.inject_fault == "raise":
            raise RuntimeError(f"injected fault {where} on rank {self.rank}")
        if d.inject_fault == "exit":
            os._exit(d.inject_fault_code)
        if d.inject_fault == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if d.inject_fault == "segv":
            # faulthandler's helper raises a real SIGSEGV (so a registered faulthandler prints the stack);
            # reading address 0 is the fallback where the private helper is missing
            getattr(faulthandler, "_sigsegv", lambda: ctypes.string_at(0))()
        if d.inject_fault == "gpu_lost":
            self.lose_gpu(where)
        if d.inject_fault == "hang":
            while True:  # no progress, no exit; a SIGTERM handler that only sets a flag does not end it
                time.sleep(3600)
