"""The GPU checks in two commands, for a GPU machine that gets a copy of the working tree (no network, no git
checkout there), allows 10 minutes a command and 15 minutes in all (its start included), and hands back what the
commands write under `$OUT`.

Here, in the checkout whose copy the GPU machine gets, with the project's Python (pip's network and the textbook loop
are here, not there):

    python bench/gpu_session.py prepare [--anchor PATH]   # .whl/: the wheels the GPU image lacks; .anchors/: the
                                                          # textbook loop; both git-ignored; prints the calls
    python bench/gpu_session.py calls                     # the calls again (runs nothing)

There, one call per step, each `bash bench/gpu_session.sh STEP` with `.whl` and `.anchors` carried, `timeout_s` 600,
the second sent as soon as the first returns (the machine stays started for seconds only):

    presets    on the GPU, one after another: `1b`, then `small`, as shipped through the supervisor, each against the
               textbook loop compiled (bench_gpu.py's training section, `--runs shipped`; the ranks' consoles, with
               their MFU lines, kept), then the 1b checkpoint's blocked time, synchronous against in the background
               (bench_checkpoint.py --gpu); beside them, the dry run's estimate of both presets (to set against the
               peaks the shipped rows measure) and the default suite on the CPUs (it hides the GPU) at the lowest
               priority, so that the timed runs keep their cores; 530 s
    tier       the GPU tier without the memory-estimate test, the files no lease has yet run to the end first
               (the restart, the supervisor, training; `TIER_ORDER`); give it what is left of the lease with
               `--budget S`
    ablation   for a longer lease: the memory-estimate test, then the 1.1B ablation rows (eager layers, the full
               logits, chunked against liger's loss), liger-kernel installed for them

A step installs the wheels into /tmp/site (liger-kernel into a folder of its own, on the path of the parts that ask
for it only: with it `training.loss=auto` is liger's kernel, which the dry run's estimate does not model), runs its
parts, one stage after another, the parts of a stage side by side, until its deadline (a part still running then gets
SIGINT, then SIGKILL; what it wrote stays), and writes `$OUT/<step>.md`, again after every stage, which it prints
last: the GPU, the versions, each part's command, exit status and time, and the end of each part's output. Each part's
whole output is `$OUT/<step>-<part>.txt`; bench_gpu.py's tables are its pieces in `$OUT` (`python bench/run_all.py
gpu --collect DIR` makes the page).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEELS, ANCHORS = ".whl", ".anchors"  # git-ignored folders that travel with the working tree
ANCHOR = "gpu_textbook_loop.py"
DEFAULT_ANCHOR = ROOT.parent / "shared" / "anchors" / ANCHOR
# the project's needs the GPU image lacks
PROJECT_WHEELS = ("datasets", "dill", "multiprocess", "python-hostlist", "zstandard", "py-spy")
BUILT_HERE = ("python-hostlist",)  # no wheel on PyPI: built from its (pure Python) sdist
LIGER = "liger-kernel==0.8.5"
LIGER_PREFIX = "liger_kernel-"
GPU_PYTHON = "3.12"  # the GPU image's Python
PLATFORM = ["--python-version", GPU_PYTHON, "--implementation", "cp", "--only-binary=:all:"] + [
    arg for tag in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_5_x86_64",
                    "manylinux1_x86_64")
    for arg in ("--platform", tag)]
SITES = Path("/tmp")  # the wheels go to SITES/site, liger-kernel to SITES/site-liger
CALL_LIMIT_S = 600  # one command on the GPU machine
GRACE_S = 15.0  # after SIGINT, before SIGKILL: pytest prints its summary, the supervisor stops its ranks
TAIL_LINES = 14
VERSIONS = ("torch", "triton", "transformers", "tokenizers", "datasets", "pyarrow", "fsspec", "liger-kernel")


@dataclass(frozen=True)
class Part:
    name: str
    argv: tuple[str, ...]  # run in the checkout; "{python}" and "{out}" are filled in
    liger: bool = False  # liger-kernel importable (it changes what `training.loss=auto` runs)


@dataclass(frozen=True)
class Step:
    name: str
    stages: tuple[tuple[Part, ...], ...]  # one after another; a stage's parts side by side
    budget: float  # seconds from the step's start until its parts are stopped

    @property
    def liger(self) -> bool:
        return any(part.liger for stage in self.stages for part in stage)


MEMORY_TEST = "tests/gpu/test_memory_estimate.py"
# The GPU tier but the memory-estimate test, the files no lease has yet run to the end first (a lease runs about ten
# of its tests); the faults, the NaN guard and the diagnosis passed on an H200 (BENCHMARKS.md, "GPU").
TIER_ORDER = tuple(f"tests/gpu/{name}.py" for name in (
    "test_gpu_restart", "test_gpu_supervisor", "test_gpu_training", "test_gpu_faults", "test_gpu_nan_guard",
    "test_gpu_diagnosis"))


def tests(name: str, *args: str) -> Part:
    return Part(name, ("bash", "run_tests.sh", "-q", f"--basetemp=/tmp/gpu-session-{name}", *args))


def bench(*args: str) -> tuple[str, ...]:
    return ("{python}", "bench/bench_gpu.py", *args, "--out", "{out}")


def chain(name: str, *commands: tuple[str, ...], liger: bool = False) -> Part:
    """Commands one after another in one part, each whatever the previous one's exit status."""
    return Part(name, ("bash", "-c", "; ".join(shlex.join(command) for command in commands)), liger)


