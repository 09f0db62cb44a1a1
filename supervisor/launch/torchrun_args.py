"""torchrun's command line, verbatim, read with torchrun's meanings into the supervisor's own launch flags.

    python -m supervisor [torchrun's flags] [--gpus IDS] [--hang-timeout S] ... SCRIPT [SCRIPT ARGS...]
    python -m supervisor [flags] -m MODULE [ARGS...]        python -m supervisor [flags] --no-python PROGRAM [ARGS...]

A command line is torchrun's when it has a positional program (everything after it is the program's, as in
torchrun: no ``--`` needed), ``-m``, ``--no-python``, or any flag only torchrun has (`recognised`); `parse` turns it
into the namespace the supervisor's own command line gives (`supervisor.launch.cli` then plans and launches the same
way), plus what only a torchrun program needs (its run id, role, how to start it). Both spellings of torchrun's
flags (``--nproc-per-node`` and ``--nproc_per_node``) and both forms (``--flag=value``, ``--flag value``) work, as in
torchrun, whose parser (``torch.distributed.run.get_args_parser``) this one mirrors. As in torchrun, a flag left off
the command line takes its value from ``PET_<NAME>`` (``PET_NPROC_PER_NODE``, ``PET_NNODES``, ``PET_NODE_RANK``,
``PET_MASTER_ADDR``, ``PET_MASTER_PORT``, ``PET_STANDALONE=1``, ...): what Kubeflow's PyTorchJob and other operators
set before they run a plain ``torchrun script.py`` (`environment_defaults`); ``PYTHON_EXEC``, as in torchrun, names
the interpreter that runs a script or a module.

What each of torchrun's flags becomes:

* honoured — ``--nproc-per-node`` (a number; ``gpu``: every usable GPU; ``auto``: every usable GPU, else one CPU
  rank per core; ``cpu``: one CPU rank per core), ``--nnodes N`` (or ``N:N``), ``--node-rank`` (left out on several
  nodes, as c10d users do: the node at the endpoint is node 0 and numbers the others as they join,
  supervisor/control), ``--master-addr``, ``--master-port``, ``--standalone`` (one node, a free port),
  ``--rdzv-backend static|c10d`` with ``--rdzv-endpoint HOST[:PORT]`` (node 0's address and port) and ``--rdzv-id``
  (TORCHELASTIC_RUN_ID),
  ``--max-restarts``, ``--role`` (ROLE_NAME), ``-m``, ``--no-python``, ``--shutdown-timeout`` (the grace period),
  ``--virtual-local-rank`` (one visible GPU per rank, LOCAL_RANK=0), ``--log-dir`` (the root of the run folders),
  ``--local-ranks-filter`` (the console shows those local ranks' lines; the log files keep every rank's),
  ``--signals-to-handle`` (the ranks' TORCHELASTIC_SIGNALS_TO_HANDLE);
* accepted, with one console line saying what happens instead — the flags for torchrun's own log layout, its
  monitoring and its rendezvous options (`NOTED`);
* refused with one ``error:`` line — what this launcher cannot honour: elastic node ranges (``--nnodes 1:4``),
  rendezvous backends other than ``static`` and ``c10d`` (``etcd``), device kinds other than GPUs and CPUs; and what
  would fail only once the ranks run: a ``--rdzv-endpoint`` torchrun would not parse either, ``-m`` given a script's
  path (node 0's address and port are checked later, `supervisor.launch.cli.check_rendezvous`).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from supervisor.gpus import discovery
from supervisor.plan.spec import (
    IMPLICIT_STANDALONE_SINCE,
    SIGNALS_TO_HANDLE,
    available_cores,
    torch_release,
)
from trainer.errors import UserError

DEFAULT_C10D_PORT = 29400  # torchrun's port for a c10d endpoint given without one
DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT = "127.0.0.1", 29500  # torchrun's static rendezvous, when not given
USAGE = "python -m supervisor [FLAGS] SCRIPT [ARGS...] (or -m MODULE, or --no-python PROGRAM)"

# torchrun's flags that change nothing here: (option strings, takes a value, what happens instead). "{v}" is the value.
NOTED: dict[str, tuple[tuple[str, ...], bool, str]] = {
    "redirects": (("-r", "--redirects"), True,
                  "every rank's output reaches the console, prefixed GPU<id>: (CPU<n>:), and its own log file "
                  "<run folder>/gpu<id>.log (cpu<n>.log)"),
    "tee": (("-t", "--tee"), True,
            "every rank's output is prefixed on the console and kept in <run folder>/gpu<id>.log (cpu<n>.log)"),
    "duplicate_stdout_filters": (("--duplicate-stdout-filters", "--duplicate_stdout_filters"), True,
                                 "not applied: each rank's whole output is in its log file in the run folder"),
    "duplicate_stderr_filters": (("--duplicate-stderr-filters", "--duplicate_stderr_filters"), True,
                                 "not applied: each rank's whole output is in its log file in the run folder"),
    "logs_specs": (("--logs-specs", "--logs_specs"), True,
                   "not used: the run folder holds supervisor.log and one log file per rank"),
    "monitor_interval": (("--monitor-interval", "--monitor_interval"), True,
                         "not needed: a rank's exit is seen the moment it happens (no polling)"),
    "start_method": (("--start-method", "--start_method"), True,
                     "each rank is a process of its own, started by exec in a fresh interpreter"),
    "run_path": (("--run-path", "--run_path"), False,
                 "the script runs in a fresh interpreter of each rank's own, as without it"),
    "event_log_handler": (("--event-log-handler", "--event_log_handler"), True,
                          "not used: the run's events are in <run folder>/supervisor.log"),
    "rdzv_conf": (("--rdzv-conf", "--rdzv_conf"), True,
                  "not used: the ranks meet at MASTER_ADDR:MASTER_PORT, rank 0 hosting the store"),
    "numa_binding": (("--numa-binding", "--numa_binding"), True, "not applied: the ranks are not bound to CPUs"),
    "signals_to_handle": (("--signals-to-handle", "--signals_to_handle"), True,
                          "the ranks get it in TORCHELASTIC_SIGNALS_TO_HANDLE, as under torchrun; the supervisor's "
                          "own handling applies: SIGINT, SIGTERM, SIGHUP and SIGUSR1 stop every rank (SIGTERM, then "
                          "SIGKILL after the grace period)"),
}

# what torchrun's parser checks of them: a value it refuses is refused here too
NOTED_CHOICES = {"start_method": ("spawn", "fork", "forkserver"),
                 "numa_binding": ("node", "socket", "exclusive", "core-complex")}
NOTED_TYPES = {"monitor_interval": float}


class OneLineParser(argparse.ArgumentParser):
    """argparse's complaints as one ``error:`` line (a UserError), never the usage dump."""

    def error(self, message: str) -> None:  # type: ignore[override]
        if "training_script" in message:
            message = "no program to run"
        raise UserError(f"{message}; torchrun's command line: {USAGE}")


