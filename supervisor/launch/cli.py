"""``python -m supervisor``: arguments → config → devices → plan → `Launcher`.

    python -m supervisor [config flags] [--gpus IDS|auto] [--nproc N] [--entry SCRIPT] [-- SCRIPT ARGS...]
    python -m supervisor [torchrun's flags] [--gpus IDS] SCRIPT [SCRIPT ARGS...]      (torchrun's command line)

The config is resolved once (trainer.config: preset < --config files < flags) and written to
``<log-dir>/<run-id>/config.json``; every rank of the project's trainer starts as
``python pretrain_main.py --run-config <that file>``. ``--entry SCRIPT`` runs any other rank program instead (like
torchrun's training script): it gets only the arguments after ``--``, finds the config path in
``SUPERVISOR_RUN_CONFIG``, and no dataset is prepared for it. ``--no-prepare`` skips the dataset step for the trainer
too (the ranks then expect the cache to exist). torchrun's own command line runs a program written for torchrun
(`supervisor.launch.torchrun_args`): no config is written for it, its run folder is named after it (docs/torchrun.md).

Everything here runs before any rank exists, so a bad input ends as one ``error: ...`` line and exit code 2 with
nothing started.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from dataclasses import dataclass, field, replace
from itertools import count
from pathlib import Path

from supervisor.console import Console
from supervisor.control.wire import Timing, read_secret
from supervisor.gpus import discovery, preflight
from supervisor.gpus.exclusion import default_min_gpus
from supervisor.launch import torchrun_args
from supervisor.launch.agent import Launcher, run_folder_writes
from supervisor.launch.torchrun_args import TorchrunLaunch
from supervisor.plan import rendezvous
from supervisor.plan import slurm as slurm_layout
from supervisor.plan.spec import TRAINER_ENTRY, Plan, node_ranks
from trainer.config import PROJECT_ROOT, RUNS_DIR, Config
from trainer.config.resolve import add_config_arguments, handle_inspection_flags
from trainer.durable import check_writable
from trainer.errors import USER_ERROR_EXIT_CODE, UserError, exit_without_teardown
from trainer.model.estimate import DetectedGpus
from trainer.preflight import check_run, dry_run
from trainer.replay import from_flags as replay_from_flags

DEFAULT_CPU_RANKS = 2
MAX_NPROC = 1024  # ranks on one node: more is a typo, and would be planned (and spawned) one by one
MAX_TIMEOUT_S = 30 * 86400  # a month: longer is not a timeout (and infinity breaks the watcher's select)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m supervisor",
        description="Run one training process per GPU (CPU ranks where there is none): prefixed logs, kill-all on "
                    "the first failure, a hang watchdog, a failure report. Arguments after `--` go to the entry "
                    "script. torchrun's command line works too (python -m supervisor [torchrun's flags] SCRIPT "
                    "[ARGS...]; see docs/torchrun.md).")
    parser.set_defaults(cpu_ranks=DEFAULT_CPU_RANKS)  # torchrun's --nproc-per-node cpu|auto: one per core
    parser.set_defaults(spelling={})  # dest → its flag's name where a torchrun command line names it otherwise
    devices = parser.add_argument_group("devices")
    devices.add_argument("--nproc", type=int, metavar="N",
                         help=f"ranks on this node: the first N GPUs, or N CPU ranks (default {DEFAULT_CPU_RANKS}) "
                              f"when there is no GPU")
    add_own_launch_flags(devices)
    launch = parser.add_argument_group("launch")
    launch.add_argument("--entry", metavar="SCRIPT",
                        help=f"the rank program (default: the project's {TRAINER_ENTRY}); arguments after `--` "
                             f"go to it, the resolved config's path is in $SUPERVISOR_RUN_CONFIG")
    launch.add_argument("--replay", metavar="RUN",
                        help="replay a step of an earlier run (its run folder): its config and checkpoints, the same "
                             "ranks (--nproc 1 folds them onto one), up to --step with the NaN diagnostics on")
    launch.add_argument("--step", type=int, metavar="N", help="the step --replay replays, as the log lines count it")
    launch.add_argument("--no-prepare", action="store_true",
                        help="do not build the token cache before starting ranks (skipped anyway for another --entry)")
    launch.add_argument("--log-dir", default=str(RUNS_DIR), metavar="DIR",
                        help=f"root of the run folders (default: {RUNS_DIR})")
    launch.add_argument("--max-restarts", type=int, default=0, metavar="N",
                        help="restart the group after a failure, resuming from the latest checkpoint (default 0); "
                             "after a GPU fault, without that GPU")
    launch.add_argument("--dry-run", action="store_true",
                        help="print parameters, tokens per step, FLOPs per token and the per-GPU memory estimate "
                             "for the GPUs that would be used, then exit (the model is built on the meta device)")
    nodes = parser.add_argument_group("multi-node (torchrun's meanings)")
    nodes.add_argument("--nnodes", type=int, metavar="N", help="default 1, or SLURM_NNODES in a Slurm job")
    nodes.add_argument("--node-rank", type=int, metavar="R",
                       help="SLURM_NODEID in a Slurm job; else, on several nodes, given as the nodes join: node 0 is "
                            "the node at --master-addr")
    nodes.add_argument("--master-addr", metavar="HOST", help="node 0's address (multi-node)")
    nodes.add_argument("--master-port", type=int, metavar="PORT",
                       help="node 0's rendezvous port (multi-node; the control channel uses PORT+1); "
                            "single node: a free port is chosen. In a Slurm job on several nodes all four flags "
                            "default to what the job's SLURM_* variables say")
    nodes.add_argument("--local-addr", metavar="HOST",
                       help="this node's address, the one node 0 sees its control connection come from (default: "
                            "the system's choice)")
    add_own_node_flags(nodes)
    add_config_arguments(parser)
    return parser


def add_own_node_flags(group: argparse._ArgumentGroup) -> None:
    """The multi-node flags torchrun does not have, which both command lines take."""
    group.add_argument("--node-timeout", type=float, default=30.0, metavar="S",
                       help="a node whose supervisor is not heard from for this long (frozen, cut off) is lost: "
                            "every node stops its ranks, exit 125 (default 30; heartbeats go every few seconds)")
    group.add_argument("--join-timeout", type=float, default=300.0, metavar="S",
                       help="a node that has not joined node 0's control channel this long after node 0 started is "
                            "lost, and named (default 300)")


def add_torchrun_side_flags(group: argparse._ArgumentGroup) -> None:
    """What torchrun's command line takes of the supervisor's own: the launch flags and the node timeouts."""
    add_own_launch_flags(group)
    add_own_node_flags(group)


def add_own_launch_flags(group: argparse._ArgumentGroup) -> None:
    """The supervisor's flags that both its own command line and torchrun's (`supervisor.launch.torchrun_args`) take."""
    group.add_argument("--gpus", metavar="IDS|auto",
                       help="physical GPU ids (0,3,5), or 'auto' for the least busy (with --nproc N: the N least "
                            "busy); default: every usable GPU")
    group.add_argument("--allow-busy-gpus", action="store_true",
                       help="start on GPUs another process already uses (default: refuse them; --gpus auto skips "
                            "them)")
    group.add_argument("--isolate-gpus", action="store_true",
                       help="another program than the trainer sees only its own GPU (CUDA_VISIBLE_DEVICES=<id>: "
                            "it uses cuda:0); default: the run's GPUs in local-rank order, so cuda:LOCAL_RANK is "
                            "its own, as under torchrun. The trainer always sees its own alone")
    group.add_argument("--grace-period", type=float, default=30.0, metavar="S",
                       help="SIGTERM → SIGKILL delay when stopping ranks (default 30)")
    group.add_argument("--hang-timeout", type=float, default=300.0, metavar="S",
                       help="a rank with no progress for this long stalls the run (default 300; 0 disables)")
    group.add_argument("--startup-timeout", type=float, default=900.0, metavar="S",
                       help="the allowance before the first step and during start-up, evaluation and checkpoint "
                            "phases (default 900)")
    group.add_argument("--no-gpu-exclusion", dest="gpu_exclusion", action="store_false",
                       help="restart on the same GPUs even after a GPU fault (default: leave the faulty GPU out)")
    group.add_argument("--min-gpus", type=int, metavar="N",
                       help="stop rather than restart on fewer GPUs than this after an exclusion (default: half "
                            "the run's GPUs, rounded up)")
    group.add_argument("--no-footer", action="store_true", help="no live footer on a terminal")


def split_entry_args(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1:]
    return argv, []


def flag(args: argparse.Namespace, dest: str) -> str:
    """The flag setting `dest` as the command line spells it: torchrun's name for a torchrun command line
    (``--nproc-per-node``, ``--shutdown-timeout``), else the supervisor's own (``--nproc``, ``--grace-period``)."""
    return args.spelling.get(dest) or f"--{dest.replace('_', '-')}"


