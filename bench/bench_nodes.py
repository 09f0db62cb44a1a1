"""Multi-node benchmark: one launcher per node on loopback addresses (127.0.0.1-N; Linux routes all of 127/8 to lo),
the supervisor side by side with torchrun (``python -m torch.distributed.run``, its defaults) on the same programs and
the same command line.

    python bench/bench_nodes.py [--repeats 3] [--nodes 16] [--per-node 8] [--quick] [--canonical]

Two kinds of rank:

* torch ranks: tests/torchrun_programs/allreduce_loop.py, a program written for torchrun (RANK, WORLD_SIZE,
  MASTER_ADDR, MASTER_PORT from the launcher) that joins the gloo process group and all-reduces a tensor every 0.5 s.
  A torch rank holds about 150 MiB of its own, so the layout is the largest of --nodes x --per-node that fits in the
  memory available, with torchrun's agents (which import torch too) and a reserve left over; measured first.
* light ranks: tests/rank_scripts/worker.py (a line of progress every 0.5 s, asleep in between; no torch), for the
  launchers' own CPU and memory per rank at 8, 32 and --nodes x 8 ranks: what a rank does between its collectives
  does not change the launcher's work, and 128 torch ranks do not fit on a small machine.

Every node's launcher gets a static layout (``--node-rank i --master-addr 127.0.0.1 --local-addr 127.0.0.<i+1>``, the
supervisor with a control secret) or, with ``--canonical``, torchrun's canonical command, the same on every node with
nothing else set: ``--nnodes N --nproc-per-node K --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:P`` (no node rank,
no secret: the supervisors number themselves as they join and run their control channel unauthenticated).

Measured, per launcher:

1. a torch gloo rank's memory (PSS, RSS; and torchrun's agent's), and the layout that fits.
2. torch ranks, --repeats times: start-up (every launcher started → every rank's first all-reduce done); a rank of
   the last node killed (SIGKILL) → every process of every node gone (ranks and launchers), median and worst, with
   the launchers' exit codes.
3. a frozen node (torch ranks; its launcher and its ranks SIGSTOPped): the supervisor names it on every other node
   (--node-timeout 3 s here: the seconds until the last node said so); torchrun has nothing that notices, so what is
   measured is what its other nodes did in the same time and `FROZEN_WATCH` seconds more.
4. light ranks: the launchers' CPU (% of one core per rank, over `WINDOW` seconds of steady running), their resident
   memory per rank (each launcher process's RSS, summed, over the ranks), and the launchers' own traffic at node 0:
   the supervisor's control channel, torchrun's rendezvous store (`ss` reads the kernel's per-socket counters).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # this checkout first

from rank_scripts.harness import WORKER, alive, free_port_pair  # noqa: E402
from supervisor.control.wire import SECRET_ENV, SECRET_FILE_ENV, Timing  # noqa: E402

PY = sys.executable
PROGRAM = ROOT / "tests" / "torchrun_programs" / "allreduce_loop.py"
LAUNCHERS = ("supervisor", "torchrun")
STEP_TIME = "0.5"
NODE_TIMEOUT = 3.0
WINDOW = 30.0
FROZEN_WATCH = 20.0  # torchrun: seconds watched after the supervisor's time to name a frozen node
RESERVE = 4 * 2**30  # memory left free beside the torch ranks: the system, the launchers, other work
SECRET = "bench-nodes-secret-0123456789abcdef"
MiB = 2**20


def address(node: int) -> str:
    return f"127.0.0.{node + 1}"


@dataclass
class Cluster:
    """One run: a launcher per node, their ranks' pid files under `work/pids<node>`."""

    work: Path
    launcher: str
    nodes: list[subprocess.Popen]
    per_node: int
    port: int
    started: float
    canonical: bool

    @classmethod
    def start(cls, work: Path, launcher: str, count: int, per_node: int, torch_ranks: bool,
              canonical: bool = False) -> Cluster:
        port = free_port_pair()
        env = {k: v for k, v in os.environ.items() if k not in (SECRET_ENV, SECRET_FILE_ENV)}
        env.update(PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="", **({} if canonical else {SECRET_ENV: SECRET}))
        own = ["-m", "supervisor", "--no-footer", "--log-dir", str(work / "logs"), "--grace-period", "5",
               "--node-timeout", str(NODE_TIMEOUT)] if launcher == "supervisor" else ["-m", "torch.distributed.run"]
        started, nodes = time.monotonic(), []
        for k in range(count):
            pids = work / f"pids{k}"
            pids.mkdir(parents=True)
            program = [str(PROGRAM), "--ready", str(pids), "--step-time", STEP_TIME] if torch_ranks else \
                [str(WORKER), "--pid-dir", str(pids), "--step-time", STEP_TIME]
            layout = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{address(0)}:{port}"] if canonical else \
                ["--node-rank", str(k), "--master-addr", address(0), "--master-port", str(port), "--local-addr",
                 address(k)]
            cmd = [PY, *own, "--nnodes", str(count), "--nproc-per-node", str(per_node), *layout, *program]
            with open(work / f"err{k}.txt", "wb") as err:
                nodes.append(subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.DEVNULL, stderr=err,
                                              start_new_session=True))
        return cls(work, launcher, nodes, per_node, port, started, canonical)

    def launcher_of(self, node: int) -> int:
        """The index in `nodes` of the launcher that is node `node`: the same in a static layout; under the canonical
        command the supervisors number themselves as they join, and each says which node it is."""
        if not (self.canonical and self.launcher == "supervisor"):
            return node
        said = f"node {node} of {len(self.nodes)} ("
        return next(k for k in range(len(self.nodes)) if said in self.stderr(k))

    def address(self, node: int) -> str:
        """The address node `node`'s control connection comes from (the canonical command gives no --local-addr)."""
        return address(0) if self.canonical else address(node)

    def rank_pids(self, node: int | None = None) -> list[int]:
        folders = [self.work / f"pids{node}"] if node is not None else self.work.glob("pids*")
        return [int(f.read_text().split()[0]) for folder in folders for f in folder.glob("rank*.pids")]

    def wait_ranks(self, timeout: float = 900) -> float:
        """Seconds from the start until every rank wrote its pid file (a torch rank: after its first all-reduce)."""
        want = self.per_node * len(self.nodes)
        while len(self.rank_pids()) < want:
            if time.monotonic() - self.started > timeout or any(p.poll() is not None for p in self.nodes):
                raise RuntimeError(f"{self.launcher}: ranks did not start: {self.stderr(0)[-2000:]}")
            time.sleep(0.05)
        return time.monotonic() - self.started

    def stderr(self, node: int) -> str:
        return (self.work / f"err{node}.txt").read_text(errors="replace")

    def processes(self, node: int) -> list[psutil.Process]:
        """A node's launcher and everything below it."""
        with contextlib.suppress(psutil.Error):
            launcher = psutil.Process(self.nodes[node].pid)
            return [launcher, *launcher.children(recursive=True)]
        return []

    def end(self) -> None:
        for k, proc in enumerate(self.nodes):
            for member in self.processes(k):
                with contextlib.suppress(psutil.Error):
                    member.kill()  # (SIGKILL ends a stopped process too)
            proc.kill()
            proc.wait()