@dataclass
class TorchrunLaunch:
    """A torchrun command line, read: the supervisor's namespace, and what only a torchrun program needs."""

    args: argparse.Namespace  # as `supervisor.launch.cli.build_parser` would give it, the launch flags filled in
    program: str  # a script or an executable as typed (the program's sys.argv[0]); a module's name for mode "module"
    mode: str  # "script" | "module" | "executable" (`supervisor.plan.spec.Plan.entry_mode`)
    program_args: list[str]
    run_id: str  # TORCHELASTIC_RUN_ID
    role: str  # ROLE_NAME
    virtual_local_rank: bool
    signals_to_handle: str  # TORCHELASTIC_SIGNALS_TO_HANDLE
    console_ranks: frozenset[int] | None  # --local-ranks-filter: the local ranks shown on the console (None: all)
    python: str  # the interpreter of a script or module: PYTHON_EXEC where set, as torchrun reads it
    notes: list[str] = field(default_factory=list)  # one line per flag accepted but done otherwise


def build_parser(add_own_flags: Callable[[argparse._ArgumentGroup], None],
                 from_environment: bool = False) -> OneLineParser:
    """torchrun's flags (their defaults from ``PET_*`` with `from_environment`), then the supervisor's own launch
    flags (`add_own_flags`), then the program."""
    parser = OneLineParser(prog="python -m supervisor", allow_abbrev=False,
                           description="torchrun's command line; everything after the program is the program's.")
    t = parser.add_argument_group("torchrun's flags")
    t.add_argument("--nproc-per-node", "--nproc_per_node", "--nproc", dest="nproc_per_node", metavar="N|gpu|cpu|auto")
    t.add_argument("--nnodes", metavar="N")
    t.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int, metavar="R")
    t.add_argument("--master-addr", "--master_addr", dest="master_addr", metavar="HOST")
    t.add_argument("--master-port", "--master_port", dest="master_port", type=int, metavar="PORT")
    t.add_argument("--standalone", action="store_true")
    t.add_argument("--rdzv-backend", "--rdzv_backend", dest="rdzv_backend", default="static")
    t.add_argument("--rdzv-endpoint", "--rdzv_endpoint", dest="rdzv_endpoint", default="")
    t.add_argument("--rdzv-id", "--rdzv_id", dest="rdzv_id", default="none")
    t.add_argument("--max-restarts", "--max_restarts", dest="max_restarts", type=int, default=0)
    t.add_argument("--role", default="default")
    t.add_argument("-m", "--module", action="store_true")
    t.add_argument("--no-python", "--no_python", dest="no_python", action="store_true")
    t.add_argument("--log-dir", "--log_dir", dest="log_dir")
    t.add_argument("--shutdown-timeout", "--shutdown_timeout", dest="shutdown_timeout", type=float, metavar="S")
    t.add_argument("--virtual-local-rank", "--virtual_local_rank", dest="virtual_local_rank", action="store_true")
    t.add_argument("--local-addr", "--local_addr", dest="local_addr", metavar="HOST")
    t.add_argument("--local-ranks-filter", "--local_ranks_filter", dest="local_ranks_filter", metavar="RANKS")
    for dest, (flags, takes_value, _) in NOTED.items():
        kind = {"choices": NOTED_CHOICES.get(dest), "type": NOTED_TYPES.get(dest)} if takes_value else \
            {"action": "store_true"}
        t.add_argument(*flags, dest=dest, **kind)
    if from_environment:
        environment_defaults(t._group_actions)
    add_own_flags(parser.add_argument_group("the supervisor's own launch flags"))
    parser.add_argument("training_script")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return parser