def check_flags(args: argparse.Namespace) -> None:
    if args.nproc is not None and not 1 <= args.nproc <= MAX_NPROC:
        raise UserError(f"{flag(args, 'nproc')} must be within 1-{MAX_NPROC:,} (ranks on this node), got "
                        f"{args.nproc}")
    for name in ("grace_period", "hang_timeout", "startup_timeout"):
        seconds = getattr(args, name)
        if not 0 <= seconds <= MAX_TIMEOUT_S:  # NaN fails this too: a NaN allowance would stall the run at once
            raise UserError(f"{flag(args, name)} must be a number of seconds within 0-{MAX_TIMEOUT_S:,}"
                            f"{' (0 disables the watchdog)' if name == 'hang_timeout' else ''}, got {seconds:g}")
    for name in ("node_timeout", "join_timeout"):  # no 0: a node that may never be lost hangs the others forever
        if not 0 < (seconds := getattr(args, name)) <= MAX_TIMEOUT_S:
            raise UserError(f"{flag(args, name)} must be a number of seconds within (0, {MAX_TIMEOUT_S:,}], "
                            f"got {seconds:g}")
    if args.max_restarts < 0:
        raise UserError(f"{flag(args, 'max_restarts')} must not be negative, got {args.max_restarts}")
    if args.nnodes < 1:
        raise UserError(f"--nnodes must be at least 1, got {args.nnodes}")
    if args.node_rank is not None and not 0 <= args.node_rank < args.nnodes:
        raise UserError(f"{flag(args, 'node_rank')} must be within [0, --nnodes) (got --nnodes {args.nnodes} "
                        f"{flag(args, 'node_rank')} {args.node_rank})")
    port = flag(args, "master_port")
    if args.nnodes > 1:
        if args.master_addr is None or args.master_port is None:
            raise UserError(f"--nnodes > 1 needs {flag(args, 'master_addr')} and {port} (node 0's address and a "
                            f"port all nodes agree on)")
        if args.max_restarts:
            raise UserError(f"{flag(args, 'max_restarts')} works on a single node only (a restart would need every "
                            f"node to start again together)")
        read_secret(os.environ)  # a control secret set but weak or unreadable: refused before anything starts
        if not 0 < args.master_port < 65535:
            raise UserError(f"{port} must be within 1-65534 on several nodes (the nodes' control port is the next "
                            f"one, {port}+1), got {args.master_port}")
    elif args.master_port is not None and not 0 < args.master_port <= 65535:
        raise UserError(f"{port} must be within 1-65535, got {args.master_port}")


