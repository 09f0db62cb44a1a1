"""Multi-node benchmark: N node supervisors on loopback addresses (127.0.0.1-N; Linux routes all of 127/8 to lo), 8
light ranks each, measured side by side with one node of the same ranks in the same run.

    python bench/bench_nodes.py [--repeats 3] [--nodes 16]

The ranks are tests/rank_scripts/worker.py with a step every 0.5 s (a progress record per step, asleep in between):
on 2 cores, 128 ranks that each import torch to wait in a gloo all-reduce would spend minutes importing it and
more memory than the machine has, and what is measured here is the supervisors' own work, which a rank that waits in
a collective does not change.

1. start-up: from starting every node's supervisor to every rank's pid file, at 1, 4 and --nodes nodes.
2. a rank killed (SIGKILL) on node 9 → every rank of every node gone and every supervisor exited, median and worst
   over the repeats, with the exit codes; the anchor: the same on one node of 8 ranks.
3. a frozen node (its supervisor and ranks SIGSTOPped) → named on every other node: the seconds from the SIGSTOP
   until the last node names it. The node timeout (3 s here) counts from the last line heard from the node, up to
   one heartbeat interval (0.75 s here) before the SIGSTOP; so the goal is within [timeout - interval, timeout + 1 s].
4. the supervisors' CPU (% of one core, summed, per rank) and resident memory (median per supervisor) over 10 s of
   steady running at 8, 32 and --nodes × 8 ranks; and the control channel's bytes/s at node 0 (every byte of it
   crosses node 0: `ss` reads the kernel's per-socket counters).
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
from supervisor.control.wire import Timing  # noqa: E402

PY = sys.executable
PER_NODE = 8
NODE_TIMEOUT = 3.0
WINDOW = 10.0
KILL_NODES = 10  # node 9's rank is killed
SECRET = "bench-nodes-secret-0123456789abcdef"




@dataclass
class Cluster:
    """N node supervisors of one run, their files under `work`."""

    work: Path
    nodes: list[subprocess.Popen]
    port: int
    started: float

    @classmethod
    def start(cls, work: Path, count: int) -> "Cluster":
        port = free_port_pair()
        env = {**os.environ, "PYTHONPATH": str(ROOT), "SUPERVISOR_CONTROL_SECRET": SECRET, "CUDA_VISIBLE_DEVICES": ""}
        started, nodes = time.monotonic(), []
        for k in range(count):
            (work / f"pids{k}").mkdir(parents=True)
            multi = ("--nnodes", str(count), "--node-rank", str(k), "--master-addr", "127.0.0.1", "--master-port",
                     str(port), "--local-addr", f"127.0.0.{k + 1}", "--node-timeout", str(NODE_TIMEOUT)) \
                if count > 1 else ()
            cmd = [PY, "-m", "supervisor", "--nproc", str(PER_NODE), "--no-footer", "--log-dir", str(work / "logs"),
                   "--grace-period", "5", *multi, "--entry", str(WORKER), "--", "--pid-dir", str(work / f"pids{k}"),
                   "--step-time", "0.5"]
            with open(work / f"err{k}.txt", "wb") as err:
                nodes.append(subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.DEVNULL, stderr=err))
        return cls(work, nodes, port, started)

    def rank_pids(self, node: int | None = None) -> list[int]:
        folders = [self.work / f"pids{node}"] if node is not None else self.work.glob("pids*")
        return [int(p) for folder in folders for f in folder.glob("rank*.pids") for p in f.read_text().split()[:1]]

    def wait_ranks(self, timeout: float = 600) -> float:
        """Seconds from the start until every rank wrote its pid file."""
        want = PER_NODE * len(self.nodes)
        while len(self.rank_pids()) < want:
            if time.monotonic() - self.started > timeout or any(p.poll() is not None for p in self.nodes):
                raise RuntimeError(f"ranks did not start: {self.stderr(0)[-2000:]}")
            time.sleep(0.05)
        return time.monotonic() - self.started

    def stderr(self, node: int) -> str:
        return (self.work / f"err{node}.txt").read_text(errors="replace")

    def end(self) -> None:
        for proc in self.nodes:
            if proc.poll() is None:
                with contextlib.suppress(psutil.Error):
                    children = psutil.Process(proc.pid).children(recursive=True)
                    proc.kill()
                    for child in children:
                        with contextlib.suppress(psutil.Error):
                            child.kill()  # (SIGKILL ends a stopped process too)
            proc.kill()
            proc.wait()


def control_bytes(port: int) -> int:
    """Bytes sent plus received so far on node 0's end of every control connection."""
    out = subprocess.run(["ss", "-tinH", "state", "established", f"( sport = :{port} )"], capture_output=True,
                         text=True).stdout
    return sum(int(n) for n in re.findall(r"bytes_(?:acked|received):(\d+)", out))


