"""Numerics or hardware, decided in the run (`training.nan_recompute`): a non-finite step recomputed once from the
parameters it started from.

Keeping them costs no host synchronisation. Every step, between the NaN guard's check and the optimizer, `keep`
copies the parameters into a second set of device buffers where the guard's `found_inf` says the step is non-finite
and nothing is held yet: one `torch.where` per parameter, on the device, whatever the flag says (the flag is never
read on the host for it). The buffers then hold the parameters before the first non-finite step since the last
verdict; later steps change the live parameters, not them. The optimizer's state is not kept: whether a step is
finite depends on the parameters and the batch alone (the loss and the gradients); the optimizer only applies them.

When the guard learns of a non-finite step (at a log step in production, every step in debug mode, on every rank
alike), each rank swaps the kept parameters in, recomputes the step's forward and backward with the same batch and the
same gradient synchronisation (`swapped`, around the loop's own pass), swaps its parameters back and judges
(`trainer.diagnosis.nan_verdict`): a rank whose local loss was non-finite and is again, or a gradient norm non-finite
again, is reproducible; a rank whose loss is finite the second time suspects its device. Only the first non-finite
step since the last verdict can be recomputed (one set of buffers); later ones in the same interval say so.

The cost: one more copy of the parameters in device memory (4 bytes a parameter in fp32), a pass over them per step,
and a step's forward and backward per non-finite step (BENCHMARKS.md). Under FSDP2 one rank's parameters are shards
of every layer, which no rank can swap alone: the config refuses it there.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


class KeptParameters:
    """The parameters before the first non-finite step since the last `release`, held on the device."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        self.kept = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in params]
        device = params[0].device if params else torch.device("cpu")
        self.held = torch.zeros((), dtype=torch.bool, device=device)
        self.step = torch.full((), -1, dtype=torch.int64, device=device)

    @property
    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() for k in self.kept)

    @torch.no_grad()
    def keep(self, found_inf: torch.Tensor, step: int) -> None:
        """Before the optimizer applies step `step`: hold the parameters now when the step is non-finite and nothing
        is held (device-side: no host read of `found_inf`)."""
        take = (found_inf.to(self.held.device) > 0) & ~self.held
        for kept, param in zip(self.kept, self.params):
            torch.where(take, param.detach(), kept, out=kept)
        torch.where(take, torch.full_like(self.step, step), self.step, out=self.step)
        self.held |= take

    def held_step(self) -> int | None:
        """The step whose parameters are held (a host read: only once a non-finite step is known), or None."""
        return int(self.step.item()) if bool(self.held.item()) else None

    def release(self) -> None:
        """A verdict was given: the next non-finite step may be held."""
        self.held.zero_()

    @contextmanager
    def swapped(self) -> Iterator[None]:
        """The held parameters in place of the live ones (their storage exchanged, nothing copied), the live ones back
        afterwards, whatever happens inside."""
        self.exchange()
        try:
            yield
        finally:
            self.exchange()

    def exchange(self) -> None:
        for i, param in enumerate(self.params):
            param.data, self.kept[i] = self.kept[i], param.data
