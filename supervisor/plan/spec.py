"""What to start: one `RankSpec` per rank of this node, and the `Plan` that says how (entry, environment, limits).

The rank environment is torchrun's, complete (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
GROUP_WORLD_SIZE, ROLE_*, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_*), so a program written for torchrun runs unchanged,
plus the project's own keys; see ARCHITECTURE.md, "Rank environment". A program launched with torchrun's command line
keeps PYTHONPATH as the user set it and gets OMP_NUM_THREADS by torchrun's rule; the project's rank programs get the
project's root first on PYTHONPATH (they import it), the machine's cores shared out, and torch.compile's caches in the
run folder (``compile-cache/``), so that a restart loads what the first group compiled.

What a rank sees of the GPUs: the project's trainer sees its own GPU alone (``CUDA_VISIBLE_DEVICES=<its id>``: it
uses ``cuda:0``, and nothing it does can touch another rank's card). A program written for torchrun selects
``cuda:LOCAL_RANK``, so by default it sees the run's GPUs in local-rank order (rank k's ``cuda:k`` is the k-th GPU of
the run, its own); ``--isolate-gpus`` gives it the trainer's view instead (it must then use ``cuda:0``), and
torchrun's ``--virtual-local-rank`` the same with ``LOCAL_RANK=0``. ``GPU_RANK`` is the physical id either way, so
labels, prefixes and log names stay ``GPU<id>``.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from supervisor.control.wire import SECRET_ENV, Timing
from supervisor.diagnosis.culprit import recorder_pipe
from supervisor.gpus.preflight import Health
from supervisor.plan.rendezvous import loopback_interface
from trainer.checkpoint.layout import MEMORY_DIR_ENV
from trainer.config import PROJECT_ROOT
from trainer.data import TOKEN_CACHE_ENV
from trainer.diagnosis.flight_recorder import PIPE_ENV
from trainer.progress import RESTART_COUNT_ENV
from trainer.torch_release import torch_release

TRAINER_ENTRY = "pretrain_main.py"
RUN_CONFIG_ENV = "SUPERVISOR_RUN_CONFIG"  # every rank: the resolved config of its attempt
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"  # where torch's @record writes an uncaught exception (a foreign program)
ERRORS_DIR = "errors"
SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"  # torchrun's --signals-to-handle default
# What torchrun does depends on the installed torch's release (`torch_release`): since 2.10 its workers get
# TORCHELASTIC_SIGNALS_TO_HANDLE; since 2.12 one node given no endpoint nor --master-port runs as --standalone.
SIGNALS_TO_HANDLE_SINCE, IMPLICIT_STANDALONE_SINCE = (2, 10), (2, 12)
FLIGHT_RECORDER_ENTRIES = 2000  # collectives kept per rank: a few steps' worth, enough to see who fell behind
COMPILE_CACHE_DIR = "compile-cache"  # in the run folder: torch.compile's caches, shared by the ranks and every restart
# the compiler caches the project's ranks keep there, each variable under its own folder, unless the user set it
COMPILE_CACHES = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}


@dataclass(frozen=True)
class RankSpec:
    rank: int  # global rank
    local_rank: int
    gpu: int | None  # the physical GPU id; None for a CPU rank

    @property
    def label(self) -> str:
        """The device label, as `trainer.progress.device_label` computes it inside the rank."""
        return f"GPU{self.gpu}" if self.gpu is not None else f"CPU{self.local_rank}"

    @property
    def log_name(self) -> str:
        return f"{self.label.lower()}.log"


@dataclass
class Plan:
    # a script or an executable, as typed on torchrun's command line (the program's sys.argv[0], as under torchrun) or
    # resolved (--entry); for entry_mode "module", the module's dotted name
    entry: str
    entry_args: list[str]
    run_dir: Path
    ranks: list[RankSpec]
    nnodes: int = 1
    node_rank: int = 0
    # started without --node-rank on several nodes: node 0 is the node that opens the control port at master_addr,
    # the others learn theirs from node 0 as they join (supervisor/control); node_rank is 0 until then
    node_rank_assigned: bool = False
    # several nodes: the ranks on each node, in node order, as node 0 gathered them once every node joined
    # (supervisor/control); empty until then. torchrun lets nodes differ in --nproc-per-node, and so does this
    node_sizes: tuple[int, ...] = ()
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free loopback port per group (single node)
    grace_period: float = 30.0
    hang_timeout: float = 300.0  # 0 disables the watchdog
    startup_timeout: float = 900.0
    node_timing: Timing = field(default_factory=Timing)  # multi-node: heartbeat and join timeouts
    local_addr: str | None = None  # multi-node: the address this node's control connection comes from
    max_restarts: int = 0
    gpu_exclusion: bool = True  # a restart after a GPU fault leaves that GPU out (supervisor.gpus.exclusion)
    min_gpus: int = 1  # fewer GPUs than this after an exclusion: the run stops instead
    preflight: dict[int, Health] = field(default_factory=dict)  # NVML before the start: a failure's baseline
    fake_gpus: bool = False  # SUPERVISOR_FAKE_GPUS: NVML's answers come from the test seam, or from nowhere
    prepare: bool = True  # build the token cache before starting ranks
    footer: bool = True  # the live footer, when the console is a terminal
    python: str = field(default_factory=lambda: sys.executable)
    entry_mode: str = "script"  # "script" (python SCRIPT), "module" (python -m NAME), "executable" (exec'd as is)
    # Launched with torchrun's command line: torchrun's contract (no run config, a restart after any failure, the run
    # folder named after the program); else the project's (SUPERVISOR_RUN_CONFIG, no restart after a user error).
    torchrun_contract: bool = False
    isolate_gpus: bool = False  # a foreign program sees only its own GPU (the trainer always does)
    virtual_local_rank: bool = False  # torchrun's --virtual-local-rank: isolated, and LOCAL_RANK=0
    run_id: str = "none"  # TORCHELASTIC_RUN_ID (torchrun's --rdzv-id)
    role: str = "default"  # ROLE_NAME (torchrun's --role)
    signals_to_handle: str = SIGNALS_TO_HANDLE  # TORCHELASTIC_SIGNALS_TO_HANDLE (torchrun's --signals-to-handle)
    # torchrun's --local-ranks-filter: the local ranks whose lines reach the console (None: every rank's); the log
    # files keep every rank's
    console_ranks: frozenset[int] | None = None
    # the trainer's ranks keep their memory copy of the latest state here (under /dev/shm; the supervisor's sentinel
    # removes it on every exit path): a restart on this node loads it first
    memory_dir: Path | None = None
    token_cache: Path | None = None  # the token cache the supervisor found for the run's config (trainer runs)

    @property
    def trainer_entry(self) -> bool:
        """The project's own rank program gets ``--run-config``; any other entry gets only its own arguments."""
        return self.entry_mode == "script" and Path(self.entry).name == TRAINER_ENTRY

    @property
    def program_name(self) -> str:
        """What the run folder of a foreign program is named after: the script's stem, or the module's name."""
        return self.entry if self.entry_mode == "module" else Path(self.entry).stem

    @property
    def isolated(self) -> bool:
        """Each rank sees only its own GPU."""
        return self.trainer_entry or self.isolate_gpus or self.virtual_local_rank

    @property
    def gpus(self) -> list[int]:
        """The physical GPU ids of this node's ranks, in rank order (empty for CPU ranks)."""
        return [spec.gpu for spec in self.ranks if spec.gpu is not None]

    @property
    def local_world_size(self) -> int:
        return len(self.ranks)

    @property
    def world_size(self) -> int:
        return sum(self.node_sizes) if self.node_sizes else self.nnodes * len(self.ranks)

    def as_node(self, node_rank: int) -> Plan:
        """This plan on the node rank node 0 gave: the ranks' global numbers move with it."""
        return replace(self, node_rank=node_rank, ranks=node_ranks(self.gpus, len(self.ranks), node_rank))

    def assembled(self, sizes: tuple[int, ...]) -> Plan:
        """This plan once every node joined, with `sizes` ranks on each: this node's ranks come after those of the
        nodes before it, and the world is all of them."""
        first = sum(sizes[:self.node_rank])
        return replace(self, node_sizes=sizes,
                       ranks=[replace(spec, rank=first + spec.local_rank) for spec in self.ranks])

    def argv(self, config_path: Path | None) -> list[str]:
        if self.entry_mode == "executable":
            return [self.entry, *self.entry_args]
        if self.entry_mode == "module":
            return [self.python, "-m", self.entry, *self.entry_args]
        args = ["--run-config", str(config_path)] if self.trainer_entry else []
        return [self.python, self.entry, *args, *self.entry_args]

    def error_file(self, spec: RankSpec, restart: int) -> Path | None:
        """Where a foreign rank's @record writes its uncaught exception in group `restart` (one file per group, as
        the restart's config file); the trainer reports its failures on the progress channel instead."""
        if self.trainer_entry:
            return None
        return self.run_dir / ERRORS_DIR / (f"{spec.label.lower()}.json" if restart == 0 else
                                            f"{spec.label.lower()}.restart{restart}.json")

    def rank_env(self, spec: RankSpec, master_port: int, config_path: Path | None, restart: int) -> dict[str, str]:
        """Everything but SUPERVISOR_PROGRESS_FD, which the worker adds with the pipe it creates."""
        env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}  # the supervisors' secret, not the ranks'
        if not self.torchrun_contract:  # the project's rank programs import it; a torchrun program's imports are its
            # own, as torchrun leaves them (a package of the user's named `trainer` is the one it imports)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH")]))
        env.update({
            "RANK": str(spec.rank),
            "LOCAL_RANK": "0" if self.virtual_local_rank else str(spec.local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "GROUP_RANK": str(self.node_rank),
            "GROUP_WORLD_SIZE": str(self.nnodes),
            "ROLE_RANK": str(spec.rank),  # one role: a rank's place among its role is its place in the world
            "ROLE_NAME": self.role,
            "ROLE_WORLD_SIZE": str(self.world_size),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(master_port),
            "TORCHELASTIC_RUN_ID": self.run_id,
            "TORCHELASTIC_RESTART_COUNT": str(restart),
            "TORCHELASTIC_MAX_RESTARTS": str(self.max_restarts),
            # torchrun's agent hosts the store its workers join; here rank 0 hosts it, as without an agent
            "TORCHELASTIC_USE_AGENT_STORE": "False",
            "PYTHONUNBUFFERED": "1",
            RESTART_COUNT_ENV: str(restart),
        })
        if torch_release() >= SIGNALS_TO_HANDLE_SINCE:  # as torchrun's agent leaves it to its workers
            env["TORCHELASTIC_SIGNALS_TO_HANDLE"] = self.signals_to_handle
        env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # torchrun's default: a failed collective raises
        env.pop(RUN_CONFIG_ENV, None)
        if config_path is not None:
            env[RUN_CONFIG_ENV] = str(config_path)
        env.pop(ERROR_FILE_ENV, None)
        env.pop(MEMORY_DIR_ENV, None)
        if self.memory_dir is not None:
            env[MEMORY_DIR_ENV] = str(self.memory_dir)
        env.pop(TOKEN_CACHE_ENV, None)
        if self.token_cache is not None:
            env[TOKEN_CACHE_ENV] = str(self.token_cache)
        if (error_file := self.error_file(spec, restart)) is not None:
            env[ERROR_FILE_ENV] = str(error_file)
        # The project's ranks get the cores shared out, so their thread pools do not oversubscribe the machine; a
        # torchrun program gets torchrun's rule: one thread each where several ranks share the node, none set for a
        # single rank. A value set by hand wins either way.
        if not self.torchrun_contract:
            env.setdefault("OMP_NUM_THREADS", str(max(1, available_cores() // max(1, self.local_world_size))))
            # compiled once per run: a restart's ranks (and every rank but the first to compile a graph) load
            # inductor's graphs and Triton's kernels from the run folder instead of compiling them again
            for variable, folder in COMPILE_CACHES.items():
                env.setdefault(variable, str(self.run_dir / COMPILE_CACHE_DIR / folder))
        elif self.local_world_size > 1:
            env.setdefault("OMP_NUM_THREADS", "1")
        if self.nnodes == 1:  # gloo's own sockets stay on the machine (see supervisor/plan/rendezvous.py)
            env.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
        # the flight recorder (PyTorch's record of collectives, gloo and NCCL alike; TORCH_NCCL_TRACE_BUFFER_SIZE is
        # its deprecated name) and the pipe the supervisor asks for its dump through
        env.setdefault("TORCH_FR_BUFFER_SIZE", str(FLIGHT_RECORDER_ENTRIES))
        env[PIPE_ENV] = str(recorder_pipe(self.run_dir, spec.label))
        if spec.gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(spec.gpu) if self.isolated else ",".join(map(str, self.gpus))
            env["GPU_RANK"] = str(spec.gpu)
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # NVML's numbering, so the id means the same card to CUDA
        else:
            env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU rank must not grab a GPU behind the plan's back
            env.pop("GPU_RANK", None)
        return env


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def node_ranks(gpus: list[int], cpu_ranks: int, node_rank: int) -> list[RankSpec]:
    """One spec per GPU (or per CPU rank when `gpus` is empty); global rank = node_rank × ranks per node + local."""
    count = len(gpus) if gpus else cpu_ranks
    return [RankSpec(node_rank * count + i, i, gpus[i] if gpus else None) for i in range(count)]