def shipped(shape: str) -> tuple[str, ...]:
    """A preset as shipped against the textbook loop; a run that hangs is stopped after 4 minutes, so that the
    rows after it still run within the step."""
    return bench("--sections", "training", "--shapes", shape, "--runs", "shipped", "--anchor", f"{ANCHORS}/{ANCHOR}",
                 "--run-timeout", "240")


def dry_run(preset: str) -> tuple[str, ...]:
    return ("{python}", "-m", "supervisor", "--preset", preset, "--gpus", "0", "--dry-run")


# The default suite runs on the CPUs (it hides the GPU) beside the GPU's work, at the lowest priority so that the timed
# runs' host threads keep their cores.
SUITE = Part("suite", ("nice", "-n", "19", "bash", "run_tests.sh", "-q", "--basetemp=/tmp/gpu-session-suite"))
CHECKPOINT = ("{python}", "bench/bench_checkpoint.py", "--gpu", "0", "--preset", "1b", "--strategies", "ddp",
              "--steps", "8", "--interval", "4")
STEPS = {step.name: step for step in (
    # The GPU: `1b`, then `small`, as shipped against the textbook loop, then the 1b checkpoint's blocked time; the
    # dry run's estimates of both presets, to set against the peaks the shipped rows measure.
    Step("presets", ((SUITE, chain("estimate", dry_run("1b"), dry_run("small")),
                      chain("gpu", shipped("1.1B"), shipped("125M"), CHECKPOINT)),), budget=530.0),
    Step("tier", ((tests("gpu", "-m", "gpu", *TIER_ORDER),),), budget=190.0),
    # With a longer lease: the memory-estimate test, then the 1.1B ablation rows, liger-kernel installed for them.
    # The memory test runs without liger-kernel: the dry run's estimate models the chunked loss, what `auto` is without.
    Step("ablation", ((tests("memory", "-m", "gpu", MEMORY_TEST),),
                      (Part("1.1B", bench("--sections", "ablation", "--shapes", "1.1B",
                                          "--ablations", "eager,full_loss,chunked_loss"), liger=True),)),
         budget=450.0),
)}


def calls() -> list[dict[str, object]]:
    """The calls, as the GPU machine's command runner takes them."""
    return [{"command": f"bash bench/gpu_session.sh {name}", "carry": [WHEELS, ANCHORS], "timeout_s": CALL_LIMIT_S}
            for name in STEPS]


# ---------------------------------------------------------------------------------------------------------------------
# Here: what the GPU machine needs


def ignore_locally(root: Path, folders: tuple[str, ...] = (WHEELS, ANCHORS)) -> Path:
    """List `folders` in the checkout's own exclude file (never committed, shared by its worktrees)."""
    where = subprocess.run(["git", "rev-parse", "--git-path", "info/exclude"], cwd=root, check=True,
                           capture_output=True, text=True).stdout.strip()
    exclude = (root / where).resolve()
    lines = exclude.read_text().splitlines() if exclude.exists() else []
    missing = [f"/{folder}/" for folder in folders if f"/{folder}/" not in lines]
    if missing:
        exclude.parent.mkdir(parents=True, exist_ok=True)
        exclude.write_text("".join(f"{line}\n" for line in lines + missing))
    return exclude


