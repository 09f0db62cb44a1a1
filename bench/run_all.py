"""Regenerate BENCHMARKS.md: run every benchmark in this folder, one after another, and write one page.

    python bench/run_all.py            # all benchmarks, then BENCHMARKS.md
    python bench/run_all.py cache      # only bench_cache.py (the page keeps the other sections as they were)
    python bench/run_all.py gpu --out DIR   # bench_gpu.py (GPU machines; not part of the default list); options
                                            # after the names go to the scripts, and --out DIR also gets the page
    python bench/run_all.py gpu --collect DIR   # the bench_gpu section from the pieces that separate bench_gpu.py
                                                # commands wrote, gathered into DIR (runs nothing; its docstring
                                                # gives the commands for machines that allow 10 minutes a command)

Each `bench_<name>.py` prints its own figures and ratios, measured side by side against its anchor in the same run;
this script records the machine, the command and the output verbatim. Not part of CI: about 35 minutes on 2 cores.
"""

from __future__ import annotations

import datetime
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
PAGE = ROOT / "BENCHMARKS.md"
ORDER = ["cache", "supervisor", "training", "nan_guard", "nan_root", "dataloader", "diagnosis", "exclusion", "restart",
         "nodes", "gpu"]
DEFAULT = [name for name in ORDER if name != "gpu"]  # what a machine without a GPU can measure
# the options a benchmark's section is made with, where the command line gives none: torchrun's own multi-node command
# (no secret set), and the restart goal's case (a rank killed every 20 steps)
OPTIONS = {"nodes": ["--canonical", "--nodes", "2", "--per-node", "2", "--repeats", "3"],
           "restart": ["--steps", "100", "--every", "20"]}
SECTION = re.compile(r"^## bench_(\w+)\n.*?(?=^## bench_|\Z)", re.S | re.M)


def machine() -> str:
    import psutil
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
            f"{psutil.virtual_memory().total / 2**30:.0f} GiB, {gpu}; Python {platform.python_version()}, "
            f"torch {torch.__version__}")


def run(name: str, options: list[str]) -> str:
    script = BENCH / f"bench_{name}.py"
    command = " ".join([f"python bench/{script.name}", *options])
    print(f"== {command}", flush=True)
    start = time.perf_counter()
    out = subprocess.run([sys.executable, str(script), *options], cwd=ROOT, capture_output=True, text=True)
    took = time.perf_counter() - start
    print(out.stdout[-4000:], out.stderr[-2000:] if out.returncode else "", flush=True)
    status = "" if out.returncode == 0 else f" — **exited {out.returncode}**"
    return (f"## bench_{name}\n\n`{command}` ({took:.0f} s{status})\n\n```text\n{out.stdout.strip()}\n"
            + (f"{out.stderr.strip()[-2000:]}\n" if out.returncode else "") + "```\n\n")


def main(argv: list[str]) -> None:
    cut = next((i for i, arg in enumerate(argv) if arg.startswith("--")), len(argv))
    names, options = argv[:cut], argv[cut:]
    sections = {m.group(1): m.group(0) for m in SECTION.finditer(PAGE.read_text())} if PAGE.exists() else {}
    for name in names or DEFAULT:
        sections[name] = run(name, options or OPTIONS.get(name, []))
    intro = (ROOT / "bench" / "INTRO.md").read_text()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    body = "".join(sections[n] for n in ORDER if n in sections)
    PAGE.write_text(f"{intro}\nLast regenerated {stamp} on: {machine()}.\n\n{body}")
    print(f"wrote {PAGE}")
    if "--out" in options:  # a copy where a remote machine's results are collected
        out = Path(options[options.index("--out") + 1])
        out.mkdir(parents=True, exist_ok=True)
        (out / PAGE.name).write_text(PAGE.read_text())
        print(f"wrote {out / PAGE.name}")


if __name__ == "__main__":
    main(sys.argv[1:])