def coordination_bytes(cluster: Cluster) -> int:
    """Bytes sent plus received so far on node 0's end of the launchers' own connections: the supervisor's control
    channel (--master-port + 1), torchrun's rendezvous store (--master-port: its agents, and its ranks' store
    clients)."""
    port = cluster.port + 1 if cluster.launcher == "supervisor" else cluster.port
    out = subprocess.run(["ss", "-tinH", "state", "established", f"( sport = :{port} )"], capture_output=True,
                         text=True, check=False).stdout
    return sum(int(n) for n in re.findall(r"bytes_(?:acked|received):(\d+)", out))


def steady(cluster: Cluster) -> tuple[float, float, float]:
    """Over `WINDOW` seconds: the launchers' CPU as % of one core per rank, their RSS per rank (MiB) and their
    traffic at node 0 (bytes/s)."""
    procs = [psutil.Process(p.pid) for p in cluster.nodes]
    ranks = cluster.per_node * len(procs)
    cpu0, bytes0 = [sum(p.cpu_times()[:2]) for p in procs], coordination_bytes(cluster)
    time.sleep(WINDOW)
    cpu = sum(sum(p.cpu_times()[:2]) - c for p, c in zip(procs, cpu0))
    rate = (coordination_bytes(cluster) - bytes0) / WINDOW
    rss = sum(p.memory_info().rss for p in procs) / MiB
    return 100 * cpu / WINDOW / ranks, rss / ranks, rate


