"""The diagnoses' analysis on their own: culprit verdicts from flight records shaped as PyTorch writes them (NCCL
ranks' records have the same JSON shape as gloo's) and from faulthandler stacks; the straggler detector's arithmetic;
the out-of-memory headline's figures and fixes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from supervisor.diagnosis import oom
from supervisor.diagnosis.culprit import RankEvidence, find_culprit, main_stack, read_recorder
from supervisor.diagnosis.stragglers import WARM_UP_STEPS, WINDOW, StragglerDetector
from trainer.diagnosis.oom_report import OomReport, is_out_of_memory

ROOT = Path(__file__).resolve().parents[1]


def record(pg_status: dict[str, tuple[int, int]], backend: str = "nccl") -> dict:
    """A flight-recorder dump: `pg_status` and the entry of each group's last enqueued collective."""
    return {"version": "2.10", "pg_status": {pg: {"last_enqueued_collective": str(e), "last_completed_collective":
                                                    str(c), "last_started_collective": "-1"}
                                               for pg, (e, c) in pg_status.items()},
            "entries": [{"pg_id": int(pg), "collective_seq_id": e, "profiling_name": f"{backend}:all_reduce",
                         "process_group": [pg, "default_pg" if pg == "0" else "undefined"], "retired": e == c}
                        for pg, (e, c) in pg_status.items()]}


STACK_HUNG = '''Thread 0x00007f0000000001 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x00007f0000000000 (most recent call first):
  File "/x/trainer/diagnosis/faults.py", line 160 in _fire_if_due
  File "/x/trainer/diagnosis/faults.py", line 133 in before_step
  File "/x/trainer/loop.py", line 324 in train_step
  File "/x/pretrain_main.py", line 13 in <module>
'''
STACK_WAITING = '''Current thread 0x00007f0000000000 (most recent call first):
  File "/v/torch/autograd/graph.py", line 829 in _engine_run_backward
  File "/v/torch/_tensor.py", line 625 in backward
  File "/x/trainer/loop.py", line 333 in train_step
  File "/x/pretrain_main.py", line 13 in <module>
'''


def evidence(rank: int, stack: str | None, rec: dict | None) -> RankEvidence:
    return RankEvidence(rank, f"GPU{rank}", "at step 3", main_stack(stack) if stack else None,
                        read_recorder(rec) if rec else None)


def test_recorder_names_the_rank_that_never_joined() -> None:
    ranks = [evidence(0, STACK_WAITING, record({"0": (14, 13), "1": (7, 7)})),
             evidence(1, STACK_HUNG, record({"0": (13, 13), "1": (7, 7)})),
             evidence(2, STACK_WAITING, record({"0": (14, 13), "1": (7, 7)}))]
    verdict = find_culprit(ranks)
    assert verdict.method == "flight recorder" and [c.rank for c in verdict.culprits] == [1]
    assert verdict.headline(10.0).startswith(
        "GPU1 (rank 1) stalled at step 3 in _fire_if_due (trainer/diagnosis/faults.py:160); GPU0 (rank 0) waits for "
        "it in nccl:all_reduce #14 on default_pg at _engine_run_backward (autograd/graph.py:829)")


def test_a_lone_rank_stalled_in_its_own_code_is_the_culprit() -> None:
    verdict = find_culprit([evidence(0, STACK_HUNG, None)])
    assert verdict.method == "stack" and [c.rank for c in verdict.culprits] == [0]
    assert verdict.headline(5.0) == ("GPU0 (rank 0) stalled at step 3 in _fire_if_due (trainer/diagnosis/faults.py:160) "
                                     "(no progress for 5.0 s; by stack)")


def test_a_lone_rank_waiting_in_a_collective_waits_for_another_node() -> None:
    verdict = find_culprit([evidence(0, STACK_WAITING, None)])
    assert verdict.culprits == [] and verdict.headline(5.0) == (
        "stalled (no progress for 5.0 s); the evidence singles out no rank (the flight records and stacks do not "
        "decide)")
    assert "no stacks or flight records arrived" in find_culprit([evidence(0, None, None)]).headline(5.0)


def test_crossed_collectives_single_out_nobody() -> None:
    ranks = [evidence(0, None, record({"0": (5, 4), "1": (3, 3)})), evidence(1, None, record({"0": (4, 4),
                                                                                               "1": (4, 3)}))]
    verdict = find_culprit(ranks)
    assert verdict.culprits == [] and "singles out no rank" in verdict.headline(5.0)


def test_stacks_decide_when_the_records_agree() -> None:
    same = record({"0": (9, 9)})
    verdict = find_culprit([evidence(0, STACK_WAITING, same), evidence(1, STACK_HUNG, same)])
    assert verdict.method == "stacks" and [c.rank for c in verdict.culprits] == [1]
    everyone_waits = find_culprit([evidence(0, STACK_WAITING, None), evidence(1, STACK_WAITING, None)])
    assert everyone_waits.culprits == []


def test_a_rank_that_answers_nothing_while_the_others_wait_is_the_culprit() -> None:
    """A frozen rank (SIGSTOP, a debugger) prints no stack and dumps no flight record; the others wait for it."""
    ranks = [evidence(0, STACK_WAITING, record({"0": (14, 13)})), evidence(1, None, None),
             evidence(2, None, record({"0": (14, 13)}))]
    verdict = find_culprit(ranks)
    assert verdict.method == "silence" and [c.rank for c in verdict.culprits] == [1]
    assert verdict.headline(5.0) == (
        "GPU1 (rank 1) stalled at step 3 and answered neither the stack request nor the flight recorder (stopped, "
        "or stuck outside Python); GPU0 (rank 0) waits for it in _engine_run_backward (autograd/graph.py:829); "
        "GPU2 (rank 2) waits for it in nccl:all_reduce #14 on default_pg (no progress for 5.0 s; by silence)")
    busy = [evidence(0, STACK_HUNG, None), evidence(1, None, None)]  # a rank in its own code: silence decides nothing
    assert find_culprit(busy).method != "silence"


