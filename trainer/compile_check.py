"""The first compiled forward and backward, tried on its own: a compiler that fails stops no run it need not stop.

`torch.compile` is lazy: compiling the decoder layers (trainer.model.build.compile_layers) only marks them, and dynamo,
inductor and Triton do their work inside the first forward and backward, where a node without a working C/C++
compiler (inductor's C++ kernels on CPUs, Triton's launcher on GPUs), an inductor or Triton error, or a graph that
will not compile raises. Raised inside a real step, that error would leave DDP's reducer or FSDP's hooks half-way
through a step. So the loop runs that first forward and backward alone, before its first step (`check`): one
micro-batch, without gradient synchronisation (DDP), its gradients dropped. Then every rank says whether it failed, on
the CPU control group, so that all ranks decide alike:

* `system.compile=auto`: the decoder layers go back to eager on every rank, rank 0 logs one warning naming the cause,
  and the run trains eager;
* `system.compile=true`: every rank stops with one `error:` line naming the cause (a `UserError`, exit 2): the user
  asked for compiled layers and this node cannot give them.

Under FSDP the forward gathers each layer's weights from every rank, so a rank whose compile fails while another's
succeeds leaves that one waiting in the next gather: the supervisor's stall detection then ends the run. Compile
failures are alike on every rank that runs the same software on the same kind of node, which is the case the vote
covers without a stall (DDP covers both).

Compiled graphs outlive the process in inductor's cache (`graph_cache` says how many a rank found there): the
supervisor keeps it in the run folder, so a restarted group loads the graphs the first group compiled.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable

import torch

from trainer.config import Config
from trainer.diagnosis.oom_report import is_out_of_memory
from trainer.errors import UserError
from trainer.model.build import decoder_layers
from trainer.model.distributed import DistContext, gather_objects
from trainer.progress import device_label

# Where compiled code is built and launched: an error raised from inside these (not merely passing through them, as a
# model's own error traced by dynamo does) is the compiler's.
COMPILER_FILES = ("/torch/_inductor/", "/triton/")
MAX_CAUSE = 300  # characters of the cause in the one warning or error line


def compile_failure(error: BaseException) -> str | None:
    """The cause in one line when `error` came from torch.compile (dynamo, inductor or Triton), else None. Running
    out of memory inside compiled code is out of memory (trainer.diagnosis.oom_report), not a compile failure."""
    from torch._dynamo.exc import TorchDynamoException

    if is_out_of_memory(error):
        return None
    frames = traceback.extract_tb(error.__traceback__)
    raised_by_compiler = bool(frames) and any(part in frames[-1].filename.replace("\\", "/")
                                             for part in COMPILER_FILES)
    if not isinstance(error, TorchDynamoException) and not raised_by_compiler:
        return None
    inner = getattr(error, "inner_exception", None) or error  # dynamo's BackendCompilerFailed wraps the backend's
    lines = [line.strip() for line in str(inner).splitlines() if line.strip()]
    message = f"{type(inner).__name__}: {lines[0] if lines else 'no message'}"
    return message if len(message) <= MAX_CAUSE else message[:MAX_CAUSE - 1] + "…"


def uncompile(model: torch.nn.Module) -> None:
    """Undo trainer.model.build.compile_layers: `nn.Module.compile` keeps the compiled call beside the module's own and has
    no public inverse, so each decoder layer's compiled call is dropped (the layer calls its forward again)."""
    for layer in decoder_layers(model):
        layer._compiled_call_impl = None


def verdict(causes: list[tuple[str, str | None]], setting: bool | str) -> str | None:
    """What every rank makes of the ranks' (device label, cause or None) in rank order: None when every rank
    compiled, else the warning of `system.compile=auto`'s fallback to eager; raises UserError for
    `system.compile=true`."""
    failed = [(rank, who, why) for rank, (who, why) in enumerate(causes) if why]
    if not failed:
        return None
    rank, who, why = failed[0]
    where = f"{who} (rank {rank})"
    if len(failed) > 1:
        where = f"{len(failed)} of {len(causes)} ranks (first {where})"
    if setting is True:
        raise UserError(f"torch.compile failed on {where}: {why}; make the compiler work on this node (a C/C++ "
                        f"compiler on PATH or in CC/CXX), or set system.compile=auto to train eager where compiling "
                        f"fails (or false)")
    return (f"torch.compile failed on {where}: {why}; every rank trains eager instead (system.compile=auto; set it "
            f"to false to skip compiling, or true to stop on such a failure)")


def graph_cache() -> str:
    """Where the graphs compiled so far in this process came from: how many inductor loaded from its FX graph cache
    (TORCHINDUCTOR_CACHE_DIR; the supervisor keeps it in the run folder, so that a restart finds what the first group
    compiled) and how many it compiled."""
    from torch._dynamo.utils import counters
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    hits, misses = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
    return f"{hits} of {hits + misses} graphs from the cache in {cache_dir()}"


def check(trial: Callable[[], None], cfg: Config, ctx: DistContext, model: torch.nn.Module,
          log: logging.Logger) -> bool:
    """Run `trial` (the first forward and backward through the compiled layers of `model`) and agree on the outcome
    with every rank (`verdict`): True when it compiled everywhere; False after going back to eager
    (`system.compile=auto`, rank 0 logging the one warning). An error that is not the compiler's propagates."""
    try:
        trial()
        cause = None
    except Exception as error:
        cause = compile_failure(error)
        if cause is None:
            raise
    warning = verdict(gather_objects((device_label(ctx.device.type == "cuda"), cause), ctx), cfg.system.compile)
    if warning is None:
        return True
    uncompile(model)
    if ctx.is_main:
        log.warning(warning)
    return False
