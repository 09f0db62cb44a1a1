"""One run, start to finish: prepare the data once, start the group, watch it, restart it when allowed, report.

Order matters in `run`: the sentinel (`Reaper`) is forked first, while the supervisor has no other thread; then
the supervisor makes itself a child subreaper; then, on several nodes, the control channel opens (a node started
without --node-rank waits there for the one node 0 gives it; the nodes join, and are heard from, while each prepares
its data; a node whose preparation fails stops the others, and a node lost,
failed or stalled elsewhere stops this one's build at once, with that node named and its code); then the dataset
is prepared (a stop signal there, a Ctrl-C or ``kill -TERM``, is an exception, `Interrupted`: no rank exists yet, the
build child gets SIGINT and cleans up, the other nodes are told, and a second signal is ignored while it unwinds);
only then do signals become loop events.

Once the data is ready, a node waits for every node to have joined (`assemble`: no node trains a world without the
others, and the global ranks follow each node's rank count); then node 0 claims `checkpoint.dir` for the run
(`trainer.checkpoint.claim`): a run given the folder another run holds is refused there, before any rank starts.

The dataset step looks for the token cache in this process (a hit costs a stat per source file); a build runs as a
child process (`prepare_dataset.py`), so that a build the kernel's out-of-memory killer ends is reported here, with
the host's memory and the build's largest resident set, instead of the whole supervisor vanishing with `Killed`.

Restarts (``--max-restarts N``): after a failure or a hang, and once every process of the group is gone, the group
starts again with a config that says ``checkpoint.resume=auto`` (``config.restart<n>.json`` beside
``config.json``), so the ranks continue from the run's latest checkpoint; until the run has saved one, the group
starts again as it first did (an earlier run's checkpoints in the folder are not this run's to resume). A user error
(exit 2) and an interrupt are never restarted. Per-rank logs continue in the same files, after a marker line. The
trainer's ranks also keep the latest state in this node's shared memory (a folder the sentinel removes on every exit
path), which a restart loads first: the restart's line says from which step. Their ranks, every group's, are forked
by the node's standby (`supervisor.group.standby`), started before the dataset step so that its one import overlaps
it, and waited for (interruptibly) before the first group.
A program launched with torchrun's command line is restarted as torchrun restarts it: after any failure or hang,
exit 2 included (2 means a user error only to programs of this project), with ``TORCHELASTIC_RESTART_COUNT`` telling
it which attempt it is; where it keeps its checkpoints is its own business, and the messages do not speak of them.

After a failure on GPUs, `supervisor.diagnosis.gpu_fault` says whether a GPU or the program was at fault (console,
supervisor.log, the report); a restart after a GPU fault leaves that GPU out (`supervisor.gpus.exclusion`), or stops when
too few GPUs would be left. A run that ends on a GPU fault records the node in ``<run>/gpu_fault.json``, for a job
script that leaves the node out of its next allocation.

Length: one run's steps in their order (the data, each group, each restart's decisions: resume point, layout,
exclusion; the report), which share the run's plan, config and sentinel; each step's rules live in the rooms below.
"""

from __future__ import annotations

import copy
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from supervisor.console import Console
from supervisor.control.wire import HANG_CODE, LOST_CODE, read_secret
from supervisor.diagnosis import gpu_fault
from supervisor.diagnosis.culprit import make_pipe, recorder_pipe
from supervisor.gpus import exclusion, preflight
from supervisor.gpus.exclusion import Exclusion
from supervisor.group.pump import Pump, Stream
from supervisor.group.reaper import TOKEN_ENV, Reaper
from supervisor.group.signals import Interrupted, SignalInbox, interruptible, on_stop_signal
from supervisor.group.standby import Standby
from supervisor.group.watch import GroupResult, Watch
from supervisor.group.worker import Worker, become_subreaper, die_with_parent
from supervisor.plan.rendezvous import PortReservation, check_port_free
from supervisor.plan.spec import Plan, node_ranks
from supervisor.report.summary import failure_report, success_report
from trainer.checkpoint.claim import FolderClaim
from trainer.checkpoint.layout import META_FILE, check_resume, list_checkpoints, memory_step
from trainer.config import PROJECT_ROOT, Config, check_world_size
from trainer.errors import USER_ERROR_EXIT_CODE, UserError