def steady(cluster: Cluster) -> tuple[float, float, float]:
    """Over WINDOW seconds: the supervisors' CPU as % of one core per rank, their median RSS (MiB) and the control
    channel's bytes/s at node 0."""
    procs = [psutil.Process(p.pid) for p in cluster.nodes]
    cpu0, bytes0 = [sum(p.cpu_times()[:2]) for p in procs], control_bytes(cluster.port + 1)
    time.sleep(WINDOW)
    cpu = sum(sum(p.cpu_times()[:2]) - c for p, c in zip(procs, cpu0))
    rate = (control_bytes(cluster.port + 1) - bytes0) / WINDOW
    rss = statistics.median(p.memory_info().rss for p in procs) / 2**20
    return 100 * cpu / WINDOW / (PER_NODE * len(procs)), rss, rate


def gone_after(cluster: Cluster, since: float, timeout: float = 120) -> tuple[float, list[int | None]]:
    """Seconds from `since` until every rank and every supervisor is gone, and the supervisors' exit codes."""
    pids = cluster.rank_pids()
    deadline = time.monotonic() + timeout
    while (any(alive(p) for p in pids) or any(p.poll() is None for p in cluster.nodes)) and time.monotonic() < deadline:
        time.sleep(0.005)
    return time.monotonic() - since, [p.poll() for p in cluster.nodes]


def kill_one(work: Path, count: int, node: int) -> tuple[float, list[int | None]]:
    cluster = Cluster.start(work, count)
    try:
        cluster.wait_ranks()
        time.sleep(1.0 + NODE_TIMEOUT)  # joined and beating
        victim = cluster.rank_pids(node)[0]
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        return gone_after(cluster, killed)
    finally:
        cluster.end()


def freeze_one(work: Path, count: int, node: int) -> float:
    """Seconds from the SIGSTOP until the last other node named the frozen one."""
    cluster = Cluster.start(work, count)
    try:
        cluster.wait_ranks()
        time.sleep(1.0 + NODE_TIMEOUT)
        frozen = time.monotonic()
        for pid in [cluster.nodes[node].pid, *cluster.rank_pids(node)]:
            os.kill(pid, signal.SIGSTOP)
        named = f"node {node} (127.0.0.{node + 1}) stopped answering"
        others = [k for k in range(count) if k != node]
        while not all(named in cluster.stderr(k) for k in others):
            if time.monotonic() - frozen > 60:
                raise RuntimeError(f"not named: {cluster.stderr(others[0])[-2000:]}")
            time.sleep(0.01)
        return time.monotonic() - frozen
    finally:
        cluster.end()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nodes", type=int, default=16)
    args = parser.parse_args()
    kill_nodes = KILL_NODES
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        print("1+4. start-up and steady running", flush=True)
        for count in (1, 4, args.nodes):
            cluster = Cluster.start(work / f"steady{count}", count)
            try:
                start = cluster.wait_ranks()
                time.sleep(NODE_TIMEOUT)
                cpu, rss, rate = steady(cluster)
            finally:
                cluster.end()
            print(f"   {count} node(s) x {PER_NODE} ranks: every rank up {start:.2f} s after the start; supervisors "
                  f"{cpu:.3f} % of a core per rank, median RSS {rss:.1f} MiB; control channel {rate:.0f} B/s at "
                  f"node 0", flush=True)
            rows.append((f"{count * PER_NODE} ranks on {count} node(s)", f"{start:.2f} s", f"{cpu:.3f} %",
                         f"{rss:.1f} MiB", f"{rate:.0f} B/s" if count > 1 else "-"))
        print(f"2. a rank of node 9 killed -> every rank of {kill_nodes} nodes gone", flush=True)
        single = [kill_one(work / f"kill1-{i}", 1, 0) for i in range(args.repeats)]
        multi = [kill_one(work / f"kill{kill_nodes}-{i}", kill_nodes, 9) for i in range(args.repeats)]
        for name, runs in (("1 node (anchor)", single), (f"{kill_nodes} nodes", multi)):
            times = [t for t, _ in runs]
            codes = sorted({c for _, cs in runs for c in cs}, key=str)
            print(f"   {name}: median {statistics.median(times):.3f} s, worst {max(times):.3f} s, exit codes "
                  f"{codes}", flush=True)
        ratio = statistics.median(t for t, _ in multi) / statistics.median(t for t, _ in single)
        print(f"   {kill_nodes} nodes / 1 node: {ratio:.2f}x", flush=True)
        print(f"3. a frozen node (SIGSTOP) -> named on every other node of {kill_nodes}", flush=True)
        late = [freeze_one(work / f"freeze-{i}", kill_nodes, 5) for i in range(args.repeats)]
        print(f"   named by the last node {statistics.median(late):.2f} s (median; worst {max(late):.2f} s) after the "
              f"SIGSTOP; node timeout {NODE_TIMEOUT:g} s, heartbeats every {Timing(NODE_TIMEOUT).beat:g} s", flush=True)
    print()
    header = ("ranks", "start-up", "supervisor CPU/rank", "supervisor RSS", "control channel")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, tuple("-" * w for w in widths), *rows]:
        print(" | ".join(str(c).ljust(w) for c, w in zip(row, widths)))


if __name__ == "__main__":
    main()
