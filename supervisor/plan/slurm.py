"""The node layout under Slurm: ``srun --ntasks-per-node=1 bash run_training.sh ...`` needs no multi-node flags.

Slurm starts one task per node (one supervisor each) and tells each one, in its environment, what torchrun's flags
would say:

    --nnodes       SLURM_NNODES (or SLURM_JOB_NUM_NODES)
    --node-rank    SLURM_NODEID
    --master-addr  the first host of SLURM_JOB_NODELIST (Slurm's host-list syntax, expanded as
                   `scontrol show hostnames` does, by python-hostlist: no scontrol needed)
    --master-port  derived from SLURM_JOB_ID, so every node computes the same port without talking to the others

It applies only to a job on more than one node (a one-node job is an ordinary single-node run: a free loopback port)
and only to the flags not given explicitly: those always win. Torch-free and quick, like the rest of the CLI.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass

from trainer.errors import UserError

# The port pair (PORT for the rendezvous, PORT+1 for the control channel) comes from this range: unprivileged, and
# below Linux's ephemeral range (32768-60999) so an outgoing connection cannot be holding it. Even ports only, so two
# jobs with neighbouring ids never share a port.
PORT_BASE = 10_000
PORT_PAIRS = 11_000  # the highest pair is 31998/31999
NODE_COUNT_VARS = ("SLURM_NNODES", "SLURM_JOB_NUM_NODES")


@dataclass(frozen=True)
class SlurmLayout:
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    variables: dict[str, str]  # the SLURM_* variables it was read from, for the console

    def describe(self, applied: list[str]) -> str:
        given = ", ".join(f"{k}={v}" for k, v in self.variables.items())
        return f"Slurm job layout ({given}): {' '.join(applied)}" if applied else \
            f"Slurm job layout ({given}) not used: --nnodes, --node-rank, --master-addr and --master-port were given"


def master_port(job_id: int) -> int:
    """The rendezvous port every node of job `job_id` agrees on; the control channel takes the next one."""
    return PORT_BASE + 2 * (job_id % PORT_PAIRS)


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list: `node[01-04,07]` → node01, `a[1-2],b3` → a1."""
    import hostlist  # here: only a multi-node Slurm job needs it

    try:
        hosts = hostlist.expand_hostlist(nodelist)
    except hostlist.BadHostlist as e:
        raise UserError(f"SLURM_JOB_NODELIST={nodelist!r} is not a Slurm host list ({e})") from None
    if not hosts:
        raise UserError(f"SLURM_JOB_NODELIST={nodelist!r} names no host")
    return hosts[0]


def need(env: Mapping[str, str], name: str) -> str:
    if name not in env:
        raise UserError(f"this Slurm job spans several nodes but {name} is not set; start one supervisor per node "
                        f"with srun --ntasks-per-node=1, or give --nnodes/--node-rank/--master-addr/--master-port")
    return env[name]


def read_int(env: Mapping[str, str], name: str) -> int:
    text = need(env, name)
    try:
        return int(text)
    except ValueError:
        raise UserError(f"{name}={text!r} is not a number") from None


def layout(env: Mapping[str, str]) -> SlurmLayout | None:
    """The layout a multi-node Slurm job describes, or None outside Slurm and in a one-node job."""
    if "SLURM_JOB_ID" not in env:
        return None
    count_var = next((name for name in NODE_COUNT_VARS if name in env), None)
    if count_var is None or read_int(env, count_var) <= 1:
        return None
    nnodes, node_rank, job_id = read_int(env, count_var), read_int(env, "SLURM_NODEID"), read_int(env, "SLURM_JOB_ID")
    tasks = env.get("SLURM_NTASKS")
    if tasks is not None and tasks.isdigit() and int(tasks) != nnodes:
        raise UserError(f"SLURM_NTASKS={tasks} on {nnodes} nodes: the supervisor starts every rank of its node "
                        f"itself, so run one task per node (srun --ntasks-per-node=1 bash run_training.sh ...)")
    nodelist = need(env, "SLURM_JOB_NODELIST")
    names = ("SLURM_JOB_ID", count_var, "SLURM_NODEID", "SLURM_JOB_NODELIST")
    return SlurmLayout(nnodes=nnodes, node_rank=node_rank, master_addr=first_host(nodelist),
                       master_port=master_port(job_id), variables={name: env[name] for name in names})


def apply(args: argparse.Namespace, env: Mapping[str, str]) -> str | None:
    """Fill in the multi-node flags the user left out from the Slurm job; the console line saying so, or None."""
    found = layout(env)
    if found is None:
        return None
    applied = []
    for flag, attr in (("--nnodes", "nnodes"), ("--node-rank", "node_rank"), ("--master-addr", "master_addr"),
                       ("--master-port", "master_port")):
        if getattr(args, attr) is None:
            value = getattr(found, attr)
            setattr(args, attr, value)
            applied.append(f"{flag} {value}")
    return found.describe(applied)
