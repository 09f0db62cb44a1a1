"""Counting device→host synchronisations, the stalls that keep a GPU's queue from running ahead of the host.

``HostSyncCounter`` counts them on any device, CPU included, so the benchmarks and tests can check that a code path
(the NaN guard's production mode, the training step) adds none without a GPU; on CUDA,
``torch.cuda.set_sync_debug_mode("warn")`` is the driver-level cross-check.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class HostSyncCounter(TorchDispatchMode):
    """Counts device→host reads while active: ``item()``, ``bool()``, ``int()``, ``float()``, ``if tensor:`` (all
    ``aten._local_scalar_dense``), ``aten.is_nonzero``, ``aten.equal``, plus ``Tensor.tolist()`` and ``Tensor.cpu()``,
    which bypass the dispatcher and are counted by wrapping the methods. On a GPU each of these blocks the host until
    the device catches up; on a CPU they are cheap, but the count is the same, so a CPU run tells how a GPU run would
    stall. (``.numpy()`` needs a host tensor, so it always follows a counted ``.cpu()``.)"""

    SCALAR_OPS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default,
                  torch.ops.aten.equal.default)
    WRAPPED_METHODS = ("tolist", "cpu")

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.saved: dict[str, Callable[..., Any]] = {}

    def __enter__(self) -> "HostSyncCounter":
        for name in self.WRAPPED_METHODS:
            original = self.saved[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self.counting(original))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        for name, original in self.saved.items():
            setattr(torch.Tensor, name, original)

    def counting(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return method(tensor, *args, **kwargs)
        return wrapper

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if func in self.SCALAR_OPS:
            self.count += 1
        return func(*args, **(kwargs or {}))