def entry_path(args: argparse.Namespace) -> str:
    if args.entry is None:
        path = PROJECT_ROOT / TRAINER_ENTRY
        if not path.is_file():
            raise UserError(f"{path} does not exist; name a rank program with --entry SCRIPT")
        return str(path)
    path = Path(args.entry)
    if not path.is_file():
        raise UserError(f"--entry {args.entry}: no such file")
    return str(path.resolve())


def check_rendezvous(args: argparse.Namespace) -> None:
    """Where the ranks meet, before anything starts: node 0's address resolves, and on node 0 the given port is
    free (elsewhere the ranks would retry a wrong address until the store's 30-minute timeout, or rank 0 would end
    in a traceback on a port taken)."""
    if args.master_addr is not None:  # a node that joins waits for the name, as long as it would wait to join
        rendezvous.check_host(args.master_addr, 0.0 if args.node_rank == 0 else args.join_timeout)
    if args.master_port is not None and args.node_rank == 0:
        rendezvous.check_port_free(args.master_port)


@dataclass
class Devices:
    """What `choose_devices` decided: the physical GPU ids for this node's ranks (empty: CPU ranks), NVML's
    preflight answers about them (the baseline a failure is compared with), whether they are the test seam's, and
    what `--dry-run` sizes them as."""

    gpus: list[int]
    preflight: dict[int, preflight.Health] = field(default_factory=dict)
    fake: bool = False
    sizes: DetectedGpus = field(default_factory=DetectedGpus)


