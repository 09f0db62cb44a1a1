"""A small rank program for the supervisor's tests: steps with progress records, children, faults, stop behaviour.

It behaves like a training rank where the supervisor can see it (progress channel, SIGUSR1 stack dumps, SIGTERM)
without the cost of torch, unless --gloo asks for a real process group with one all-reduce per step.

Every rank writes ``<pid-dir>/rank<RANK>.pids``: its own pid, then its children's, so a test can check afterwards
that every one of them is gone; it starts stepping only once every rank of its node has written its file.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from trainer.diagnosis import fake_gpu_state
from trainer.progress import RENDEZVOUS_PHASE, ProgressReporter, restart_count


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=0, help="0: run until stopped")
    p.add_argument("--step-time", type=float, default=0.02)
    p.add_argument("--startup-time", type=float, default=0.0, help="silence before the first step")
    p.add_argument("--chatter", type=int, default=0, help="bytes of stdout per step, on every rank but --fail-rank")
    p.add_argument("--fail", choices=["raise", "exit", "announce", "sigkill", "segv", "hang", "gpu_lost"],
                   help="announce: says failing, takes --term-time s to leave (a trainer letting its write end), "
                        "exits --code; gpu_lost: the rank's GPU reads as lost in the fake NVML state, and it dies with "
                        "CUDA's error")
    p.add_argument("--fail-rank", type=int, default=1)
    p.add_argument("--fail-once", action="store_true", help="--fail in the run's first group only, not a restart's")
    p.add_argument("--fail-step", type=int, default=3)
    p.add_argument("--code", type=int, default=3, help="exit code for --fail exit")
    p.add_argument("--fail-unless-resumed", type=int, metavar="CODE",
                   help="exit CODE at --fail-step unless the run config says checkpoint.resume=auto")
    p.add_argument("--children", type=int, default=0, help="children in the rank's process group")
    p.add_argument("--escaped-child", action="store_true", help="one more child in a session of its own")
    p.add_argument("--pid-dir")
    p.add_argument("--on-term", choices=["die", "slow", "ignore"], default="die")
    p.add_argument("--term-time", type=float, default=0.5, help="--on-term slow: seconds to 'checkpoint'")
    p.add_argument("--gloo", action="store_true")
    p.add_argument("--dump-env", metavar="DIR", help="write <DIR>/rank<RANK>.json: environment, argv, port probes")
    return p.parse_args()


def port_probes(port: int) -> dict[str, bool]:
    """Can an unrelated program take the rendezvous port? Can rank 0's store (SO_REUSEADDR + listen)?"""
    import socket

    results = {}
    for name, reuse in (("plain_bind", False), ("reuse_listen", True)):
        sock = socket.socket()
        try:
            if reuse:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", port))
            sock.listen()
            results[name] = True
        except OSError:
            results[name] = False
        finally:
            sock.close()
    return results


def dump_env(folder: str, rank: int) -> None:
    fd = int(os.environ["SUPERVISOR_PROGRESS_FD"])
    record = {"env": dict(os.environ), "argv": sys.argv, "progress_fd_open": os.fstat(fd) is not None,
              "ports": port_probes(int(os.environ["MASTER_PORT"])) if rank == 0 else {}}
    (Path(folder) / f"rank{rank}.json").write_text(json.dumps(record))


def main() -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    args = parse()
    rank = int(os.environ.get("RANK", "0"))
    stopping = []  # before the pid file: a test may signal as soon as it sees that file
    if args.on_term == "slow":
        signal.signal(signal.SIGTERM, lambda *_: stopping.append(time.time()))
    elif args.on_term == "ignore":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    reporter = ProgressReporter()
    reporter.phase("startup")
    if args.dump_env:
        dump_env(args.dump_env, rank)
    children = [subprocess.Popen(["sleep", "300"]) for _ in range(args.children)]
    if args.escaped_child:
        children.append(subprocess.Popen(["sleep", "300"], start_new_session=True))
    if args.pid_dir:
        path = Path(args.pid_dir) / f"rank{rank}.pids"
        path.with_suffix(".tmp").write_text(" ".join(str(p) for p in [os.getpid(), *(c.pid for c in children)]))
        path.with_suffix(".tmp").replace(path)
        deadline = time.monotonic() + 20  # start stepping once every rank of this node is up, children and all
        while len(list(path.parent.glob("rank*.pids"))) < int(os.environ.get("LOCAL_WORLD_SIZE", "1")):
            if time.monotonic() > deadline:
                sys.exit("the other ranks did not start")
            time.sleep(0.01)
    resumed = False
    if os.environ.get("SUPERVISOR_RUN_CONFIG"):
        config = json.loads(Path(os.environ["SUPERVISOR_RUN_CONFIG"]).read_text())
        resumed = config["checkpoint"]["resume"] == "auto"
    all_reduce = None
    if args.gloo:
        import torch
        import torch.distributed as dist

        reporter.phase(RENDEZVOUS_PHASE)  # as the trainer says while it joins the process group
        dist.init_process_group("gloo")
        tensor = torch.ones(1)
        all_reduce = lambda: dist.all_reduce(tensor)  # noqa: E731
    print(f"rank {rank} started (pid {os.getpid()}, resumed={resumed})", flush=True)
    time.sleep(args.startup_time)
    step = 0
    while args.steps == 0 or step < args.steps:
        step += 1
        if stopping:
            print(f"rank {rank} got SIGTERM at step {step}; checkpointing", flush=True)
            reporter.phase("checkpoint")  # as the trainer says while it saves
            time.sleep(args.term_time)
            print(f"rank {rank} checkpoint written", flush=True)
            sys.exit(0)
        if args.fail_unless_resumed is not None and step == args.fail_step and not resumed:
            print(f"rank {rank}: not resumed, failing", file=sys.stderr, flush=True)
            sys.exit(args.fail_unless_resumed)
        if args.fail and rank == args.fail_rank and step == args.fail_step and not (args.fail_once and restart_count()):
            fault(args, reporter)
        if args.chatter and rank != args.fail_rank:
            sys.stdout.write(f"rank {rank} step {step} " + "c" * args.chatter + "\n")
        if all_reduce is not None:
            all_reduce()
        time.sleep(args.step_time)
        reporter.step(step, args.steps, loss=10.0 / step, tok_s=1000.0, eta_s=1.0)
    reporter.done(step, args.steps, loss=10.0 / max(step, 1))
    print(f"rank {rank} finished {step} steps", flush=True)


def fault(args: argparse.Namespace, reporter: ProgressReporter) -> None:
    print(f"injecting fault {args.fail}", file=sys.stderr, flush=True)
    if args.fail == "raise":
        raise RuntimeError("injected fault")
    if args.fail == "announce":
        reporter.failing()
        time.sleep(args.term_time)
    if args.fail in ("exit", "announce"):
        # At once: sys.exit would first tear the interpreter down, and with --gloo close the group's sockets while
        # still running, so that on a loaded machine the peer whose all-reduce that breaks could exit before it.
        sys.stdout.flush()
        os._exit(args.code)
    if args.fail == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if args.fail == "segv":
        import ctypes

        ctypes.string_at(0)
    if args.fail == "hang":
        while True:
            time.sleep(3600)
    if args.fail == "gpu_lost":
        fake_gpu_state.mark(os.environ[fake_gpu_state.FAKE_STATE_ENV], int(os.environ["GPU_RANK"]), lost=True)
        raise RuntimeError("CUDA error: uncorrectable ECC error encountered")


if __name__ == "__main__":
    main()
