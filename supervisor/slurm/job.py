"""The batch side of a Slurm job, what `train_slurm.sbatch` runs: one supervisor per node, and a requeue when Slurm's
time-limit warning stopped the run at a checkpoint.

Usage (inside an allocation): ``python -m supervisor.slurm.job [training flags...]``, which runs

    srun --ntasks-per-node=1 --cpus-per-task=<the job's> --kill-on-bad-exit=1 bash run_training.sh --resume auto \
        [training flags...]

- The training flags are the user's, after the script name (``sbatch train_slurm.sbatch --debug``); nothing here
  chooses a preset, so the supervisor's default (production) holds unless they name one. ``--resume auto`` continues
  a requeued job from its latest checkpoint, and starts fresh when there is none.
- Nodes, GPUs per node and CPUs per task are the job's own (``#SBATCH`` lines, overridden by ``sbatch`` options). The
  step asks for the job's CPUs per task explicitly: srun in Slurm 22.05 no longer inherits it, and a step confined to
  one CPU would squeeze a node's supervisor and ranks onto it wherever Slurm binds tasks to cores.
- `SUPERVISOR_CONTROL_SECRET` is generated here unless it (or `SUPERVISOR_CONTROL_SECRET_FILE`) is already set: srun
  hands the job's environment to every node's supervisor, so they share a secret that nobody outside the job has
  (supervisor/control/wire.py).
- The time-limit warning (``#SBATCH --signal=B:USR1@120``) reaches this process alone, the batch step's (the job
  script execs into it), which passes it on to the supervisor of its node, the step's task there (``scontrol
  listpids``; ``run_training.sh`` and the bootstrap exec into the supervisor, so the task's pid is the supervisor's).
  That supervisor stops its ranks at a checkpoint and, through the control channel, every other node's (each exits
  138, as after SIGUSR1). Not Slurm's own delivery to the step (``--signal=USR1@120`` without ``B:``): Slurm signals
  every process of a step, ranks included, and a rank answers SIGUSR1 with a stack dump into its log (the stall
  diagnosis's request, `supervisor.group.watch`), noise at every time limit.
- The step runs with ``--kill-on-bad-exit``: a supervisor exits with an error only once the run is over on every
  node (it tells the others through the control channel), so a task still running then is one that cannot hear it,
  a lost node's (its supervisor frozen, cut off): Slurm ends it (SIGCONT, SIGTERM, SIGKILL after its KillWait)
  instead of the job waiting for it until its time limit. srun then exits with the code of the task it killed; the
  nodes that stopped for the lost node recorded it (``<run>/node_lost.json``, `supervisor.gpus.exclusion.LostNode`), so
  the job exits with the lost node's code, 125, and a line names the node by its Slurm name. The job is then
  requeued without that node, as after a GPU fault (below): a node that froze or dropped off the network once is
  not trusted with the next allocation.
- Exit code 138 (every rank checkpointed after SIGUSR1): ``scontrol requeue``, and the job starts again in a new
  allocation.
- A step that ended on a GPU fault (the supervisor's verdict, recorded in ``<run>/gpu_fault.json`` with the node's
  Slurm name, `supervisor.gpus.exclusion.NodeFault`): ``scontrol requeue``, then ``scontrol update ExcNodeList=`` with the
  job's excluded nodes and this one (Slurm changes a job's excluded nodes only once it is pending again), so the next
  allocation lands on other nodes and resumes from the latest checkpoint. It does not requeue when the partition
  would have too few nodes left for the job, or when Slurm refuses (``--no-requeue``, its requeue limit); each
  allocation excludes one more node, so the requeues end. ``SUPERVISOR_NODE_EXCLUSION=0`` turns it off (for lost
  nodes too). A program fault leaves no record: the job fails with the step's exit code, as any other code does.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TypeVar

import hostlist

from supervisor.control.wire import LOST_CODE, SECRET_ENV, SECRET_FILE_ENV
from supervisor.gpus.exclusion import GPU_FAULT_FILE, LOST_NODE_FILE, LostNode, NodeFault
from supervisor.launch.cli import build_parser, split_entry_args
from trainer.errors import USER_ERROR_EXIT_CODE, UserError

ROOT = Path(__file__).resolve().parents[2]
REQUEUE_EXIT_CODE = 128 + 10  # SIGUSR1: the time-limit warning, answered with a checkpoint
NODE_EXCLUSION_ENV = "SUPERVISOR_NODE_EXCLUSION"
Record = TypeVar("Record", NodeFault, LostNode)


def step_command(env: dict[str, str], flags: list[str]) -> list[str]:
    cpus = [f"--cpus-per-task={env['SLURM_CPUS_PER_TASK']}"] if env.get("SLURM_CPUS_PER_TASK") else []
    return ["srun", "--ntasks-per-node=1", *cpus, "--kill-on-bad-exit=1", "bash", str(ROOT / "run_training.sh"),
            "--resume", "auto", *flags]


def step_task(job_id: str, node: str) -> int | None:
    """The pid of this job's training step task on `node` (this host), None where there is none (yet, or any more).

    ``scontrol listpids`` lists a step's processes on the local node, the task's with its local task id, its
    descendants (the ranks) with "-"; the node is named for hosts that run several slurmd."""
    out = subprocess.run(["scontrol", "listpids", job_id, *([node] if node else [])], capture_output=True, text=True)
    for line in out.stdout.splitlines()[1:]:  # PID JOBID STEPID LOCALID GLOBALID
        fields = line.split()
        if len(fields) == 5 and fields[2].isdigit() and fields[3] == "0" and fields[0].isdigit():
            return int(fields[0])
    return None


def pass_on_warning(job_id: str, node: str) -> None:
    """Slurm's time-limit warning, to this node's supervisor only (see the module's docstring for why)."""
    pid = step_task(job_id, node)
    if pid is None:
        print(f"time-limit warning: no supervisor of job {job_id} runs on node {node} to pass it to", flush=True)
        return
    print(f"time-limit warning: passing SIGUSR1 on to the supervisor on node {node} (pid {pid})", flush=True)
    try:
        os.kill(pid, signal.SIGUSR1)
    except ProcessLookupError:
        pass  # the step ended meanwhile


def node_exclusion(env: Mapping[str, str]) -> bool:
    value = env.get(NODE_EXCLUSION_ENV, "1")
    if value not in ("0", "1"):
        raise UserError(f"{NODE_EXCLUSION_ENV}={value!r} must be 1 (the default: a node whose GPU failed, or that was "
                        f"lost, is left out of the job's next allocation) or 0 (the job fails instead)")
    return value == "1"


def recorded(kind: type[Record], name: str, flags: list[str], job_id: str, allocation: int) -> list[Record]:
    """What the supervisors recorded in this allocation of the job (`kind`, in files called `name`: the GPU faults,
    the lost nodes), found in the run folders under the step's --log-dir (shared by the nodes, as the checkpoints
    are), told from other runs' by the job id and restart count."""
    log_dir = Path(build_parser().parse_known_args(split_entry_args(flags)[0])[0].log_dir)
    found = []
    for path in sorted(log_dir.glob(f"*/{name}")):
        try:
            record = kind(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue  # not a record this job could have written
        if record.slurm_job_id == job_id and record.slurm_restart_count == allocation:
            found.append(record)
    return found


def lost_nodes(lost: list[LostNode], node_list: str | None) -> dict[str, str]:
    """Each lost node once: its Slurm name (from the job's node list, in node-rank order; "?" where the list does
    not say) → a line naming it and the headline that named it.

    A record written by a node that an earlier record had already named lost is left out: a frozen node's supervisor
    wakes when Slurm ends its task (SIGCONT before SIGTERM), finds the others silent for as long as it was frozen,
    and records them lost in turn."""
    names = hostlist.expand_hostlist(node_list) if node_list else []

    def name(node: int) -> str:
        return names[node] if node < len(names) else "?"

    kept: list[LostNode] = []
    for record in sorted(lost, key=lambda r: r.time):
        if record.seen_by not in {name(earlier.node) for earlier in kept if earlier.time < record.time}:
            kept.append(record)
    first: dict[int, LostNode] = {}
    for record in kept:
        first.setdefault(record.node, record)
    return {name(node): f"node {name(node)} (node {node} of the job) was lost: {record.why}"
            for node, record in sorted(first.items())}


def scontrol_job(job_id: str) -> dict[str, str]:
    """``scontrol show job`` as a dict (ExcNodeList, Partition, ...); empty where scontrol cannot say."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True)
    return dict(re.findall(r"(\w+)=(\S*)", out.stdout))


def hosts(listed: str | None) -> set[str]:
    """A Slurm host list ("n[2-3]", "(null)" for none) as names."""
    return set(hostlist.expand_hostlist(listed)) if listed and listed != "(null)" else set()


def partition_nodes(partition: str) -> set[str] | None:
    """The nodes of the job's partitions (a comma list), None where sinfo cannot say."""
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N", "-p", partition], capture_output=True, text=True)
    nodes = set(out.stdout.split()) if out.returncode == 0 else set()
    return nodes or None


def leave_out(job_id: str, faulty: set[str], nodes_needed: int) -> None:
    """Requeue the job without `faulty` (nodes whose GPU failed, or that were lost), or say in one line why not."""
    named = hostlist.collect_hostlist(sorted(faulty))
    info = scontrol_job(job_id)
    before = hosts(info.get("ExcNodeList"))
    excluded = hostlist.collect_hostlist(sorted(before | faulty))
    if faulty <= before:  # Slurm placed the job there anyway: another requeue would end the same way
        print(f"not requeueing job {job_id}: node {named} was excluded already (ExcNodeList={excluded})", flush=True)
        return
    partition = info.get("Partition", "")
    left = partition_nodes(partition) if partition else None
    if left is not None and len(left - before - faulty) < nodes_needed:
        print(f"not requeueing job {job_id}: without node {named} partition {partition} has "
              f"{len(left - before - faulty)} node(s) left, fewer than the job's {nodes_needed}", flush=True)
        return
    # Slurm stops the job's processes once it is requeued; this one still has the excluded nodes to set
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    requeue = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True)
    if requeue.returncode != 0:
        print(f"not requeueing job {job_id}: scontrol requeue refused ({requeue.stderr.strip() or 'no reason'})",
              flush=True)
        return
    update = subprocess.run(["scontrol", "update", f"JobId={job_id}", f"ExcNodeList={excluded}"],
                            capture_output=True, text=True)
    if update.returncode != 0:
        print(f"requeued job {job_id}, but Slurm did not take ExcNodeList={excluded} "
              f"({update.stderr.strip() or 'no reason'}): the next allocation may include node {named}", flush=True)
        return
    print(f"requeued job {job_id} without node {named} (ExcNodeList={excluded}); its next allocation resumes from "
          f"the latest checkpoint", flush=True)


def run_job(env: dict[str, str], flags: list[str]) -> int:
    job_id = env.get("SLURM_JOB_ID")
    if not job_id:
        raise UserError("train_slurm.sbatch is a Slurm job script and SLURM_JOB_ID is not set; submit it with sbatch "
                        "train_slurm.sbatch [flags...] (or start run_training.sh yourself)")
    exclude = node_exclusion(env)
    if not env.get(SECRET_ENV) and not env.get(SECRET_FILE_ENV):
        env[SECRET_ENV] = secrets.token_hex(32)
    # before the step starts: SIGUSR1's default action would end this process, and the job with it
    node = env.get("SLURMD_NODENAME", "")
    signal.signal(signal.SIGUSR1, lambda *_: pass_on_warning(job_id, node))
    code = subprocess.run(step_command(env, flags), env=env).returncode
    code = code if code >= 0 else 128 - code  # srun itself ended by a signal: the shell's convention
    if code == REQUEUE_EXIT_CODE:
        print(f"stopped by the time-limit warning (exit {code}): requeueing job {job_id}; its next allocation "
              f"resumes from the latest checkpoint", flush=True)
        subprocess.run(["scontrol", "requeue", job_id])
    elif code not in (0, USER_ERROR_EXIT_CODE):
        allocation = int(env.get("SLURM_RESTART_COUNT") or 0)
        lost = lost_nodes(recorded(LostNode, LOST_NODE_FILE, flags, job_id, allocation), env.get("SLURM_JOB_NODELIST"))
        for line in lost.values():
            print(f"{line}; the job ends with exit code {LOST_CODE}", flush=True)
        if lost:
            # the supervisors' code: the task Slurm killed on the lost node (--kill-on-bad-exit) gave srun its own
            code = LOST_CODE
        faults = recorded(NodeFault, GPU_FAULT_FILE, flags, job_id, allocation)
        for fault in faults:
            print(f"GPU fault on {fault.line()}", flush=True)
        faulty = {fault.node for fault in faults} | (set(lost) - {"?"})
        if faulty and not exclude:
            print(f"not requeueing job {job_id}: node exclusion is off ({NODE_EXCLUSION_ENV}=0)", flush=True)
        elif faulty:
            leave_out(job_id, faulty, int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or 1))
    return code


def main() -> int:
    try:
        return run_job(dict(os.environ), sys.argv[1:])
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return USER_ERROR_EXIT_CODE


if __name__ == "__main__":
    sys.exit(main())