def gone_after(cluster: Cluster, since: float, watched: list[psutil.Process],
               timeout: float = 120) -> tuple[float, list[int | None]]:
    """Seconds from `since` until every watched process is gone and every launcher exited, and their exit codes."""
    deadline = time.monotonic() + timeout
    while (any(alive(p.pid) for p in watched) or any(p.poll() is None for p in cluster.nodes)) \
            and time.monotonic() < deadline:
        time.sleep(0.005)
    return time.monotonic() - since, [p.poll() for p in cluster.nodes]


def kill_one(cluster: Cluster) -> tuple[float, list[int | None]]:
    """SIGKILL a rank of the last node started: seconds until every process of every node is gone."""
    watched = [p for k in range(len(cluster.nodes)) for p in cluster.processes(k)]
    victim = cluster.rank_pids(len(cluster.nodes) - 1)[0]
    killed = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    return gone_after(cluster, killed, watched)


def freeze_one(cluster: Cluster, node: int, watch: float) -> str:
    """SIGSTOP a node's launcher and ranks. The supervisor: seconds until the last other node named it. torchrun:
    what the other nodes did over `watch` seconds."""
    frozen = cluster.launcher_of(node)
    frozen_at = time.monotonic()
    for proc in cluster.processes(frozen):
        proc.suspend()
    others = [k for k in range(len(cluster.nodes)) if k != frozen]
    if cluster.launcher == "supervisor":
        named = f"node {node} ({cluster.address(node)}) stopped answering"
        while not all(named in cluster.stderr(k) for k in others):
            if time.monotonic() - frozen_at > 120:
                raise RuntimeError(f"not named: {cluster.stderr(others[0])[-2000:]}")
            time.sleep(0.01)
        return f"{time.monotonic() - frozen_at:.2f} s"
    before = {k: len(cluster.stderr(k)) for k in others}
    rank_cpu = {pid: sum(psutil.Process(pid).cpu_times()[:2]) for k in others for pid in cluster.rank_pids(k)}
    time.sleep(watch)
    said = [k for k in others if node_named(cluster.stderr(k)[before[k]:], node, cluster.address(node))]
    running = [pid for pid in rank_cpu if alive(pid)]
    launchers = sum(cluster.nodes[k].poll() is None for k in others)
    return (f"after {watch:.0f} s: {len(said)} of {len(others)} other launchers named node {node}; {launchers} still "
            f"running, {len(running)} of their {len(rank_cpu)} ranks still waiting in their all-reduce")


def node_named(text: str, node: int, addr: str) -> bool:
    pattern = rf"\b{re.escape(addr)}\b|\bnode[ _]?(rank)?[ =:]*{node}\b"
    return re.search(pattern, text, re.IGNORECASE) is not None


def probe_memory(work: Path) -> tuple[float, float, float]:
    """torchrun with 2 torch ranks on one node: a rank's PSS and RSS and the agent's PSS (MiB), once every rank has
    done its first all-reduce."""
    cluster = Cluster.start(work, "torchrun", 1, 2, torch_ranks=True)
    try:
        cluster.wait_ranks()
        ranks = [psutil.Process(pid) for pid in cluster.rank_pids()]
        pss = statistics.median(p.memory_full_info().pss for p in ranks) / MiB
        rss = statistics.median(p.memory_info().rss for p in ranks) / MiB
        agent = psutil.Process(cluster.nodes[0].pid).memory_full_info().pss / MiB
        return pss, rss, agent
    finally:
        cluster.end()