def environment_defaults(actions: list[argparse.Action]) -> None:
    """Each torchrun flag's default from ``PET_<DEST>`` where it is set (torch.distributed.argparse_util's `env` and
    `check_env`): a value for a flag that takes one, 0 or 1 for a switch. A value the flag would refuse is refused
    here, naming the variable."""
    for action in actions:
        name = f"PET_{action.dest.upper()}"
        value = os.environ.get(name)
        if value is None:
            continue
        flag = long_name(action)
        try:
            if action.nargs == 0:
                action.default = bool(int(value))
            else:
                action.default = value if action.type is None else action.type(value)
        except (TypeError, ValueError):
            expected = "0 or 1" if action.nargs == 0 else f"a value for {flag}"
            raise UserError(f"{name}={value!r}: expected {expected} (torchrun reads it as {flag} when the command line "
                            f"leaves that out); fix or unset it") from None


def find_action(name: str, parser: argparse.ArgumentParser) -> argparse.Action | None:
    """The flag `name` stands for in `parser`: itself, or the one long flag it begins (torchrun's parser takes
    ``--nproc_per 2`` and ``--master_a h``, argparse's abbreviations); None for no flag or several."""
    actions = parser._option_string_actions
    if name in actions:
        return actions[name]
    found = {id(a): a for flag, a in actions.items() if name.startswith("--") and flag.startswith(name)}
    return next(iter(found.values())) if len(found) == 1 else None


def long_name(action: argparse.Action) -> str:
    """A flag's name written out: its first long spelling (``--nproc-per-node``)."""
    return max(action.option_strings, key=len)