def prepare(anchor: Path) -> None:
    """The wheels (this environment's versions, for the GPU image's Python) and the textbook loop, into the folders
    the calls carry."""
    if not anchor.is_file():
        raise SystemExit(f"error: the textbook loop {anchor} does not exist; give its path with --anchor PATH")
    try:
        pinned = {name: f"{name}=={metadata.version(name)}" for name in PROJECT_WHEELS}
    except metadata.PackageNotFoundError as e:
        raise SystemExit(f"error: {sys.executable} lacks {e.name}, whose version the GPU machine gets: run prepare "
                         f"with the project's Python (.venv/bin/python once `bash run_tests.sh` has made it)") from None
    wheels = ROOT / WHEELS
    shutil.rmtree(wheels, ignore_errors=True)  # one version of each: two would stop the install there
    pip = [sys.executable, "-m", "pip", "-q"]
    subprocess.run([*pip, "download", "--no-deps", *PLATFORM, "-d", str(wheels), LIGER,
                    *(pin for name, pin in pinned.items() if name not in BUILT_HERE)], check=True)
    subprocess.run([*pip, "wheel", "--no-deps", "-w", str(wheels), *(pinned[name] for name in BUILT_HERE)], check=True)
    (ROOT / ANCHORS).mkdir(exist_ok=True)
    (ROOT / ANCHORS / ANCHOR).unlink(missing_ok=True)  # an earlier copy may be read-only, as its source is
    shutil.copy2(anchor, ROOT / ANCHORS / ANCHOR)
    exclude = ignore_locally(ROOT)
    print(f"wrote {wheels} ({', '.join(sorted(p.name for p in wheels.glob('*.whl')))}) and {ROOT / ANCHORS / ANCHOR}; "
          f"both ignored in {exclude}")
    print_calls()


def print_calls() -> None:
    print("On the GPU machine, one call per step (each under 10 minutes; results under $OUT):")
    for call in calls():
        print(json.dumps(call))


# ---------------------------------------------------------------------------------------------------------------------
# There: a step


@dataclass(eq=False)
class Outcome:
    part: Part
    argv: list[str]  # as run: the interpreter and the results folder filled in
    log: Path
    code: int | None = None  # None: still running at the deadline, interrupted
    seconds: float = 0.0


def missing_inputs(root: Path, step: Step) -> str | None:
    """Why `step` cannot start from `root` (None: it can): the carried folders `prepare` fills."""
    wheels = sorted((root / WHEELS).glob("*.whl"))
    if not wheels:
        return f"no wheels in {WHEELS}/: run `python bench/gpu_session.py prepare` in the checkout first, and carry {WHEELS}"
    if step.liger and not any(w.name.startswith(LIGER_PREFIX) for w in wheels):
        return f"no liger-kernel wheel in {WHEELS}/: run `python bench/gpu_session.py prepare` again"
    uses_anchor = any(f"{ANCHORS}/{ANCHOR}" in arg for stage in step.stages for part in stage for arg in part.argv)
    if uses_anchor and not (root / ANCHORS / ANCHOR).is_file():
        return f"no {ANCHORS}/{ANCHOR}: run `python bench/gpu_session.py prepare` in the checkout first, and carry {ANCHORS}"
    return None


def site(sites: Path, liger: bool) -> Path:
    return sites / ("site-liger" if liger else "site")


def install(step: Step, root: Path, sites: Path) -> None:
    """The carried wheels into `sites`: liger-kernel's into a folder of its own, where a part of the step asks for
    it. This process sees them all (for the versions in the summary)."""
    wheels = sorted((root / WHEELS).glob("*.whl"))
    for liger in sorted({False, step.liger}):
        target = site(sites, liger)
        group = [w for w in wheels if w.name.startswith(LIGER_PREFIX) == liger]
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", str(target), *map(str, group)], check=True)
        sys.path.insert(0, str(target))


def part_env(part: Part, root: Path, sites: Path) -> dict[str, str]:
    """The environment a part runs in: the wheels and the checkout on its path (liger-kernel only if it asks), this
    interpreter as PYTHON for the shell scripts it starts."""
    folders = [site(sites, False), *([site(sites, True)] if part.liger else []), root]
    path = os.pathsep.join(filter(None, [*map(str, folders), os.environ.get("PYTHONPATH")]))
    scripts = os.pathsep.join(filter(None, [str(site(sites, False) / "bin"), os.environ.get("PATH")]))  # py-spy
    return {**os.environ, "PYTHONPATH": path, "PATH": scripts, "PYTHON": sys.executable, "PYTHONUNBUFFERED": "1"}