def layout_that_fits(nodes: int, per_node: int, rank_mib: float, agent_mib: float) -> tuple[int, int, str]:
    """The largest layout of torch ranks (per node first, then nodes) that fits the memory available now."""
    budget = (psutil.virtual_memory().available - RESERVE) / MiB
    for count in range(nodes, 0, -1):
        for k in range(per_node, 0, -1):
            need = count * (k * rank_mib + agent_mib)
            if need <= budget:
                full = nodes * (per_node * rank_mib + agent_mib) / 1024
                why = "fits" if (count, k) == (nodes, per_node) else (
                    f"does not fit: it needs {full:.1f} GiB, and {budget / 1024:.1f} GiB is available beside a "
                    f"{RESERVE / 2**30:.0f} GiB reserve")
                return count, k, f"{nodes} x {per_node} torch ranks {why}"
    raise RuntimeError(f"not even one torch rank fits in {budget:.0f} MiB")


def median_worst(values: list[float]) -> str:
    return f"median {statistics.median(values):.3f} s, worst {max(values):.3f} s"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--per-node", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="2 nodes of 2 torch ranks, light ranks at 8 and 32, "
                                                             "one repeat: a few minutes")
    parser.add_argument("--canonical", action="store_true",
                        help="torchrun's canonical command on every node (c10d endpoint, no node rank, no secret)")
    args = parser.parse_args()
    nodes, per_node, repeats = (2, 2, 1) if args.quick else (args.nodes, args.per_node, args.repeats)
    light = (1, 4) if args.quick else tuple(sorted({1, min(4, args.nodes), args.nodes}))
    canonical = args.canonical
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        rank_pss, rank_rss, agent_pss = probe_memory(work / "probe")
        count, k, fits = layout_that_fits(nodes, per_node, rank_pss, agent_pss)
        print(f"1. a torch gloo rank: PSS {rank_pss:.0f} MiB, RSS {rank_rss:.0f} MiB; torchrun's agent: PSS "
              f"{agent_pss:.0f} MiB. {fits}: {count} nodes x {k} torch ranks = {count * k}", flush=True)
        kills: dict[str, list[tuple[float, list[int | None]]]] = {launcher: [] for launcher in LAUNCHERS}
        starts: dict[str, list[float]] = {launcher: [] for launcher in LAUNCHERS}
        command = "torchrun's canonical command (c10d endpoint, no node rank, no secret)" if canonical else \
            "a static layout"
        print(f"2. {count * k} torch ranks on {count} nodes, {command}: start-up to the first all-reduce; a rank of "
              f"the last node started killed -> every process of every node gone", flush=True)
        for i in range(repeats):
            for launcher in LAUNCHERS:
                cluster = Cluster.start(work / f"kill-{launcher}-{i}", launcher, count, k, torch_ranks=True,
                                        canonical=canonical)
                try:
                    starts[launcher].append(cluster.wait_ranks())
                    time.sleep(1.0 + NODE_TIMEOUT)  # joined and beating
                    kills[launcher].append(kill_one(cluster))
                finally:
                    cluster.end()
                print(f"   {launcher} run {i + 1}: start-up {starts[launcher][-1]:.2f} s, all gone "
                      f"{kills[launcher][-1][0]:.3f} s after the kill, exit codes "
                      f"{sorted(set(kills[launcher][-1][1]), key=str)}", flush=True)
        frozen_node = count // 2
        print(f"3. node {frozen_node} of {count} frozen (SIGSTOP: its launcher and its {k} torch ranks)", flush=True)
        frozen: dict[str, str] = {}
        for launcher in LAUNCHERS:
            cluster = Cluster.start(work / f"freeze-{launcher}", launcher, count, k, torch_ranks=True,
                                    canonical=canonical)
            try:
                cluster.wait_ranks()
                time.sleep(1.0 + NODE_TIMEOUT)
                frozen[launcher] = freeze_one(cluster, frozen_node, NODE_TIMEOUT + FROZEN_WATCH)
            finally:
                cluster.end()
            print(f"   {launcher}: {frozen[launcher]}", flush=True)
        print(f"4. light ranks: the launchers over {WINDOW:g} s of steady running", flush=True)
        scaling: dict[tuple[str, int], tuple[float, float, float, float]] = {}
        for nodes_light in light:
            for launcher in LAUNCHERS:
                cluster = Cluster.start(work / f"light-{launcher}-{nodes_light}", launcher, nodes_light, 8,
                                        torch_ranks=False, canonical=canonical)
                try:
                    up = cluster.wait_ranks()
                    time.sleep(NODE_TIMEOUT)
                    scaling[launcher, nodes_light * 8] = (up, *steady(cluster))
                finally:
                    cluster.end()
                up, cpu, rss, rate = scaling[launcher, nodes_light * 8]
                print(f"   {launcher}, {nodes_light * 8} ranks on {nodes_light} node(s): up in {up:.2f} s; CPU "
                      f"{cpu:.4f} % of a core per rank ({cpu * 36:.2f} s per hour), RSS {rss:.2f} MiB per rank, "
                      f"{rate:.0f} B/s at node 0", flush=True)
    report(count, k, starts, kills, frozen, scaling, frozen_node)