def choose_devices(args: argparse.Namespace, cfg: Config, console_notes: list[str]) -> Devices:
    """The devices for this node's ranks; sets system.device for fake GPUs (CPU ranks with no GPU get it from the
    caller, once the trainer has checked what the config asked for)."""
    inventory = discovery.discover()
    forced_cpu = cfg.system.device == "cpu"
    if forced_cpu and args.gpus is not None:
        raise UserError(f"--gpus {args.gpus} conflicts with system.device=cpu")
    if not forced_cpu and args.gpus is not None and args.gpus.strip() == "auto" and not args.allow_busy_gpus:
        health = preflight.check([g.index for g in inventory.usable], inventory.fake)
        busy = [g for g in inventory.usable if g.index in health and health[g.index].busy]
        if busy:
            inventory = replace(inventory, usable=tuple(g for g in inventory.usable if g not in busy))
            console_notes += [f"--gpus auto skips GPU {g.index}: in use by {health[g.index].users()}" for g in busy]
    chosen = [] if forced_cpu else discovery.select(inventory, args.gpus, args.nproc)
    if chosen:
        health = preflight.check([g.index for g in chosen], inventory.fake)
        console_notes += preflight.refuse_busy(health, args.allow_busy_gpus)
        if inventory.fake:
            cfg.system.device = "cpu"
            fake_ids = discovery.id_ranges([g.index for g in inventory.gpus])
            console_notes.append(f"{discovery.FAKE_GPUS_ENV}: pretending GPUs {fake_ids} exist; the ranks compute on the "
                                 f"CPU")
        if args.gpus is not None and args.gpus.strip() == "auto":
            console_notes.append("--gpus auto chose " + "; ".join(g.describe() for g in chosen))
        return Devices([g.index for g in chosen], health, inventory.fake, discovery.detected(chosen))
    why = "system.device=cpu" if forced_cpu else "no GPU found"
    count = args.nproc or args.cpu_ranks
    console_notes.append(f"{why}: starting {count} CPU rank{'s' if count > 1 else ''} on gloo (--nproc N to change)")
    return Devices([])


def check_min_gpus(args: argparse.Namespace, gpu_ids: list[int]) -> int:
    """--min-gpus, checked against the GPUs the run got (default: half of them, rounded up)."""
    if args.min_gpus is None:
        return default_min_gpus(len(gpu_ids))
    if not gpu_ids:
        raise UserError(f"--min-gpus {args.min_gpus}: the run has no GPU (CPU ranks are never excluded)")
    if not 1 <= args.min_gpus <= len(gpu_ids):
        raise UserError(f"--min-gpus must be within 1-{len(gpu_ids)} (the run's GPUs), got {args.min_gpus}")
    return args.min_gpus