if TYPE_CHECKING:
    from supervisor.control.channel import ControlChannel

BUILD_SAMPLE = 0.5  # seconds between two samples of the dataset build's memory
BUILD_STOP_WAIT = 30.0  # an interrupted build's clean-up (the batch being encoded) before it is killed


@contextmanager
def run_folder_writes(run_dir: Path) -> Iterator[None]:
    """What the supervisor must write into the run folder before ranks start (the config, the log files): a full
    disk or a folder gone is one line, and no rank is started."""
    try:
        yield
    except OSError as e:
        raise UserError(f"cannot write into the run folder {run_dir} ({e.strerror or e}); free space there or choose "
                        f"another log folder with --log-dir DIR") from None


class Launcher:
    def __init__(self, plan: Plan, cfg: Config, console: Console) -> None:
        self.plan, self.cfg, self.console = plan, cfg, console
        self.exclusions: list[Exclusion] = []
        self.verdict: gpu_fault.Verdict | None = None  # the last failure's diagnosis (GPU runs only)
        self.standby: Standby | None = None  # forks every group's ranks in a run with restarts
        self.claim: FolderClaim | None = None  # checkpoint.dir, this run's alone while it runs
        self.footer: Any = None  # supervisor.report.footer.Footer, in terminal mode only (rich loads only then)
        if console.terminal:
            from supervisor.report.footer import Footer

            self.footer = Footer(f"run {plan.run_dir.name}")

    def run(self) -> int:
        reaper = Reaper()
        signals: SignalInbox | None = None
        control: ControlChannel | None = None
        failed: int | None = None
        started = time.monotonic()
        try:
            become_subreaper()
            # the ranks' memory copy of the latest state, which the sentinel removes; read by a restart only, so a
            # run with none to come takes no snapshots (on a GPU, a 1B model's first ones take seconds each)
            if self.plan.trainer_entry and self.plan.max_restarts > 0:
                memory = reaper.shared_folder(f"gpu-pretrain-{self.plan.run_dir.name}")
                self.plan = replace(self.plan, memory_dir=memory)
            if self.plan.nnodes > 1:  # before the dataset: the nodes join (and are heard from) while each builds
                from supervisor.control.endpoint import open_channel

                control = open_channel(self.plan, read_secret(os.environ), self.console.say)
            with interruptible():
                phase = "while joining node 0"
                try:
                    if control is not None and self.plan.node_rank_assigned:
                        failed = self.join(control)
                    phase = "during dataset preparation"
                    if failed is None:
                        self.start_standby(reaper)  # its imports overlap the dataset's lookup (or build)
                        failed = self.prepare(control)
                    if failed is None and self.standby is not None:
                        self.standby.wait_ready()
                    if failed is None and control is not None:
                        phase = "while waiting for the other nodes"
                        failed = self.assemble(control)
                    if failed is None:
                        self.claim_checkpoints()
                except Interrupted as e:
                    failed = 128 + e.signum
                    self.console.say(f"{e}: interrupted {phase}; no rank was started")
                except UserError:
                    failed = USER_ERROR_EXIT_CODE
                    raise
                finally:
                    # the other nodes stop too, told why (a node still waiting for its node rank has not joined them)
                    if failed is not None and control is not None and control.node_rank is not None:
                        control.abort(self.plan.node_rank, "supervisor", failed)
            if failed is not None:
                return failed
            signals = SignalInbox()
            restarts, before = 0, self.checkpoints()
            config = self.write_config(restarts, self.cfg.checkpoint.resume)
            while True:
                pending = signals.peek_stop()
                if pending is not None:  # arrived between two groups
                    self.console.say(f"{signal.Signals(pending).name}: not restarting; no rank is running")
                    return 128 + pending
                result = self.run_group(config, restarts, signals, reaper, control)
                self.verdict = self.diagnose(result)
                if result.exit_code == 0 or not self.restartable(result) or restarts >= self.plan.max_restarts:
                    break
                assert result.stop is not None
                layout = ""
                if self.verdict is not None and self.verdict.gpu_fault:
                    if not self.plan.gpu_exclusion:
                        layout = "; GPU exclusion is off (--no-gpu-exclusion): on the same GPUs"
                    elif (stop_line := self.exclude(self.verdict, restarts + 1, result)) is not None:
                        self.console.say(stop_line, style="bold red")
                        break
                    else:
                        layout = f"; on {exclusion.gpus_phrase(self.plan.gpus)}"
                restarts += 1
                # another --entry keeps its checkpoints where the supervisor cannot see them: it is told to resume
                saved = self.checkpoints() != before or not self.plan.trainer_entry
                config = self.write_config(restarts, "auto" if saved else self.cfg.checkpoint.resume)
                if not self.plan.torchrun_contract:
                    resumes = self.resumes(saved)
                else:
                    resumes = f"the ranks start again with TORCHELASTIC_RESTART_COUNT={restarts}"
                warm = "; forked from the standby" if self.standby is not None and self.standby.usable() else ""
                self.console.say(f"restart {restarts} of {self.plan.max_restarts} after {result.stop.detail}; "
                                 f"{resumes}{layout}{warm}", style="bold yellow")
            self.console.stop_footer()
            if result.exit_code != 0 and self.verdict is not None and self.verdict.gpu_fault:
                self.record(exclusion.NodeFault.here(self.verdict.faulty), "the GPU fault", "leave this node out")
            if result.stop is not None and result.stop.lost_node is not None:
                self.record(exclusion.LostNode.here(result.stop.lost_node, result.stop.detail), "the lost node",
                            "end with its exit code")
            self.report(result, restarts, time.monotonic() - started)
            if control is not None and result.exit_code == 0:
                control.done()
            return result.exit_code
        finally:
            self.console.stop_footer()
            if self.claim is not None:
                self.claim.release()
            if self.standby is not None:
                self.standby.close()
            if control is not None:
                self.close_control(control)
            if signals is not None:
                signals.close()
            reaper.close()

    # -- steps -----------------------------------------------------------------------------------------------------

    def join(self, control: ControlChannel) -> int | None:
        """A node started without --node-rank: node 0 (the node that opened the control port at --master-addr) says
        so; any other waits for node 0's welcome, which gives it its node rank, and the plan's global ranks follow.
        Returns the exit code when it cannot join (node 0 refused it, or did not answer within --join-timeout): no
        rank was started. Node 0 refuses a --master-port that another program holds (a UserError, which stops the
        other nodes too), as a node given --node-rank 0 does before anything starts."""
        if (failed := self.wait_for(control, lambda: control.node_rank is not None)) is not None:
            return failed
        assert control.node_rank is not None
        self.plan = self.plan.as_node(control.node_rank)
        if control.node_rank == 0 and self.plan.master_port is not None:  # its rank 0 hosts the store there
            check_port_free(self.plan.master_port)
        first, last = self.plan.ranks[0].rank, self.plan.ranks[-1].rank
        given = (f"this node opened the control port at {self.plan.master_addr}" if control.node_rank == 0 else
                 f"given by node 0 at {self.plan.master_addr} as the nodes joined")
        self.console.say(f"node {control.node_rank} of {self.plan.nnodes} ({given}): ranks {first}-{last} of "
                         f"{self.plan.world_size}")
        return None

    def assemble(self, control: ControlChannel) -> int | None:
        """No rank starts before every node has joined (torchrun's rendezvous holds its workers alike): a node that
        started its ranks alone would train a world without the others, or a late node would make itself node 0 of
        a run of its own. Node 0 then tells each node every node's rank count, from which the global ranks follow
        (nodes may differ in --nproc-per-node). Returns the exit code when the run stops first (a node never joined
        within --join-timeout, or one failed or was lost)."""
        if control.assembled is None:
            self.console.say(f"waiting for all {self.plan.nnodes} nodes to join before starting the ranks (at most "
                             f"--join-timeout, {self.plan.node_timing.join_timeout:g} s)")
        if (failed := self.wait_for(control, lambda: control.assembled is not None)) is not None:
            return failed
        assert control.assembled is not None
        self.plan = self.plan.assembled(control.assembled)
        if len(set(control.assembled)) > 1:
            counts = ", ".join(f"node {n}: {k}" for n, k in enumerate(control.assembled))
            self.console.say(f"the nodes' rank counts differ ({counts}): this node's ranks are "
                             f"{self.plan.ranks[0].rank}-{self.plan.ranks[-1].rank} of {self.plan.world_size}")
        if self.plan.trainer_entry:
            check_world_size(self.cfg, self.plan.world_size)
        return None

    def close_control(self, control: ControlChannel) -> None:
        """End the control channel. A stop not yet delivered to a node this one has not reached waits for that node
        up to the grace period (so it stops at once rather than at its own timeout); the console says so, and a
        second stop signal (Ctrl-C) leaves at once."""
        grace = self.plan.grace_period
        if control.lingering() and grace > 0:
            who = "the nodes that have not joined" if control.node_rank == 0 else "node 0, not reached so far,"
            self.console.say(f"telling {who} that this run stopped: up to the grace period ({grace:g} s); Ctrl-C "
                             f"again to leave now")
        with on_stop_signal(control.hurry):
            control.close(wait=grace)

    def wait_for(self, control: ControlChannel, ready: Callable[[], bool]) -> int | None:
        """Wait until `ready()` (it changes when the control channel wakes us); the exit code when, first, the run
        stops: node 0 refused this node, a node was lost or never joined, or another node failed. No rank was
        started."""
        while not ready():
            select.select([control.fd], [], [])
            events, _ = control.read_events()
            if events:
                event = events[0]
                if event.lost:
                    self.record(exclusion.LostNode.here(event.node, event.why), "the lost node",
                                "end with its exit code")
                code = event.code or LOST_CODE
                self.console.say(f"{event.why}; no rank was started; exit code {code}", style="bold red")
                return code
        return None

    def prepare(self, control: ControlChannel | None) -> int | None:
        """Find (or build) the token cache once, before any rank starts, so ranks never race to build it; then, with
        its key known, refuse a --resume checkpoint that does not fit this run (trainer.checkpoint.layout.check_resume).
        Returns the exit code of a build that failed or was stopped (it has said why), None when the data is
        ready. `control`: another node's stop (a lost node, a failure, a stall) stops the build at once."""
        if not (self.plan.prepare and self.plan.trainer_entry):
            return None
        from trainer.data.cache import find

        info = find(self.cfg)
        built = info is None
        if info is None:
            failed = self.build_dataset(control)
            if failed is not None:
                return failed
            info = find(self.cfg)
            if info is None:
                raise UserError("prepare_dataset.py finished but its token cache does not open; run it by hand with "
                                "the same flags to see why")
        state = f"built in {info.build_seconds:.1f} s, peak RSS {info.peak_rss_bytes / 1e9:.2f} GB" if built else "ready"
        self.console.say(f"dataset {state}: {info.tokens:,} training tokens in {info.path}")
        check_resume(self.cfg, info.key, info.vocab_size)  # other data or another model: refused before any rank
        self.plan = replace(self.plan, token_cache=info.path)  # the ranks open it without keying the corpus again
        return None

    def build_dataset(self, control: ControlChannel | None) -> int | None:
        """`prepare_dataset.py` on this run's resolved config, as a child that dies with the supervisor; its progress
        goes straight to the console. Its resident memory is sampled while it runs, for the report of a build the
        out-of-memory killer ends (the only sender of SIGKILL a user does not know of). On several nodes the control
        channel is heard between samples: another node's stop ends the build at once (`stop_build`)."""
        import psutil

        config = self.write_config(0, self.cfg.checkpoint.resume)
        started = time.monotonic()
        proc = subprocess.Popen([sys.executable, str(PROJECT_ROOT / "prepare_dataset.py"), "--config", str(config)],
                                cwd=PROJECT_ROOT, stdout=subprocess.DEVNULL, preexec_fn=die_with_parent(os.getpid()))
        largest = 0
        try:
            while proc.poll() is None:
                try:
                    largest = max(largest, psutil.Process(proc.pid).memory_info().rss)
                except psutil.Error:
                    pass  # exited between poll and sample
                heard, _, _ = select.select([control.fd] if control is not None else [], [], [], BUILD_SAMPLE)
                if heard and control is not None and (stopped := self.stop_build(control, proc, started)) is not None:
                    return stopped
        except Interrupted:  # the build stops as at a Ctrl-C (a terminal's reached it too: it ignores a second one)
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(BUILD_STOP_WAIT)
            except subprocess.TimeoutExpired:  # what it half-built is removed by the next build
                proc.kill()
                proc.wait()
            raise
        code = 128 - proc.returncode if proc.returncode < 0 else proc.returncode  # a shell's way: 128 + signal
        if code == 0:
            return None
        if code == 128 + signal.SIGKILL:
            memory = psutil.virtual_memory()
            reached = f"its resident memory reached {largest / 2**30:.1f} GiB at least; " if largest >= 2**27 else ""
            self.console.say(
                f"the dataset build (prepare_dataset.py, pid {proc.pid}) was killed by SIGKILL after "
                f"{time.monotonic() - started:.0f} s, most likely by the kernel's out-of-memory killer: {reached}"
                f"this host has {memory.total / 2**30:.1f} GiB, "
                f"{memory.available / 2**30:.1f} GiB available now (`dmesg` says who was killed). Nothing it "
                f"half-built is used (the next run removes it); free memory or build on a larger host with "
                f"prepare_dataset.py, then start again", style="bold red")
        elif code > 128:
            self.console.say(f"the dataset build (prepare_dataset.py) was killed by "
                             f"{signal.Signals(code - 128).name}; no rank was started", style="bold red")
        return code

    def stop_build(self, control: ControlChannel, proc: subprocess.Popen, started: float) -> int | None:
        """Another node's stop, heard while this node builds its dataset: the build is killed (what it half-built is
        removed by the next build) and the run ends with that stop's code, no rank started. A stall elsewhere gets
        this node's verdict first: the other nodes' ranks wait for this node's, which have not started."""
        events, _ = control.read_events()
        if not events:
            return None  # other nodes' stall verdicts: no rank of this node runs to be explained
        event = events[0]
        code, why = event.code, event.why
        elapsed = time.monotonic() - started
        if code == HANG_CODE:
            control.verdict(self.plan.node_rank, True, f"no rank of this node has started: it is still preparing its "
                                                       f"dataset (prepare_dataset.py, for {elapsed:.0f} s so far)")
        proc.kill()
        proc.wait()
        code = code or LOST_CODE  # a stop from elsewhere never ends the run with 0
        if event.lost:
            self.record(exclusion.LostNode.here(event.node, why), "the lost node", "end with its exit code")
        self.console.say(f"{why}; stopped this node's dataset preparation (prepare_dataset.py, pid {proc.pid}, after "
                         f"{elapsed:.1f} s): no rank was started; exit code {code}", style="bold red")
        return code

    def resumes(self, saved: bool) -> str:
        """Where the trainer's restarted ranks take the run up: the node's memory copy of the latest state, if one is
        there, else (or where that copy fails their checks) this run's latest checkpoint, or step 0 before one."""
        memory = memory_step(self.plan.memory_dir, self.plan.world_size) if self.plan.memory_dir is not None else None
        if memory is None:
            return ("the ranks resume from this run's latest checkpoint" if saved else
                    "no checkpoint of this run yet: the ranks start again as the first time")
        disk = "this run's latest checkpoint" if saved else "step 0 (no checkpoint of this run yet)"
        return (f"the ranks resume from step {memory} in this node's memory (from {disk} if that copy fails their "
                f"checks)")

    def restartable(self, result: GroupResult) -> bool:
        """The project's rule (`GroupResult.restartable`: not after a user error), or torchrun's for a program
        launched with its command line: after any failure or hang."""
        if not self.plan.torchrun_contract:
            return result.restartable
        return result.stop is not None and result.stop.reason in ("failure", "hang")

    def diagnose(self, result: GroupResult) -> gpu_fault.Verdict | None:
        """After a failure or a stall on GPUs: a GPU's fault or the program's, and on what evidence (said at once)."""
        stop = result.stop
        if stop is None or stop.reason not in ("failure", "hang") or not self.plan.gpus:
            return None
        failing = stop.worker.spec if stop.worker is not None else None
        tail = result.tails.get(failing.rank) if failing is not None else None
        now = preflight.check(self.plan.gpus, self.plan.fake_gpus)
        verdict = gpu_fault.diagnose(stop.exit_code, failing.gpu if failing is not None else None,
                                     tail.tail.decode(errors="replace") if tail is not None else "",
                                     self.plan.preflight, now)
        self.console.say(verdict.line(), style="bold red" if verdict.gpu_fault else "bold")
        return verdict

    def exclude(self, verdict: gpu_fault.Verdict, restart: int, result: GroupResult) -> str | None:
        """Leave the faulty GPUs out of the next group: a new plan and, for the same global batch, a new
        accumulation. Returns the line that stops the run instead when fewer than --min-gpus would be left."""
        plan = self.plan
        left = [gpu for gpu in plan.gpus if gpu not in verdict.faulty]
        named = ", ".join(map(str, verdict.faulty))
        if len(left) < plan.min_gpus:
            return (f"not restarting: without GPU {named} the run would have {len(left)} GPU"
                    f"{'s' * (len(left) != 1)}, fewer than the minimum of {plan.min_gpus} (--min-gpus)")
        old_world = plan.world_size
        self.plan = replace(plan, ranks=node_ranks(left, 0, plan.node_rank))
        self.cfg, change = exclusion.restart_config(self.cfg, self.plan.world_size, old_world)
        failed = result.stop.worker.spec.rank if result.stop is not None and result.stop.worker else None
        stamp, accum = exclusion.now(), self.cfg.training.grad_accum_nums
        global_batch = self.cfg.training.batch_size * accum * self.plan.world_size
        for gpu, evidence in verdict.faulty.items():
            self.exclusions.append(Exclusion(gpu, stamp, restart, failed, evidence, left, accum, global_batch))
            self.console.say(self.exclusions[-1].line(), style="bold yellow")
        exclusion.record(plan.run_dir, self.exclusions)
        ranks = f"{self.plan.world_size} rank{'s' * (self.plan.world_size != 1)}"
        self.console.say(change.note or f"the global batch stays {global_batch} sequences: accumulation {accum} on "
                                        f"{ranks}", style="bold yellow")
        return None

    def record(self, record: exclusion.NodeFault | exclusion.LostNode, what: str, then: str) -> None:
        """gpu_fault.json or node_lost.json, for the job script; a folder that cannot take it any more is said, not
        a new failure."""
        try:
            record.write(self.plan.run_dir)
        except OSError as e:
            self.console.say(f"cannot record {what} in {self.plan.run_dir} ({e.strerror or e}): a job script will not "
                             f"{then}")

    def checkpoints(self) -> dict[Path, int]:
        """The published checkpoints in checkpoint.dir, each with its meta.json's modification time: what changed
        since the run started is this run's."""
        return {p: (p / META_FILE).stat().st_mtime_ns for p in list_checkpoints(Path(self.cfg.checkpoint.dir))}

    def write_config(self, restart: int, resume: str | None) -> Path | None:
        """The resolved config a group's ranks read: `config.json`, or a restart's `config.restart<n>.json` with the
        checkpoint it is to resume; None for a program that takes no config (torchrun's command line)."""
        if self.plan.torchrun_contract:
            return None
        cfg = copy.deepcopy(self.cfg)
        cfg.checkpoint.resume = resume
        path = self.config_path(restart)
        with run_folder_writes(self.plan.run_dir):
            cfg.save(path)
        return path

    def config_path(self, restart: int) -> Path:
        return self.plan.run_dir / ("config.json" if restart == 0 else f"config.restart{restart}.json")

    def claim_checkpoints(self) -> None:
        """checkpoint.dir, claimed for this run once its data is ready (`trainer.checkpoint.claim`): node 0 claims it
        for every rank and group; a run given a folder another run holds is refused before any rank starts. A program
        launched with torchrun's command line claims its own (pretrain_main.py's rank 0 does) or keeps none."""
        if self.plan.trainer_entry and not self.plan.torchrun_contract and self.plan.node_rank == 0:
            self.claim = FolderClaim.take(Path(self.cfg.checkpoint.dir), self.plan.run_dir)

    def start_standby(self, reaper: Reaper) -> None:
        """In a run of the project's trainer with restarts to come, the standby that forks every group's ranks
        (`supervisor.group.standby`); where the machine cannot give it (no process or descriptor left), the ranks are
        spawned. A run without restarts spawns its ranks: the import is paid once either way."""
        plan = self.plan
        if not (plan.trainer_entry and not plan.torchrun_contract and plan.max_restarts > 0):
            return
        try:
            self.standby = Standby(plan, reaper, self.console)
        except OSError as e:
            self.console.log(f"no standby ({e.strerror or e}): the ranks are spawned")

    def run_group(self, config_path: Path | None, restart: int, signals: SignalInbox, reaper: Reaper,
                  control: ControlChannel | None) -> GroupResult:
        plan = self.plan
        port = PortReservation.take() if plan.master_port is None else None
        master_port = port.port if port is not None else plan.master_port
        assert master_port is not None
        log_fds: dict[int, int] = {}
        workers: list[Worker] = []
        try:
            with run_folder_writes(plan.run_dir):
                for spec in plan.ranks:
                    log_fds[spec.rank] = os.open(plan.run_dir / spec.log_name,
                                                 os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
                    if restart:
                        os.write(log_fds[spec.rank], f"----- restart {restart} of {plan.max_restarts} -----\n".encode())
                    make_pipe(recorder_pipe(plan.run_dir, spec.label))
                    if (error_file := plan.error_file(spec, restart)) is not None:
                        error_file.parent.mkdir(exist_ok=True)
            argv = plan.argv(config_path)
            ranks = [(spec, {**plan.rank_env(spec, master_port, config_path, restart), TOKEN_ENV: reaper.token}, argv)
                     for spec in plan.ranks]
            for worker in (self.standby.fork(ranks) if self.standby is not None else None) or []:
                reaper.watch(worker.pid)
                workers.append(worker)
            for spec, env, _ in ranks[len(workers):]:  # none forked: each spawned
                try:
                    worker = Worker.spawn(spec, argv, env, stdin=spec.rank == 0)
                except OSError as e:
                    program = " ".join(argv[:len(argv) - len(plan.entry_args)])
                    raise UserError(f"cannot start {program}: {e.strerror or e}") from None
                reaper.watch(worker.pid)
                workers.append(worker)
            pump = Pump(self.console)
            tails: dict[int, Stream] = {}
            typed = sys.stdin is not None and sys.stdin.isatty()  # rank 0's prompts wait for what is typed
            for w in workers:
                prefix = f"{w.label}:".encode()
                shown = plan.console_ranks is None or w.spec.local_rank in plan.console_ranks
                pump.add(w.stdout_fd, prefix, 1 if shown else None, log_fds[w.spec.rank], keep_tail=False,
                         prompts=typed and w.spec.rank == 0)
                tails[w.spec.rank] = pump.add(w.stderr_fd, prefix, 2 if shown else None, log_fds[w.spec.rank],
                                              keep_tail=True)
            pump.start()
            self.console.log(f"group {restart}: " + ", ".join(
                f"{w.label} pid {w.pid}{' (forked by the standby)' if w.forked else ''}" for w in workers))
            watch = Watch(plan, workers, pump, tails, self.console, signals, reaper, control,
                          restart_follows=restart < plan.max_restarts)
            if self.footer is not None:
                from supervisor.report.footer import group_rows  # rich, in terminal mode only
                self.footer.rows = lambda: group_rows(watch)
                if restart:
                    excluded = "".join(f" · {e.short()}" for e in self.exclusions)
                    self.footer.title = f"run {plan.run_dir.name} · restart {restart}/{plan.max_restarts}{excluded}"
                self.console.start_footer(lambda: self.footer)
            return watch.run()
        except BaseException:
            for w in workers:  # spawning failed part-way: take down what did start
                if w.alive:
                    w.kill_group()
                    w.reap()
                    reaper.forget(w.pid)
            raise
        finally:
            for fd in log_fds.values():
                os.close(fd)
            if port is not None:
                port.release()

    def report(self, result: GroupResult, restarts: int, total: float) -> None:
        if result.exit_code == 0:
            self.console.say(success_report(result, self.plan.run_dir, restarts, self.plan.max_restarts, total,
                                            self.exclusions), style="bold green")
        else:
            if result.stop is not None and result.stop.reason == "signal" and (saved := self.checkpoints()):
                result.stop.detail += f": {max(saved, key=lambda p: saved[p])}"  # the one --resume auto takes
            failing = result.stop.worker if result.stop is not None else None
            errors = self.plan.error_file(failing.spec, restarts) if failing is not None else None
            self.console.say(failure_report(result, self.plan.run_dir, restarts, self.plan.max_restarts, total,
                                            self.verdict, self.exclusions, errors), style="bold red")