def split_program(argv: list[str], parser: argparse.ArgumentParser) -> tuple[list[str], list[str]]:
    """`argv` as (the flags, each abbreviation written out in full; the program and its arguments). The program
    starts at the first word that is not a flag or a flag's value, or after ``--``: what follows is the program's
    alone, never read as flags (torchrun's own parser stumbles on a program's ``--max 1``)."""
    flags: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            return flags, argv[i + 1:]
        if not token.startswith("-") or token == "-":
            return flags, argv[i:]
        name, equals, value = token.partition("=")
        action = find_action(name, parser)
        if action is None and name.startswith("--"):
            near = sorted({long_name(a) for flag, a in parser._option_string_actions.items()
                           if flag.startswith(name)})
            if near:
                raise UserError(f"{name} is ambiguous: it could be {', '.join(near)}; write the flag out")
        if action is not None and name not in action.option_strings:
            name = long_name(action)
        flags.append(name + equals + value)
        takes_value = action is not None and action.nargs != 0 and not equals
        flags += argv[i + 1:i + 2] if takes_value else []
        i += 2 if takes_value else 1
    return flags, []


def recognised(argv: list[str], own: argparse.ArgumentParser, torchrun: argparse.ArgumentParser) -> bool:
    """Whether `argv` is torchrun's command line: a positional program, or a flag of torchrun's that the supervisor's
    own command line (`own`) does not have. After ``--`` the supervisor's own command line has the trainer's config
    flags, or the arguments of the program --entry names; a program there with no --entry before it (``python -m
    supervisor -- train.py``) is torchrun's, which reads ``--`` as the end of its flags."""
    flags, program = split_program(argv, own)
    own_only = all(find_action(token.partition("=")[0], own) is not None
                   or find_action(token.partition("=")[0], torchrun) is None
                   for token in flags if token.startswith("-"))
    if not own_only:
        return True
    if argv[len(flags):len(flags) + 1] == ["--"]:  # what follows --: --entry's arguments, or the trainer's flags
        entry = any(find_action(token.partition("=")[0], own) is find_action("--entry", own) for token in flags)
        return not entry and bool(program) and not program[0].startswith("-")
    return bool(program)


def parse(argv: list[str], add_own_flags: Callable[[argparse._ArgumentGroup], None],
          defaults: argparse.Namespace) -> TorchrunLaunch:
    """torchrun's command line → the supervisor's namespace (`defaults` with the launch flags set) and the rest."""
    parser = build_parser(add_own_flags, from_environment=True)
    flags, program = split_program(argv, parser)
    t = parser.parse_args([*flags, "--", *program] if program else flags)
    args = argparse.Namespace(**vars(defaults))
    for name in ("gpus", "allow_busy_gpus", "isolate_gpus", "grace_period", "hang_timeout", "startup_timeout",
                 "gpu_exclusion", "min_gpus", "no_footer", "max_restarts", "local_addr", "node_timeout",
                 "join_timeout"):
        setattr(args, name, getattr(t, name))
    if t.log_dir is not None:
        args.log_dir = t.log_dir
    if t.shutdown_timeout is not None:
        args.grace_period = t.shutdown_timeout
    notes = [f"--{dest.replace('_', '-')}{shown_value(value)}: {text}"
             for dest, (_, _, text) in NOTED.items() if (value := getattr(t, dest)) not in (None, False)]
    if t.log_dir is not None:
        notes.append(f"--log-dir {t.log_dir}: the run folder is {t.log_dir}/<time>-<program>/ (supervisor.log, a log "
                     f"file per rank, errors/ for @record's error files), not torchrun's <run id>/attempt_<n>/")
    args.spelling = {"nproc": "--nproc-per-node", "grace_period": "--shutdown-timeout", "node_rank": "--node-rank",
                     "master_addr": "--master-addr", "master_port": "--master-port",
                     "max_restarts": "--max-restarts"}
    nodes(t, args, notes)
    per_node(t.nproc_per_node, args)
    mode, program = program_of(t)
    return TorchrunLaunch(args, program, mode, list(t.training_script_args), run_id(t), t.role,
                          t.virtual_local_rank, t.signals_to_handle or SIGNALS_TO_HANDLE,
                          console_ranks(t.local_ranks_filter), os.environ.get("PYTHON_EXEC") or sys.executable, notes)


def shown_value(value: object) -> str:
    """A flag's value as a note shows it after the flag: nothing for a switch, a number as typed (1, not 1.0)."""
    if value is True:
        return ""
    return f" {value:g}" if isinstance(value, float) else f" {value}"


