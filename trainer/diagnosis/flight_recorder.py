"""The rank's side of PyTorch's flight recorder: dump its record of collectives when the supervisor asks.

With ``TORCH_FR_BUFFER_SIZE`` set in its environment (gloo and NCCL groups alike), c10d keeps
the last N collectives of every process group with their per-group sequence numbers, and ``pg_status`` says, per
group, the last collective this rank *enqueued* and the last it *completed*. A rank that never joined the collective
the others wait in shows a lower ``last_enqueued_collective`` on that group: that is how the supervisor names the
culprit of a stall (`supervisor.diagnosis.culprit`).

NCCL's own trigger from outside (``TORCH_NCCL_DEBUG_INFO_PIPE_FILE``) exists for NCCL groups only; the CPU gloo
groups (every rank's control group, and every group of a CPU run) have none. So every rank gets the same trigger: the
supervisor creates a FIFO per rank and names it in ``SUPERVISOR_FR_PIPE``; a daemon thread blocks on it and, when
the supervisor writes a byte, writes every recorder's JSON dump (``_dump_fr_trace_json``, plus
``_dump_nccl_trace_json`` on CUDA builds) merged into ``<pipe>.json``. The thread holds the GIL only while dumping;
the main thread may be stuck anywhere, in a collective's wait or in a sleep, and the dump still happens.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

PIPE_ENV = "SUPERVISOR_FR_PIPE"


def dump_path(pipe: Path) -> Path:
    return pipe.with_suffix(".json")


RECORDERS = {"gloo": "_dump_fr_trace_json", "nccl": "_dump_nccl_trace_json"}  # the CPU recorder; NCCL's own


def snapshot() -> dict[str, Any]:
    """Every flight recorder's entries and per-group status, merged. Each backend numbers its process groups from 0
    in its own recorder (NCCL's default group and the gloo control group are both "0"), so a group's id becomes
    ``<recorder>:<id>`` here, the same on every rank."""
    import torch._C._distributed_c10d as c10d

    merged: dict[str, Any] = {"entries": [], "pg_status": {}}
    for recorder, name in RECORDERS.items():
        dump = getattr(c10d, name, None)
        if dump is None:
            continue
        try:
            record = json.loads(dump(True, False))
        except (RuntimeError, ValueError):
            continue  # that recorder is off or holds nothing
        merged["entries"] += [{**entry, "pg_id": f"{recorder}:{entry.get('pg_id')}"}
                              for entry in record.get("entries", [])]
        merged["pg_status"].update({f"{recorder}:{pg}": status for pg, status in record.get("pg_status", {}).items()})
    return merged


def serve(pipe: Path) -> None:
    while True:
        with open(pipe, "rb") as f:  # blocks until the supervisor opens the other end
            if not f.read(1):
                continue
        tmp = pipe.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(snapshot()))
        os.replace(tmp, dump_path(pipe))


def start_from_environment() -> None:
    """Start the dump thread when the supervisor asked for one (``SUPERVISOR_FR_PIPE``); else nothing."""
    pipe = os.environ.get(PIPE_ENV)
    if pipe:
        threading.Thread(target=serve, args=(Path(pipe),), name="flight-recorder-dump", daemon=True).start()