def feed(detector: StragglerDetector, steps: range, slow_from: int, slowdown: float) -> list:
    found = []
    for step in steps:
        base = 0.100 + 0.004 * ((step * 7) % 5)  # jitter shared by both ranks
        delay = base * slowdown if step >= slow_from else 0.0
        # rank 1 is slow: it gets ready `delay` later; the step lasts base + delay on both
        for rank, ready in ((0, 0.03), (1, 0.03 + delay)):
            if hit := detector.add(rank, step, ready, base + delay):
                found.append(hit)
    return found


def test_a_rank_slowed_by_30_percent_is_named_within_30_steps() -> None:
    found = feed(StragglerDetector({0: "GPU0", 1: "GPU1"}), range(1, 60), slow_from=5, slowdown=0.3)
    assert [(s.label, s.rank) for s in found] == [("GPU1", 1)]
    assert found[0].step <= 5 + 30 and 25 <= found[0].percent <= 31


def test_no_straggler_without_a_slowdown() -> None:
    assert feed(StragglerDetector({0: "GPU0", 1: "GPU1"}), range(1, 200), slow_from=10**6, slowdown=0.0) == []
    assert WARM_UP_STEPS < WINDOW


def oom_report(strategy: str, checkpointing: str) -> OomReport:
    return OomReport(label="GPU3", rank=3, step=0, allocated=70 << 30, reserved=78 << 30, peak=76 << 30,
                     total=80 << 30, estimate=61 << 30, strategy=strategy, message="CUDA out of memory.",
                     traceback="Traceback ...", checkpointing=checkpointing)


def test_oom_headline_has_the_figures_and_the_estimate() -> None:
    line = oom.headline(oom_report("ddp", "none"))
    assert line.startswith("GPU3 (rank 3) ran out of memory at step 0: 70.00 GiB allocated, 78.00 GiB reserved, "
                           "peak 76.00 GiB of 80.00 GiB; the dry run estimated 61.00 GiB per GPU. Fixes, in order: "
                           "1) lower --batch-size"), line


@pytest.mark.parametrize("strategy, checkpointing, expected", [
    ("ddp", "none", ["batch-size", "gradient_checkpointing=selective, then =full", "strategy=fsdp"]),
    ("ddp", "selective", ["batch-size", "gradient_checkpointing=full", "strategy=fsdp"]),
    ("fsdp", "full", ["batch-size"]),
])
def test_oom_fixes_leave_out_what_the_run_already_does(strategy: str, checkpointing: str,
                                                        expected: list[str]) -> None:
    fixes = oom.fixes(oom_report(strategy, checkpointing))
    assert len(fixes) == len(expected) and all(part in fix for part, fix in zip(expected, fixes)), fixes


SNAPSHOT = """
import json, os, sys
import torch, torch.distributed as dist
from trainer.diagnosis.flight_recorder import snapshot
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
control = dist.new_group(backend="gloo")
dist.all_reduce(torch.ones(1))
dist.all_reduce(torch.ones(1), group=control)
print(json.dumps(snapshot()))
dist.destroy_process_group()
"""


def test_the_dump_names_each_group_by_its_recorder(tmp_path: Path) -> None:
    """Each backend numbers its groups from 0 in its own recorder: the merged dump keeps them apart."""
    done = subprocess.run([sys.executable, "-c", SNAPSHOT, str(tmp_path / "store")], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env={**os.environ, "TORCH_FR_BUFFER_SIZE": "100"})
    assert done.returncode == 0, done.stderr[-2000:]
    dump = json.loads(done.stdout.splitlines()[-1])
    assert sorted(dump["pg_status"]) == ["gloo:0", "gloo:1"]
    assert {e["pg_id"] for e in dump["entries"]} == {"gloo:0", "gloo:1"}
    statuses = read_recorder(dump)
    assert statuses["gloo:0"].collective == "gloo:all_reduce" and statuses["gloo:0"].enqueued >= 1


def test_allocation_failures_outside_the_caching_allocator_count_as_out_of_memory() -> None:
    import torch

    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_out_of_memory(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"))
    assert not is_out_of_memory(RuntimeError("Connection closed by peer [127.0.0.1]:61328"))
    assert not is_out_of_memory(ValueError("CUDA out of memory"))


def test_host_memory_refused_to_a_cpu_rank_is_out_of_memory() -> None:
    """A real refusal by torch's CPU allocator (4 EiB: refused at once, nothing is touched), and its headline."""
    import torch

    with pytest.raises(RuntimeError) as refused:
        torch.empty(2**62, dtype=torch.uint8)
    assert is_out_of_memory(refused.value)
    assert is_out_of_memory(MemoryError())
    report = replace(oom_report("ddp", "none"), label="CPU1", rank=1, allocated=None, reserved=None, peak=None,
                     total=None, message=str(refused.value).splitlines()[0])
    assert oom.headline(report).startswith("CPU1 (rank 1) ran out of memory at step 0: host memory, 4294967296.00 GiB "
                                           "asked for at once; the dry run estimated 61.00 GiB per GPU. Fixes, in "
                                           "order: 1) lower --batch-size")