def create_run_dir(root: Path, preset: str) -> Path:
    """logs/<yyyymmdd-hhmmss>-<preset>, with -2, -3 ... when two runs start in the same second."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    try:
        root.mkdir(parents=True, exist_ok=True)
        for n in count(1):
            path = root / (f"{stamp}-{preset}" + ("" if n == 1 else f"-{n}"))
            try:
                path.mkdir()
                return path.resolve()
            except FileExistsError:
                continue
    except OSError as e:  # a disk that filled up since check_writable looked
        raise UserError(f"cannot create a run folder in {root} ({e.strerror or e}); free space there or choose "
                        f"another log folder with --log-dir DIR") from None
    raise AssertionError("unreachable")


def node_layout(args: argparse.Namespace, notes: list[str]) -> None:
    """--nnodes and friends: as given, else from a multi-node Slurm job, else a single node."""
    if note := slurm_layout.apply(args, os.environ):
        notes.append(note)
    args.nnodes = 1 if args.nnodes is None else args.nnodes
    if args.nnodes == 1 and args.node_rank is None:
        args.node_rank = 0  # several nodes without --node-rank: node 0 gives the others theirs as they join


def make_plan(args: argparse.Namespace, cfg: Config, entry_args: list[str], notes: list[str],
              launch: TorchrunLaunch | None = None) -> Plan:
    """The plan; `launch`: a program started with torchrun's command line, which takes no config of this project
    (the config resolved from the defaults only serves the supervisor: it is neither shown nor written)."""
    if launch is None:
        notes.extend(cfg.notes)
    entry = launch.program if launch is not None else entry_path(args)
    check_writable(Path(args.log_dir), "the log folder", "choose a writable one with --log-dir DIR")
    check_rendezvous(args)
    devices = choose_devices(args, cfg, notes)
    min_gpus = check_min_gpus(args, devices.gpus)
    assigned = args.node_rank is None
    ranks = node_ranks(devices.gpus, args.nproc or args.cpu_ranks, 0 if assigned else args.node_rank)
    if launch is None and Path(entry).name == TRAINER_ENTRY:  # what the ranks would refuse only after the token cache
        check_run(cfg, args.nnodes * len(ranks), len(ranks), bool(devices.gpus), notes)
    if not devices.gpus:
        cfg.system.device = "cpu"
    plan = Plan(entry=entry, entry_args=entry_args, run_dir=Path(), ranks=ranks, nnodes=args.nnodes,
                node_rank=0 if assigned else args.node_rank, node_rank_assigned=assigned,
                master_addr=args.master_addr or "127.0.0.1", master_port=args.master_port,
                grace_period=args.grace_period, hang_timeout=args.hang_timeout,
                startup_timeout=args.startup_timeout, max_restarts=args.max_restarts,
                node_timing=Timing(args.node_timeout, args.join_timeout), local_addr=args.local_addr,
                gpu_exclusion=args.gpu_exclusion, min_gpus=min_gpus, preflight=devices.preflight,
                fake_gpus=devices.fake, prepare=not args.no_prepare, footer=not args.no_footer,
                isolate_gpus=args.isolate_gpus)
    if launch is not None:
        plan = replace(plan, entry_mode=launch.mode, torchrun_contract=True, run_id=launch.run_id, role=launch.role,
                       virtual_local_rank=launch.virtual_local_rank, signals_to_handle=launch.signals_to_handle,
                       console_ranks=launch.console_ranks, python=launch.python)
    plan.run_dir = create_run_dir(Path(args.log_dir), plan.program_name if launch is not None else cfg.preset)
    cfg.logging.run_dir = str(plan.run_dir)
    return plan


def plan_dry_run(args: argparse.Namespace, cfg: Config) -> str:
    """`--dry-run`: the run `make_plan` would plan here, sized instead of started. Its devices are chosen as the run
    chooses them, so a --gpus or --nproc the run would refuse is the same error, and the estimate is for the GPUs
    chosen, else for the CPU ranks as they run (`trainer.preflight.dry_run`)."""
    devices = choose_devices(args, cfg, [])
    local = len(node_ranks(devices.gpus, args.nproc or args.cpu_ranks, 0))
    return dry_run(cfg, devices.sizes, args.nnodes * local, local)


def read_command_line(argv: list[str]) -> tuple[argparse.Namespace, list[str], TorchrunLaunch | None, list[str]]:
    """The supervisor's own command line (the program's arguments after ``--``), or torchrun's
    (`supervisor.launch.torchrun_args`). torchrun's naming the project's trainer is read as the trainer's own: its
    arguments are the config flags it takes (``--nproc-per-node 2 pretrain_main.py --debug``). Last, the lines
    saying what torchrun's flags that change nothing here do instead."""
    own = build_parser()
    if not torchrun_args.recognised(argv, own, torchrun_args.build_parser(add_torchrun_side_flags)):
        ours, entry_args = split_entry_args(argv)
        return own.parse_args(ours), entry_args, None, []
    launch = torchrun_args.parse(argv, add_torchrun_side_flags, own.parse_args([]))
    args = launch.args
    args.entry = launch.program
    if launch.mode != "script" or Path(launch.program).name != TRAINER_ENTRY:
        return args, launch.program_args, launch, launch.notes
    config = torchrun_args.OneLineParser(prog=TRAINER_ENTRY, allow_abbrev=False)
    add_config_arguments(config)
    for key, value in vars(config.parse_args(launch.program_args)).items():
        setattr(args, key, [*args.set, *value] if key == "set" else value)
    return args, [], None, launch.notes