def report(count: int, k: int, starts: dict[str, list[float]], kills: dict[str, list[tuple[float, list[int | None]]]],
           frozen: dict[str, str], scaling: dict[tuple[str, int], tuple[float, float, float, float]],
           frozen_node: int) -> None:
    print()
    rows = [("", *LAUNCHERS, "supervisor / torchrun")]
    start_ratio = statistics.median(starts["supervisor"]) / statistics.median(starts["torchrun"])
    rows.append((f"start-up to the first all-reduce, {count * k} torch ranks on {count} nodes",
                 *(median_worst(starts[launcher]) for launcher in LAUNCHERS), f"{start_ratio:.2f}x"))
    gone = {launcher: [t for t, _ in kills[launcher]] for launcher in LAUNCHERS}
    rows.append(("a rank of the last node started killed -> every process of every node gone",
                 *(median_worst(gone[launcher]) for launcher in LAUNCHERS),
                 f"{statistics.median(gone['supervisor']) / statistics.median(gone['torchrun']):.2f}x"))
    rows.append(("the launchers' exit codes", *(", ".join(map(str, sorted({c for _, cs in kills[launcher]
                                                                           for c in cs}, key=str)))
                                                for launcher in LAUNCHERS), ""))
    beat = Timing(NODE_TIMEOUT).beat
    what = f"node {frozen_node} frozen -> named on every other node (node timeout {NODE_TIMEOUT:g} s, heartbeats every "
    rows.append((what + f"{beat:g} s)", frozen["supervisor"], frozen["torchrun"], ""))
    sizes = sorted({ranks for _, ranks in scaling})
    for index, name, unit in ((1, "launcher CPU per rank (light ranks)", "CPU s per hour"),
                              (2, "launcher RSS per rank (light ranks)", "MiB"),
                              (3, "launchers' own traffic at node 0 (light ranks)", "B/s")):
        scale, digits = (36, 2) if index == 1 else (1, 1 if index == 2 else 0)  # % of a core → CPU s per hour
        for ranks in sizes:
            rows.append((f"{name}, {ranks} ranks", *(f"{scaling[launcher, ranks][index] * scale:.{digits}f} {unit}"
                                                     for launcher in LAUNCHERS), ""))
        if index < 3:
            rows.append((f"{name}: growth {sizes[0]} -> {sizes[-1]} ranks",
                         *(f"{scaling[launcher, sizes[-1]][index] / scaling[launcher, sizes[0]][index]:.2f}x"
                           for launcher in LAUNCHERS), ""))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in [rows[0], tuple("-" * w for w in widths), *rows[1:]]:
        print("| " + " | ".join(cell.ljust(width) for cell, width in zip(row, widths)) + " |")


if __name__ == "__main__":
    main()