def run_stage(step: str, parts: tuple[Part, ...], out: Path, env: Callable[[Part], dict[str, str]],
              deadline: float, grace: float = GRACE_S, root: Path = ROOT) -> list[Outcome]:
    """The parts side by side in `root`, each in a process group of its own writing `out/<step>-<part>.txt`; whatever
    still runs at `deadline` (time.monotonic) gets SIGINT, and SIGKILL `grace` seconds later."""
    started = time.monotonic()
    running: dict[Outcome, subprocess.Popen[bytes]] = {}
    for part in parts:
        argv = [a.replace("{python}", sys.executable).replace("{out}", str(out)) for a in part.argv]
        outcome = Outcome(part, argv, out / f"{step}-{part.name}.txt")
        with outcome.log.open("wb") as sink:
            running[outcome] = subprocess.Popen(argv, cwd=root, env=env(part), stdout=sink, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, start_new_session=True)
    while time.monotonic() < deadline:
        for outcome, proc in running.items():
            if outcome.code is None and proc.poll() is not None:
                outcome.code, outcome.seconds = proc.returncode, time.monotonic() - started
        if all(outcome.code is not None for outcome in running):
            break
        time.sleep(0.2)
    late = [proc for outcome, proc in running.items() if outcome.code is None]
    for signum, wait in ((signal.SIGINT, grace), (signal.SIGKILL, 5.0)):
        for proc in late:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signum)
        for proc in late:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(wait)
    for outcome, proc in running.items():
        if proc in late:
            outcome.seconds = time.monotonic() - started
    return list(running)


def gpu_line() -> str:
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"no nvidia-smi ({e})"
    return done.stdout.strip() or done.stderr.strip()


def versions() -> str:
    found = []
    for name in VERSIONS:
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            found.append(f"{name} not installed")
    return ", ".join(found)


def summary(step: str, outcomes: list[Outcome], head: list[str]) -> str:
    lines = [f"# bench/gpu_session.sh {step}", "", *head, "", "| part | command | exit | seconds |", "|---|---|---|---|"]
    for o in outcomes:
        status = "interrupted at the deadline" if o.code is None else str(o.code)
        lines.append(f"| {o.part.name} | `{' '.join(o.argv)}` | {status} | {o.seconds:.0f} |")
    for o in outcomes:
        text = o.log.read_text(errors="replace").splitlines()
        failed = [line for line in text if line.startswith(("FAILED ", "ERROR "))]
        tail = text[-TAIL_LINES:]
        lines += ["", f"## {o.part.name}: {o.log.name}", "", "```text",
                  *[line for line in failed[:20] if line not in tail], *tail, "```"]
    return "\n".join(lines) + "\n"


def run_step(step: Step, out: Path, budget: float, root: Path = ROOT, sites: Path = SITES) -> int:
    """The step's stages in `root` until `budget` seconds after its start. `out/<step>.md` is written at the start and
    after every stage, so a command stopped from outside still leaves the stages it finished."""
    started = time.monotonic()
    if (why := missing_inputs(root, step)) is not None:
        print(f"error: {why}", file=sys.stderr)
        return 2
    try:
        install(step, root, sites)
    except subprocess.CalledProcessError as e:
        print(f"error: pip could not install the wheels in {WHEELS}/ (exit {e.returncode}, above): carry the folder "
              f"that `python bench/gpu_session.py prepare` wrote for Python {GPU_PYTHON}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    head = [f"GPU: {gpu_line()}", f"Python {sys.version.split()[0]}: {versions()}",
            f"deadline: {budget:.0f} s after the start"]
    outcomes: list[Outcome] = []

    def report() -> str:
        text = summary(step.name, outcomes, head)
        (out / f"{step.name}.md").write_text(text)
        return text

    text = report()
    for stage in step.stages:
        if time.monotonic() < started + budget:
            outcomes += run_stage(step.name, stage, out, lambda part: part_env(part, root, sites), started + budget,
                                  root=root)
        else:
            head.append(f"not started (no time left): {', '.join(p.name for p in stage)}")
        text = report()
    print(text, flush=True)
    return 0 if all(o.code == 0 for o in outcomes) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    prep = sub.add_parser("prepare", help="here: the wheels and the textbook loop the calls carry; prints the calls")
    prep.add_argument("--anchor", type=Path, default=DEFAULT_ANCHOR, help=f"the textbook loop ({ANCHOR})")
    sub.add_parser("calls", help="print the calls (runs nothing)")
    for name in STEPS:
        one = sub.add_parser(name, help=f"on the GPU machine: the {name} step")
        one.add_argument("--out", type=Path, default=os.environ.get("OUT"), help="results (default: $OUT)")
        one.add_argument("--budget", type=float,
                         help=f"seconds until its parts are stopped (default {STEPS[name].budget:g})")
    args = parser.parse_args(argv)
    if args.what == "prepare":
        prepare(args.anchor)
        return 0
    if args.what == "calls":
        print_calls()
        return 0
    if args.out is None:
        parser.error("--out DIR (or OUT in the environment) is where the results go")
    step = STEPS[args.what]
    return run_step(step, args.out, step.budget if args.budget is None else args.budget)


if __name__ == "__main__":
    sys.exit(main())