def nodes(t: argparse.Namespace, args: argparse.Namespace, notes: list[str]) -> None:
    """--nnodes, --node-rank and where node 0 is: static (--master-addr/--master-port), c10d (--rdzv-endpoint),
    or --standalone (one node, a free port). Several nodes given no address meet where torchrun's would: a static
    rendezvous at 127.0.0.1:29500, a c10d one at localhost:29400 (every node on this host; `notes` says so)."""
    low, _, high = (t.nnodes or "1").partition(":")
    try:
        nnodes, most = int(low), int(high or low)
    except ValueError:
        raise UserError(f"--nnodes {t.nnodes}: expected a number of nodes") from None
    if nnodes != most:
        raise UserError(f"--nnodes {t.nnodes}: elastic node ranges are not supported; give the number of nodes "
                        f"(--nnodes {most}), and every node starts together")
    if t.rdzv_backend not in ("static", "c10d"):
        raise UserError(f"--rdzv-backend {t.rdzv_backend}: only static and c10d rendezvous are supported (the "
                        f"nodes meet at node 0's HOST:PORT)")
    args.nnodes = None if t.nnodes is None else nnodes
    args.node_rank, args.master_addr, args.master_port = t.node_rank, t.master_addr, t.master_port
    if t.standalone:
        if nnodes > 1:
            raise UserError(f"--standalone is a single-node run, but --nnodes is {t.nnodes}")
        args.nnodes, args.master_port = 1, None
    if t.standalone or implicit_standalone(t):  # torchrun's rendezvous then runs on localhost:<a free port>
        args.master_addr = "localhost"
        return
    if t.rdzv_endpoint.strip():
        args.master_addr, port = endpoint(t.rdzv_endpoint)
        args.master_port = port or None  # port 0: a free one, as torchrun picks
    elif nnodes > 1 and t.rdzv_backend == "c10d":
        args.master_addr, args.master_port = "localhost", DEFAULT_C10D_PORT
        notes.append(f"--rdzv-backend c10d without --rdzv-endpoint: node 0 is localhost:{DEFAULT_C10D_PORT}, as "
                     f"under torchrun (every node on this host; --rdzv-endpoint HOST:PORT names node 0 elsewhere)")
    elif nnodes > 1 and (t.master_addr is None or t.master_port is None):
        args.master_addr = t.master_addr or DEFAULT_MASTER_ADDR
        args.master_port = DEFAULT_MASTER_PORT if t.master_port is None else t.master_port
        if t.master_addr is None:
            notes.append(f"--master-addr not given: node 0 is {DEFAULT_MASTER_ADDR}:{args.master_port}, as under "
                         f"torchrun (every node on this host; --master-addr HOST names node 0 elsewhere)")
        else:
            notes.append(f"--master-port not given: node 0's port is {DEFAULT_MASTER_PORT}, as under torchrun")


def endpoint(value: str) -> tuple[str, int]:
    """--rdzv-endpoint HOST[:PORT] read by torchrun's rules: a bracketed IPv6 address (``[::1]:29400``), a port of
    0-65535 after the last colon (29400 when there is none), a host of letters, digits, dots, colons, dashes and
    underscores. Anything else is refused here: the ranks would retry it until the store's 30-minute timeout."""
    text = value.strip()
    if text.count(":") > 1 and not text.startswith("["):
        raise UserError(f"--rdzv-endpoint {value}: an IPv6 address goes in brackets, before the port "
                        f"([{text}]:{DEFAULT_C10D_PORT}, or [{text}] for port {DEFAULT_C10D_PORT}); torchrun would "
                        f"read everything after its last colon as the port")
    if text.startswith("[") and text.endswith("]"):
        host, port = text, str(DEFAULT_C10D_PORT)
    else:
        host, colon, port = text.rpartition(":")
        if not colon:
            host, port = text, str(DEFAULT_C10D_PORT)
    if len(host) > 1 and host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not (number(port) and int(port) < 1 << 16 and re.fullmatch(r"[\w.:-]+", host)):
        raise UserError(f"--rdzv-endpoint {value!r}: expected HOST[:PORT], node 0's host name or address (an IPv6 "
                        f"address in brackets: [::1]:29400) and a port within 0-65535")
    return host, int(port)


