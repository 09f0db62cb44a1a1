"""A real Slurm on loopback for the `slurm` tier: munged, slurmctld and one slurmd per node, all in a temporary folder.

Debian's ``slurm-wlm`` (22.05) and ``munge`` (``apt-get install -y slurm-wlm munge``, as root). Every daemon runs in
the foreground as a child of the test session, with its own key, socket, ports, state and logs under the folder, so
nothing of the machine's own Slurm (if any) is touched. Three nodes come from three ``slurmd -N <name>`` on this host
(Debian builds Slurm with multiple-slurmd support); each has this machine's CPUs, and their names are not resolvable
hosts, so a two-node job is told ``--master-addr 127.0.0.1``; the third is where a job goes when it leaves a node out.
Job credentials last 10 s (``cred_expire``) instead of 120: Slurm holds a requeued job that long before it may start
again.

Fake GPUs on one node: a job with ``FAKE_GPU_NODE=<node>`` and ``FAKE_GPU_STATE=<file>`` in its environment gets
``SUPERVISOR_FAKE_GPUS=0`` and that fake NVML state (and no ``CUDA_VISIBLE_DEVICES``) in its tasks on that node only
(Slurm's TaskProlog, which runs before every task and may change its environment); its other nodes have CPU ranks.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "scancel", "sinfo")
INSTALL = "apt-get install -y slurm-wlm munge"
NODES = ("n1", "n2", "n3")
STARTUP_TIMEOUT = 60.0
# What TaskProlog runs: its "export NAME=value" lines join the task's environment
TASK_PROLOG = """\
import os

if os.environ.get("FAKE_GPU_NODE") == os.environ.get("SLURMD_NODENAME"):
    print("unset CUDA_VISIBLE_DEVICES")  # the tests' empty one hides every GPU, the fake ones too
    print("export SUPERVISOR_FAKE_GPUS=0")
    print("export SUPERVISOR_FAKE_GPU_STATE=" + os.environ["FAKE_GPU_STATE"])
"""


def missing() -> str | None:
    """Why this machine cannot run the tier, or None."""
    if os.geteuid() != 0:
        return "the Slurm tier runs its own munged, slurmctld and slurmd, which needs root"
    absent = [name for name in DAEMONS + CLIENTS if shutil.which(name) is None]
    if absent:
        return f"{', '.join(absent)} not installed (Debian: {INSTALL})"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slurm_conf(folder: Path, host: str, ports: dict[str, int]) -> str:
    cpus = os.cpu_count() or 1
    nodes = "\n".join(f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={ports[name]} CPUs={cpus} "
                      f"RealMemory=1000 State=UNKNOWN" for name in NODES)
    return f"""\
ClusterName=pretraintest
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ports['slurmctld']}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={folder}/munge.socket,cred_expire=10
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool/%n
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd-%n.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
TaskProlog={folder}/task_prolog
MailProg=/bin/true
ReturnToService=2
KillWait=10
MinJobAge=600
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class Job:
    id: str
    output: Path

    def text(self) -> str:
        return self.output.read_text(errors="replace") if self.output.exists() else ""


@dataclass
class Cluster:
    folder: Path
    env: dict[str, str] = field(default_factory=dict)  # SLURM_CONF for the clients
    daemons: list[subprocess.Popen] = field(default_factory=list)

    # -- bring-up and tear-down ---------------------------------------------------------------------------------

    def start(self) -> None:
        for sub in ("state", *(f"spool/{n}" for n in NODES)):
            (self.folder / sub).mkdir(parents=True)
        self.folder.chmod(0o755)  # munged wants its socket's folder reachable by everyone
        key = self.folder / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        prolog = self.folder / "task_prolog"
        prolog.write_text(f"#!{sys.executable}\n{TASK_PROLOG}")
        prolog.chmod(0o755)
        ports = {name: free_port() for name in ("slurmctld", *NODES)}
        conf = self.folder / "slurm.conf"
        conf.write_text(slurm_conf(self.folder, socket.gethostname(), ports))
        self.env = {**os.environ, "SLURM_CONF": str(conf)}
        self.daemon("munged", "-F", "-f", f"--key-file={key}", f"--socket={self.folder}/munge.socket",
                    f"--pid-file={self.folder}/munged.pid", f"--log-file={self.folder}/munged.log",
                    f"--seed-file={self.folder}/munged.seed")
        self.wait_for(lambda: (self.folder / "munge.socket").exists(), "munged's socket")
        self.daemon("slurmctld", "-D", "-i")
        self.wait_for(lambda: self.run("sinfo", check=False).returncode == 0, "slurmctld")
        for name in NODES:
            self.daemon("slurmd", "-D", "-N", name)
        self.wait_for(lambda: self.idle_nodes() == len(NODES), "every slurmd idle")

    def daemon(self, *argv: str) -> None:
        with open(self.folder / f"{argv[0]}-{len(self.daemons)}.out", "wb") as log:
            self.daemons.append(subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                                 stdin=subprocess.DEVNULL, start_new_session=True))

    def wait_for(self, ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while not ready():
            dead = [p.args[0] for p in self.daemons if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"waiting for {what}: {', '.join(dead) or 'nothing'} exited; "
                                   f"{self.logs_tail()}")
            time.sleep(0.2)

    def logs_tail(self) -> str:
        return " | ".join(f"{p.name}: {p.read_text(errors='replace')[-600:]}"
                          for p in sorted(self.folder.glob("*.out")) + sorted(self.folder.glob("*.log")))

    def idle_nodes(self) -> int:
        states = self.run("sinfo", "-h", "-N", "-o", "%t", check=False).stdout.split()
        return sum(state == "idle" for state in states)

    def stop(self) -> None:
        self.run("scancel", "--full", "--user=root", check=False)
        for proc in reversed(self.daemons):  # slurmd, slurmctld, then munged: each by its own pid
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

    # -- the clients --------------------------------------------------------------------------------------------

    def run(self, *argv: str, check: bool = True, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        out = subprocess.run(argv, env={**self.env, **(env or {})}, capture_output=True, text=True, timeout=60)
        if check and out.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {out.returncode}: {out.stderr}")
        return out

    def sbatch(self, script: Path, options: list[str], flags: list[str], output: Path, cwd: Path,
               env: dict[str, str]) -> Job:
        out = self.run("sbatch", "--parsable", f"--output={output}", f"--chdir={cwd}", *options, str(script),
                       *flags, env=env)
        return Job(out.stdout.strip().split(";")[0], output)

    def job(self, job: Job) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, ExitCode, Restarts, ...)."""
        text = self.run("scontrol", "show", "job", "-o", job.id).stdout
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait(self, job: Job, states: tuple[str, ...], timeout: float, restarts: int | None = None) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job)
            if info.get("JobState") in states and (restarts is None or int(info.get("Restarts", 0)) >= restarts):
                return info
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job.id} is {info.get('JobState')} (Restarts={info.get('Restarts')}), "
                                     f"not {'/'.join(states)}, after {timeout:g} s:\n{job.text()[-4000:]}")
            time.sleep(0.5)
