"""What a non-finite step leaves behind: the report a rank prints, and the helpers its dump files are written with.

The report's format (the rules, the "PROBLEMATIC TENSORS" section, up to 5 gradient values per parameter) is what
users grep for; the dumps are described in trainer/diagnosis/nan_guard.py's docstring.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPORT_RULE = "=" * 80
SECTION_RULE = "=" * 40
GRAD_VALUES_SHOWN = 5
HALF_DTYPES = (torch.float16, torch.bfloat16)


@dataclass
class NonFiniteStep:
    """One skipped step, decoded on the host."""
    step: int
    loss_ranks: list[int]  # ranks whose local loss was non-finite
    grad_ranks: list[int]  # ranks whose local gradients were non-finite (known in debug mode only)
    norm_bad: bool
    overflow: bool  # a GradScaler overflow at a loss scale above 1: skipped, not counted towards the limit
    loss: float  # this rank's local loss
    grad_norm: float
    batch: torch.Tensor | None

    @property
    def reporting_ranks(self) -> list[int]:
        """The ranks that print and dump: where the NaN showed up first; rank 0 when only the global norm knows."""
        return sorted(set(self.loss_ranks) | set(self.grad_ranks)) or [0]


@dataclass
class ForwardFault:
    """The first module whose forward output held NaN/Inf, with its input and output statistics."""
    name: str
    type: str
    call_index: int  # position among this step's module calls (execution order)
    input_stats: dict[str, float]
    output_stats: dict[str, float]

    def describe(self) -> str:
        return (f"First non-finite forward output: {self.name} ({self.type}), module call #{self.call_index} "
                f"of the step | input: {format_stats(self.input_stats)} | output: {format_stats(self.output_stats)}")


def report_text(event: NonFiniteStep, gpu_id: str, fault: ForwardFault | None, checkpoint: Path | None,
                pkl: Path | None, *, debug_mode: bool, grads: dict[str, np.ndarray],
                shapes: dict[str, torch.Size]) -> str:
    """The report a rank prints (and keeps in the run folder) for one non-finite step. `grads` are the host copies
    of the local gradients (debug mode), `shapes` the parameters' full shapes."""
    with_nan = [n for n, g in grads.items() if np.isnan(g).any()]
    with_inf = [n for n, g in grads.items() if np.isinf(g).any() and n not in with_nan]
    lines = [REPORT_RULE, f"NaN GRADIENT DETECTED [GPU {gpu_id}]", REPORT_RULE,
             f"Step: {event.step}", f"Loss: {event.loss:.4f}", f"Gradient Norm: {event.grad_norm:.4f}", "",
             SECTION_RULE, "PROBLEMATIC TENSORS:", SECTION_RULE]
    for title, names, count in (("NaN", with_nan, np.isnan), ("Inf", with_inf, np.isinf)):
        if title == "Inf" and not names:
            continue
        lines.append(f"⚠️  Gradients with {title} ({len(names)} layers):")
        for name in names:
            g = grads[name]
            shown = [format_value(v) for v in g.reshape(-1)[:GRAD_VALUES_SHOWN].tolist()]
            more = ", ..." if g.size > GRAD_VALUES_SHOWN else ""
            lines += [f"  • {name} (shape: {shapes.get(name, torch.Size(g.shape))})",
                      f"    Grad values: [{', '.join(repr(s) for s in shown)}{more}]",
                      f"    {title} count: {int(count(g).sum())}/{g.size}"]
        lines += ["", f"Total layers with {title} gradients: {len(names)}", f"Affected layers: {names}"]
    if not debug_mode:
        lines.append("(gradients are not kept outside debug mode; resume from the checkpoint with --debug)")
    lines.append(SECTION_RULE)
    lines.append("")
    if debug_mode:
        lines.append(fault.describe() if fault else
                     "First non-finite forward output: none on this rank (the forward pass stayed finite here; "
                     "the non-finite values arose in backward or on another rank)")
    batch_shape = list(event.batch.shape) if event.batch is not None else None
    lines.append(f"Offending batch: token ids {batch_shape} saved in {shown_path(pkl)} (key 'batch')" if pkl
                 else "Offending batch: not saved (set debug.nan_dump=true to keep it)")
    lines.append("")
    if checkpoint is not None:
        lines.append(f"Checkpoint saved: {shown_path(checkpoint)}")
    if pkl is not None:
        lines.append(f"Debug tensors saved: {shown_path(pkl)}")
    return "\n".join(lines)


def format_value(v: float) -> str:
    """A gradient value as the report shows it: 'NaN', 'Inf', '-Inf' or 4 significant digits."""
    if np.isnan(v):
        return "NaN"
    if np.isinf(v):
        return "Inf" if v > 0 else "-Inf"
    return f"{v:.4g}"


def format_stats(stats: dict[str, float]) -> str:
    finite = stats["numel"] - stats["nan"] - stats["inf"]
    values = (f"min={stats['min']:.4g} max={stats['max']:.4g} mean={stats['mean']:.4g}" if finite > 0
              else "min=n/a max=n/a mean=n/a")
    return f"{values} nan={int(stats['nan'])} inf={int(stats['inf'])} (of {int(stats['numel'])})"


def to_host(t: torch.Tensor) -> np.ndarray:
    """A host copy as numpy; half precision becomes float32 (numpy has no bfloat16); a DTensor gives its shard."""
    t = t.detach()
    if hasattr(t, "to_local"):
        t = t.to_local()
    host = t.cpu()
    if host.dtype in HALF_DTYPES:
        host = host.float()
    elif host.data_ptr() == t.data_ptr():  # it already lived in host memory: copy, or later in-place ops show through
        host = host.clone()
    return host.numpy()


def shown_path(path: Path) -> str:
    """The path as the user typed it: relative to the working directory when inside it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def write_pickle_atomically(path: Path, payload: dict[str, Any]) -> None:
    """Temp file in the same folder + rename, so a reader (or a crash) never sees half a dump."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            pickle.dump(payload, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