def discard_refused(plan: Plan) -> None:
    """A run refused before any rank started leaves no folder: the error line said everything, and an empty run among
    the runs that trained only misleads."""
    if not any((plan.run_dir / spec.log_name).exists() for spec in plan.ranks):
        shutil.rmtree(plan.run_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    try:
        args, entry_args, launch, notes = read_command_line(sys.argv[1:] if argv is None else argv)
        node_layout(args, notes)
        check_flags(args)  # the supervisor's own flags first: a bad one is refused even beside --print-config
        replay = replay_from_flags(args)
        cfg = handle_inspection_flags(args) if replay is None else replay.config
        if cfg is None:
            return 0
        if args.dry_run:
            print(plan_dry_run(args, cfg), flush=True)
            return 0
        if replay is not None:
            args.nproc = replay.world_size
        plan = make_plan(args, cfg, entry_args, notes, launch)
        if replay is not None:
            replay.place(plan.run_dir)
        console = Console(footer=plan.footer)
        with run_folder_writes(plan.run_dir):
            console.open_log(plan.run_dir / "supervisor.log")
        try:
            for note in notes:
                console.say(note)
            devices = ", ".join(r.label for r in plan.ranks)
            console.say(f"run {plan.run_dir.name}: {len(plan.ranks)} rank{'s' if len(plan.ranks) > 1 else ''} "
                        f"({devices}) of {plan.world_size}; logs in {plan.run_dir}/")
            console.log(f"command: {' '.join(sys.argv)}")
            code = Launcher(plan, cfg, console).run()
        except UserError:
            discard_refused(plan)
            raise
        finally:
            console.close()
        if code == USER_ERROR_EXIT_CODE:  # the dataset build refused the data (it said why)
            discard_refused(plan)
        return code
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return USER_ERROR_EXIT_CODE


def console_script() -> None:
    """The ``supervise`` command the project installs (``[project.scripts]``), as ``python -m supervisor``."""
    exit_without_teardown(main())
