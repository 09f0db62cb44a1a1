"""The NaN/Inf guard: skip non-finite optimizer steps without stalling the GPU, and find where a NaN was born.

Production mode (every preset)
    ``check`` turns the local loss and the pre-clip gradient norm into device-side flags, all-gathers them with the
    local loss itself (one tiny collective, no host read), so every rank holds the same ``found_inf``, and at the next
    log step the same mean loss of every step (``take_losses``: what the loss-spike detector judges). ``step_optimizer`` hands ``found_inf`` to
    a fused optimizer (the ``optimizer.found_inf`` attribute that ``torch.amp.GradScaler`` uses with optimizers whose
    ``_step_supports_amp_scaling`` is set, e.g. ``AdamW(fused=True)``): the kernel leaves weights, ``exp_avg``,
    ``exp_avg_sq`` and ``step`` untouched when it is 1 — the skip costs no host synchronisation. A non-fused optimizer
    falls back to one host read of ``found_inf`` per step (``if not found_inf: optimizer.step()``). Each step's flags
    stay on the device until the next log step, where the loop syncs anyway: ``on_log`` reads them all in one transfer,
    returns a line per skipped step naming the GPU(s) whose local loss was non-finite, and raises ``NonFiniteError``
    (every rank at the same log step, since the flags are identical everywhere) once ``debug.max_nonfinite_steps``
    consecutive steps were non-finite, after a dump. Before that, ``recheck`` (the loop's recompute of a non-finite
    step, `trainer.diagnosis.recompute`) is handed the non-finite steps just read, on every rank alike. In production the gradients of a skipped step are already freed
    by then, so that dump holds the weights, the batch and a resumable checkpoint: resume from it with ``--debug`` to
    localise the NaN.

    With a ``GradScaler`` (fp16) pass ``scaler=`` to ``step_optimizer``: the guard's flag is merged into the scaler's
    own per-device inf flags, so one ``scaler.step`` skips on either and ``scaler.update`` lowers the scale. A step
    whose only fault is a gradient overflow while the loss scale is above 1 is the scaler's routine business: it is
    skipped and logged but does not count towards ``max_nonfinite_steps``.

Debug mode (``cfg.debug.nan_localize``; the debug preset, ``--debug``)
    A forward hook on every module records device-side statistics (min/max/mean of the finite values, NaN and Inf
    counts) of its first tensor input and of every floating-point tensor it returns; a post-accumulate-grad hook on
    every parameter copies its *local* gradient to host memory before the data-parallel all-reduce and before
    clipping (a NaN total norm makes clipping multiply every gradient by NaN, which would hide where it started).
    ``after_step`` syncs every step; on a non-finite step the ranks concerned (local loss or local gradients
    non-finite; rank 0 when only the all-reduced norm is) print the NaN report, naming every parameter with NaN/Inf
    gradients and the first module, in execution order, whose forward output went non-finite. Debug mode keeps a host
    copy of the local gradients (4 bytes per parameter): it is meant for small models. Under FSDP2 the hook sees
    this rank's gradient shard after the reduce-scatter (still before clipping), which mixes every rank's
    gradients, so only the local loss tells which rank went non-finite.

Dump files (debug mode with ``debug.nan_dump``, and always when the run stops)
    ``<checkpoint.dir>/nan_grad_step_<step>.pt`` — written through the loop's ``save_checkpoint``, which every rank
    calls at the same step with the same path (it may be a collective: ``trainer.checkpoint.store.save``); the run can
    resume from it. The weights in it are the pre-step ones: a skipped step never touched them. (At a production
    stop, <step> is the log step where the run stopped: the state it holds.)
    ``<checkpoint.dir>/debug/nan_debug_step_<step>.pkl`` — a pickle of a dict: ``parameters`` and ``gradients``
    (parameter name → numpy array, float32 for half precision; under FSDP this rank's shards), ``step``, ``gpu_id``,
    ``rank``, ``loss``, ``grad_norm``, ``batch`` (this rank's token ids), ``first_nonfinite_module`` (name, type and
    statistics, or None), ``nonfinite_modules``, ``loss_nonfinite_gpus``, ``gradients_source``. Written by each rank
    concerned, atomically (temporary file + rename). When several ranks dump the same step, each file name carries
    its GPU id: ``nan_debug_step_3_gpu1.pkl``. The report text also goes to
    ``<run dir>/nan_report_step_<step>[_gpu<id>].txt``.

That the production path adds no host synchronisation is checked with ``trainer.diagnosis.host_sync.HostSyncCounter``.
The report's text and the helpers the dumps are written with are in ``trainer/diagnosis/nan_report.py``.

Length: one mechanism whose parts share the guard's state across a step (the device-side check, the skipped step,
the debug mode's hooks that localise the first non-finite module); the report and dumps are `nan_report`'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from trainer.config import Config
from trainer.diagnosis.nan_report import (
    ForwardFault,
    NonFiniteStep,
    report_text,
    shown_path,
    to_host,
    write_pickle_atomically,
)

FLAG_LOSS, FLAG_NORM, FLAG_LOCAL_GRAD = 0, 1, 2  # the per-rank flags check() gathers
FLAGS_PER_RANK = 3
GATHERED_PER_RANK = FLAGS_PER_RANK + 1  # the flags, then the rank's local loss
STAT_FIELDS = ("min", "max", "mean", "nan", "inf", "numel")  # tensor_stats' layout
LOCAL_GRADIENTS = "local, before the all-reduce and clipping"
SHARDED_GRADIENTS = "this rank's shards, after the reduce-scatter (FSDP2)"
# torch >= 2.13 names it all_gather_single; older releases only have all_gather_into_tensor
ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class NonFiniteError(RuntimeError):
    """Raised on every rank after ``debug.max_nonfinite_steps`` consecutive non-finite steps."""


# ---------------------------------------------------------------------------------------------------------------------
# Small tensor helpers


def floating_tensors(obj: Any) -> list[torch.Tensor]:
    """Every floating-point tensor inside a module's output (tensor, tuple, list, dict or transformers ModelOutput)."""
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.is_floating_point() else []
    if isinstance(obj, (tuple, list)):
        return [t for item in obj for t in floating_tensors(item)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in floating_tensors(item)]
    return []