def number(text: str) -> bool:
    """ASCII digits only: ``str.isdigit`` also takes ``²`` and other digits `int` refuses."""
    return text.isascii() and text.isdigit()


def console_ranks(value: str | None) -> frozenset[int] | None:
    """--local-ranks-filter 0,2: the local ranks whose lines reach the console (None: every rank's)."""
    if value is None:
        return None
    items = [item.strip() for item in value.split(",")]
    if not all(number(item) for item in items):
        raise UserError(f"--local-ranks-filter {value}: expected local ranks separated by commas "
                        f"(--local-ranks-filter 0,2)")
    return frozenset(map(int, items))


def per_node(value: str | None, args: argparse.Namespace) -> None:
    """--nproc-per-node: a number (torchrun's default is 1), or every usable GPU (gpu, auto), or a CPU rank per core
    (cpu; auto without a GPU)."""
    if value is None:
        args.nproc = None if args.gpus is not None else 1  # --gpus names the GPUs: one rank each
        return
    if number(value):
        args.nproc = int(value)
        if args.nproc < 1:
            raise UserError(f"--nproc-per-node must be at least 1, got {value}")
        return
    if value not in ("gpu", "cpu", "auto"):
        raise UserError(f"--nproc-per-node {value}: expected a number, gpu, cpu or auto (this launcher places ranks "
                        f"on NVIDIA GPUs or on CPUs)")
    args.nproc, args.cpu_ranks = None, available_cores()
    if value == "cpu":
        args.set = [*args.set, "system.device=cpu"]
    elif value == "gpu" and not discovery.discover().usable:
        raise UserError("--nproc-per-node gpu: no usable GPU on this machine (NVML and nvidia-smi found none, or "
                        "CUDA_VISIBLE_DEVICES hides them); --nproc-per-node cpu or auto runs CPU ranks")


def program_of(t: argparse.Namespace) -> tuple[str, str]:
    """How each rank starts the program: ``python SCRIPT``, ``python -m MODULE``, or the program itself
    (--no-python: found on PATH when it names no folder), each named as typed, as torchrun passes it; a program that
    is not there is refused here, before any rank would fail on it."""
    name = t.training_script
    if t.module and t.no_python:
        raise UserError("--no-python and -m/--module cannot be used together (torchrun refuses them too)")
    if t.module:
        if not all(part.isidentifier() for part in name.split(".")) or name.endswith(".py") and Path(name).is_file():
            raise UserError(f"-m {name}: -m takes a module's name (-m pkg.train); give a script's path without -m "
                            f"(python -m supervisor [FLAGS] {name})")
        return "module", name
    if t.no_python:
        found = shutil.which(name) if os.sep not in name else (name if os.access(name, os.X_OK) else None)
        if found is None or not Path(found).is_file():
            raise UserError(f"--no-python {name}: no such executable" + ("" if os.sep in name else " on PATH"))
        return "executable", name
    if not Path(name).is_file():
        raise UserError(f"{name}: no such file (the program to run; -m runs a module, --no-python an executable)")
    return "script", name


def run_id(t: argparse.Namespace) -> str:
    """TORCHELASTIC_RUN_ID as torchrun sets it: a fresh id for --standalone, and for a single node given neither a
    rendezvous endpoint nor --master-port (torch 2.12's torchrun on then runs a standalone rendezvous); else
    --rdzv-id."""
    return str(uuid.uuid4()) if t.standalone or implicit_standalone(t) else t.rdzv_id


def implicit_standalone(t: argparse.Namespace) -> bool:
    """torchrun on one node with neither a rendezvous endpoint nor --master-port runs as with --standalone, since
    torch 2.12 (`IMPLICIT_STANDALONE_SINCE`); before, it met at --master-addr (127.0.0.1) as any static rendezvous.
    The installed torch decides, as it decides what its own torchrun would do."""
    single = (t.nnodes or "1").rpartition(":")[2] == "1"
    return (t.rdzv_backend == "static" and not t.rdzv_endpoint and t.master_port is None and single
            and torch_release() >= IMPLICIT_STANDALONE_SINCE)