def first_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """A module's main input: its first tensor argument, positional first (hidden states, or token ids)."""
    return next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)


def tensor_stats(tensors: list[torch.Tensor]) -> torch.Tensor:
    """[min, max, mean of the finite values, NaN count, Inf count, numel] as one float32 tensor, computed on the
    tensors' device without a host read (so the debug hooks never stall the GPU)."""
    rows = []
    for t in tensors:
        t = t.detach() if t.is_floating_point() else t.detach().float()  # token ids: statistics of the ids
        if t.numel() == 0:
            continue
        finite = torch.isfinite(t)
        rows.append(torch.stack([
            t.masked_fill(~finite, float("inf")).amin().float(),
            t.masked_fill(~finite, float("-inf")).amax().float(),
            torch.where(finite, t, 0).sum(dtype=torch.float32),
            torch.isnan(t).sum().float(),
            torch.isinf(t).sum().float(),
            t.new_tensor(t.numel(), dtype=torch.float32),
        ]))
    if not rows:
        return torch.tensor([float("inf"), float("-inf"), 0.0, 0.0, 0.0, 0.0])
    r = torch.stack([row.to(rows[0].device) for row in rows])
    finite_count = (r[:, 5] - r[:, 3] - r[:, 4]).sum().clamp(min=1)
    return torch.stack([r[:, 0].amin(), r[:, 1].amax(), r[:, 2].sum() / finite_count,
                        r[:, 3].sum(), r[:, 4].sum(), r[:, 5].sum()])


# ---------------------------------------------------------------------------------------------------------------------
# Bookkeeping


@dataclass
class StepRecord:
    """One optimizer step as the device saw it; read back to the host in batches."""
    step: int
    values: torch.Tensor  # gathered flags and local losses (world × 4), then overflow, local loss, grad norm
    batch: torch.Tensor | None


# ---------------------------------------------------------------------------------------------------------------------
# The guard


class NanGuard:
    """Detects non-finite steps on the device, skips them in the optimizer, and reports (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, cfg: Config, *, rank: int, world_size: int, gpu_id: str,
                 device: torch.device, run_dir: Path, checkpoint_dir: Path) -> None:
        self.model = model
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.gpu_id = str(gpu_id)
        self.device = torch.device(device)
        self.run_dir = Path(run_dir)
        self.checkpoint_dir = Path(checkpoint_dir)
        self.debug_mode = cfg.debug.nan_localize
        self.max_consecutive = cfg.debug.max_nonfinite_steps
        self.distributed = world_size > 1 and dist.is_available() and dist.is_initialized()
        self.gpu_ids = self.gather_gpu_ids()

        self.skipped_steps = 0
        self.consecutive = 0
        self.streak_start: int | None = None
        self.stop: NonFiniteStep | None = None  # the step that reached the limit
        self.stop_streak = (0, 0)  # (first step, length) of the streak that reached it
        self.log_lines: list[str] = []
        self.pending: list[StepRecord] = []
        self.step = 0
        self.batch: torch.Tensor | None = None
        self.flags: torch.Tensor | None = None  # this step's gathered flags and losses (world × 4), set by check()
        self.keeps_losses = cfg.training.spike_threshold > 0  # for the spike detector
        self.losses: list[tuple[int, float]] = []  # (step, mean loss over the ranks) of each step read, for take_losses
        # the loop's recompute of the non-finite steps read (every rank calls it at the same point), and those
        # read since it last ran
        self.recheck: Callable[[list[NonFiniteStep]], list[str]] | None = None
        self.unjudged: list[NonFiniteStep] = []
        self.loss_value = self.norm_value = torch.zeros((), device=self.device)
        self.no_local_grad_flag = torch.zeros((), dtype=torch.float32, device=self.device)
        self.save_checkpoint: Callable[[Path], Any] | None = None
        self.dumped_steps: set[int] = set()
        self.dump_paths: dict[int, list[str]] = {}  # step → files written for it, for the stop message

        # debug mode: forward records (name, type, device stats) and host copies of the local gradients
        self.forward_names: list[tuple[str, str]] = []
        self.forward_stats: list[torch.Tensor] = []
        self.grad_snapshots: dict[str, np.ndarray] = {}
        self.gradients_source = LOCAL_GRADIENTS
        self.hooks: list[Any] = []
        if self.debug_mode:
            self.install_debug_hooks()

    def gather_gpu_ids(self) -> list[str]:
        """Every rank's GPU id, once at start-up, so a log line can name the GPU whose loss went non-finite."""
        if not self.distributed:
            return [self.gpu_id]
        ids: list[Any] = [None] * self.world_size
        dist.all_gather_object(ids, self.gpu_id)
        return [str(i) for i in ids]

    # -- debug hooks ------------------------------------------------------------------------------------------------

    def install_debug_hooks(self) -> None:
        for name, module in self.model.named_modules():
            label = name or type(module).__name__
            self.hooks.append(module.register_forward_hook(self.forward_hook(label), with_kwargs=True))
        for name, param in self.model.named_parameters():
            if param.requires_grad:
                self.hooks.append(param.register_post_accumulate_grad_hook(self.grad_hook(name)))

    def forward_hook(self, name: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            outputs = floating_tensors(output)
            if not (module.training and torch.is_grad_enabled() and outputs):
                return  # evaluation passes and modules without float outputs say nothing about this step
            main_input = first_tensor(args, kwargs)
            stats_in = tensor_stats([main_input] if main_input is not None else [])
            self.forward_names.append((name, type(module).__name__))
            self.forward_stats.append(torch.cat([stats_in.to(outputs[0].device), tensor_stats(outputs)]))
        return hook

    def grad_hook(self, name: str) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            if param.grad is None:
                return
            if hasattr(param.grad, "to_local"):  # FSDP2 calls the hook itself, after reducing into the shard
                self.gradients_source = SHARDED_GRADIENTS
            self.grad_snapshots[name] = to_host(param.grad)  # per micro-batch: the last one holds the accumulated sum
        return hook

    def remove_hooks(self) -> None:
        for handle in self.hooks:
            handle.remove()
        self.hooks.clear()

    # -- the per-step interface -------------------------------------------------------------------------------------

    def start_step(self, step: int, batch: torch.Tensor) -> None:
        self.step = step
        self.batch = batch
        if self.debug_mode:
            self.forward_names.clear()
            self.forward_stats.clear()
            self.grad_snapshots.clear()
            self.gradients_source = LOCAL_GRADIENTS

    def check(self, local_loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """``found_inf`` (float32 on the device, identical on every rank): 1.0 when any rank's local loss or the
        gradient norm is non-finite. One all-gather of three flags per rank; no host read in production."""
        local_loss = local_loss.detach().to(self.device)
        grad_norm = grad_norm.detach().to(self.device)
        local_grad_flag = self.no_local_grad_flag
        if self.debug_mode:
            local_grad_flag = torch.tensor(float(self.local_gradients_nonfinite()), device=self.device)
        local = torch.stack([(~torch.isfinite(local_loss)).float(), (~torch.isfinite(grad_norm)).float(),
                             local_grad_flag, local_loss.float()])
        self.flags = self.gather(local)
        self.loss_value = local_loss.float()
        self.norm_value = grad_norm.float()
        return self.flags[:, :FLAGS_PER_RANK].amax()

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        if not self.distributed:
            return local.unsqueeze(0)
        out = torch.empty(self.world_size * local.numel(), dtype=local.dtype, device=local.device)
        ALL_GATHER_SINGLE(out, local)  # the concatenated form: gloo does not take the stacked one
        return out.view(self.world_size, local.numel())

    def local_gradients_nonfinite(self) -> bool:
        """Debug mode: were this rank's own gradients non-finite? Known only from the grad hooks' host copies of
        local gradients. Reduced shards (FSDP2) hold every rank's contribution, so they say nothing about this
        rank alone: False. Where no hook fired, copy the gradients as they stand now (after clipping) for the report."""
        if not self.grad_snapshots:
            self.grad_snapshots = {name: to_host(p.grad) for name, p in self.model.named_parameters()
                                   if p.grad is not None}
            self.gradients_source = "as they stand after clipping"
        if self.gradients_source != LOCAL_GRADIENTS:
            return False
        return any(not np.isfinite(g).all() for g in self.grad_snapshots.values())

    def step_optimizer(self, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor,
                       scaler: torch.amp.GradScaler | None = None) -> None:
        """``optimizer.step()``, skipped (weights and state untouched) when ``found_inf`` is 1."""
        overflow = torch.zeros((), dtype=torch.float32, device=self.device)
        if scaler is not None and scaler.is_enabled():
            overflow = self.scaler_overflow(scaler)
            self.step_with_scaler(optimizer, found_inf, scaler)
        elif getattr(optimizer, "_step_supports_amp_scaling", False):
            optimizer.found_inf = found_inf  # type: ignore[attr-defined]
            try:
                optimizer.step()
            finally:
                del optimizer.found_inf  # type: ignore[attr-defined]
        elif not bool(found_inf):  # a non-fused optimizer cannot skip on the device: one host read per step
            optimizer.step()
        assert self.flags is not None, "check() must run before step_optimizer()"
        values = torch.cat([self.flags.flatten(), torch.stack([overflow, self.loss_value, self.norm_value])])
        self.pending.append(StepRecord(self.step, values, self.batch))

    def scaler_overflow(self, scaler: torch.amp.GradScaler) -> torch.Tensor:
        """1.0 when only the gradient norm is non-finite and the loss scale is still above 1: an fp16 overflow that
        the scaler handles by lowering the scale, not a broken model."""
        assert self.flags is not None
        grads_only = (self.flags[:, FLAG_NORM].amax() > 0) & (self.flags[:, FLAG_LOSS].amax() == 0)
        return (grads_only & (scaler._scale.to(self.device) > 1)).float().reshape(())  # type: ignore[union-attr]

    @staticmethod
    def step_with_scaler(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor,
                         scaler: torch.amp.GradScaler) -> None:
        """Merge the guard's flag into the scaler's per-device inf flags (the private state ``scaler.step`` and
        ``scaler.update`` read), so one decision skips the step and lowers the scale, all on the device."""
        from torch.amp.grad_scaler import OptState

        state = scaler._per_optimizer_states[id(optimizer)]
        if state["stage"] is not OptState.UNSCALED:
            scaler.unscale_(optimizer)
        for flag in state["found_inf_per_device"].values():
            torch.maximum(flag, found_inf.to(flag.device), out=flag)
        scaler.step(optimizer)
        scaler.update()

    def after_step(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, found_inf: torch.Tensor,
                   save_checkpoint: Callable[[Path], Any]) -> None:
        """Debug mode: read this step's flags, report and dump a non-finite step, stop at the limit.
        Production: only remember ``save_checkpoint`` for a dump at the stop (no host read)."""
        self.save_checkpoint = save_checkpoint
        if not self.debug_mode:
            return
        for event in self.drain():
            if not event.overflow:
                self.report(event, stopping=self.stop is not None)
        self.judge()
        self.raise_if_stopped()

    def on_log(self, step: int) -> list[str]:
        """At a log step (the loop syncs there anyway): read the flags of the steps since the last log in one
        transfer, return their lines, and stop when the limit was reached."""
        self.drain()
        if self.stop is not None and self.stop.step not in self.dumped_steps:
            self.report(self.stop, stopping=True, state_step=step)
        self.judge()
        self.raise_if_stopped()
        lines, self.log_lines = self.log_lines, []
        return lines

    def forget(self) -> None:
        """A rollback: the steps read and not yet judged, and their losses, belong to a trajectory the run left."""
        self.unjudged.clear()
        self.losses.clear()

    def take_losses(self) -> list[tuple[int, float]]:
        """(step, mean local loss over the ranks) of every step read since the last call, identical on every rank."""
        losses, self.losses = self.losses, []
        return losses

    def judge(self) -> None:
        """Hand the non-finite steps read since the last call (overflows aside) to `recheck`, if the loop set one; its
        lines join the log's."""
        bad, self.unjudged = self.unjudged, []
        if self.recheck is not None and bad:
            self.log_lines += self.recheck(bad)

    # -- host side --------------------------------------------------------------------------------------------------

    def drain(self) -> list[NonFiniteStep]:
        """Read every pending record with one host transfer and update the counters; the non-finite steps. The loop
        also calls it before a checkpoint is saved (the losses for the spike detector); the steps read then are
        judged and logged at the next log step."""
        if not self.pending:
            return []
        rows = np.asarray(torch.stack([r.values for r in self.pending]).tolist(), dtype=np.float64)
        records, self.pending = self.pending, []
        events = []
        for record, row in zip(records, rows):
            event = self.decode(record, row)
            if event is None:
                self.consecutive, self.streak_start = 0, None
                continue
            events.append(event)
            if not event.overflow:
                self.unjudged.append(event)
            self.skipped_steps += 1
            if event.overflow:
                self.consecutive, self.streak_start = 0, None
            else:
                self.consecutive += 1
                self.streak_start = event.step if self.streak_start is None else self.streak_start
            self.log_lines.append(f"WARNING | non-finite step {event.step} skipped ({self.reason(event)}); "
                                  f"{self.skipped_steps} skipped so far")
            if self.stop is None and self.consecutive >= self.max_consecutive:
                self.stop, self.stop_streak = event, (self.streak_start, self.consecutive)
        return events

    def decode(self, record: StepRecord, row: np.ndarray) -> NonFiniteStep | None:
        n = self.world_size * GATHERED_PER_RANK
        gathered = row[:n].reshape(self.world_size, GATHERED_PER_RANK)
        flags = gathered[:, :FLAGS_PER_RANK]
        overflow, loss, norm = row[n:]
        if self.keeps_losses:
            self.losses.append((record.step, float(gathered[:, FLAGS_PER_RANK].mean())))
        if not flags.any():
            return None
        return NonFiniteStep(step=record.step, loss_ranks=[int(r) for r in np.flatnonzero(flags[:, FLAG_LOSS])],
                             grad_ranks=[int(r) for r in np.flatnonzero(flags[:, FLAG_LOCAL_GRAD])],
                             norm_bad=bool(flags[:, FLAG_NORM].any()), overflow=bool(overflow), loss=float(loss),
                             grad_norm=float(norm), batch=record.batch)

    def gpus(self, ranks: Iterable[int]) -> str:
        return ", ".join(f"GPU {self.gpu_ids[r]}" for r in ranks)

    def reason(self, event: NonFiniteStep) -> str:
        if event.loss_ranks:
            return f"{self.gpus(event.loss_ranks)} local loss non-finite"
        if event.grad_ranks:
            return f"{self.gpus(event.grad_ranks)} local gradients non-finite"
        if event.overflow:
            return "fp16 gradient overflow; the loss scale was lowered"
        return "gradient norm non-finite"

    def raise_if_stopped(self) -> None:
        if self.stop is None:
            return
        for line in self.log_lines:  # the loop never gets to print them: this ends the run
            print(line, flush=True)
        self.log_lines = []
        event, (first, length) = self.stop, self.stop_streak
        dumps = ", ".join(self.dump_paths.get(event.step, [])) or "written by the ranks concerned"
        raise NonFiniteError(
            f"{length} consecutive non-finite steps (steps {first}-{event.step}) reached "
            f"debug.max_nonfinite_steps={self.max_consecutive}; last: {self.reason(event)}. Dumps: {dumps}. "
            f"To find the module where it starts, resume from the nan_grad checkpoint with "
            f"--set debug.nan_localize=true (or --debug): the next non-finite step is then traced module by module.")

    # -- reports and dumps ------------------------------------------------------------------------------------------

    def first_forward_fault(self) -> tuple[ForwardFault | None, list[str]]:
        """The first module call (execution order) with a non-finite output, and every module that had one."""
        if not self.forward_stats:
            return None, []
        rows = np.asarray(torch.stack([s.to(self.forward_stats[0].device) for s in self.forward_stats]).tolist())
        k = len(STAT_FIELDS)
        bad = np.flatnonzero(rows[:, k + 3] + rows[:, k + 4] > 0)
        if not len(bad):
            return None, []
        names = list(dict.fromkeys(self.forward_names[i][0] for i in bad))
        i = int(bad[0])
        fault = ForwardFault(name=self.forward_names[i][0], type=self.forward_names[i][1], call_index=i + 1,
                             input_stats=dict(zip(STAT_FIELDS, rows[i, :k].tolist())),
                             output_stats=dict(zip(STAT_FIELDS, rows[i, k:].tolist())))
        return fault, names

    def report(self, event: NonFiniteStep, *, stopping: bool, state_step: int | None = None) -> None:
        """Dump and print one non-finite step. Every rank calls this at the same step (the flags are identical
        everywhere), so the loop's save_checkpoint may be a collective; only the ranks concerned write a pickle and
        print."""
        self.dumped_steps.add(event.step)
        dump = self.cfg.debug.nan_dump or stopping
        checkpoint = None
        if dump and self.save_checkpoint is not None:
            checkpoint = self.checkpoint_dir / f"nan_grad_step_{event.step if state_step is None else state_step}.pt"
            self.save_checkpoint(checkpoint)
        reporters = event.reporting_ranks
        if self.rank not in reporters:
            self.dump_paths[event.step] = [shown_path(checkpoint)] if checkpoint else []
            return
        suffix = f"_gpu{self.gpu_id}" if len(reporters) > 1 else ""
        fault, nonfinite_modules = self.first_forward_fault() if self.debug_mode else (None, [])
        pkl = self.checkpoint_dir / "debug" / f"nan_debug_step_{event.step}{suffix}.pkl" if dump else None
        if pkl is not None:
            write_pickle_atomically(pkl, self.dump_payload(event, fault, nonfinite_modules))
        text = report_text(event, self.gpu_id, fault, checkpoint, pkl, debug_mode=self.debug_mode,
                           grads=self.gradients() if self.debug_mode else {},
                           shapes={name: p.shape for name, p in self.model.named_parameters()})
        print(text, flush=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / f"nan_report_step_{event.step}{suffix}.txt").write_text(text + "\n")
        self.dump_paths[event.step] = [shown_path(p) for p in (checkpoint, pkl) if p is not None]

    def gradients(self) -> dict[str, np.ndarray]:
        """Debug mode: the host copies of the local gradients; otherwise whatever gradients still exist."""
        if self.debug_mode and self.grad_snapshots:  # hooks ran in backward order: give them in the model's order
            return {n: self.grad_snapshots[n] for n, _ in self.model.named_parameters() if n in self.grad_snapshots}
        return {name: to_host(p.grad) for name, p in self.model.named_parameters() if p.grad is not None}

    def dump_payload(self, event: NonFiniteStep, fault: ForwardFault | None,
                     nonfinite_modules: list[str]) -> dict[str, Any]:
        return {
            "step": event.step,
            "gpu_id": self.gpu_id,
            "rank": self.rank,
            "world_size": self.world_size,
            "loss": event.loss,
            "grad_norm": event.grad_norm,
            "batch": to_host(event.batch) if event.batch is not None else None,
            "first_nonfinite_module": dataclasses.asdict(fault) if fault else None,
            "nonfinite_modules": nonfinite_modules,
            "loss_nonfinite_gpus": [self.gpu_ids[r] for r in event.loss_ranks],
            "gradients_source": self.gradients_source if self.debug_mode else "as left by the loop (usually freed)",
            "parameters": {name: to_host(p) for name, p in self.model.named_parameters()},
            "gradients": self.gradients(),
        }
