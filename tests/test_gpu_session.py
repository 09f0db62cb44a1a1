"""bench/gpu_session.py, the GPU checks in three commands, as far as a machine without a GPU can check it: the three
calls it prints (and the README shows), that each step's parts are commands that parse, the folders it needs before
a step starts, the checkout's exclude file, and a stage's deadline with real processes (SIGINT, then SIGKILL, what
they wrote kept, none left running)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil

from rank_scripts.harness import ROOT, clean_env

sys.path.insert(0, str(ROOT / "bench"))
import bench_gpu  # noqa: E402
import gpu_session  # noqa: E402


def test_the_three_calls_are_printed_and_in_the_readme() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_session.py"), "calls"], capture_output=True,
                          text=True, timeout=60, env=clean_env())
    assert done.returncode == 0, done.stderr
    calls = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [c["command"] for c in calls] == [f"bash bench/gpu_session.sh {s}" for s in ("tests", "presets", "ablation")]
    assert all(c["carry"] == [".whl", ".anchors"] and c["timeout_s"] == 600 and len(c["command"]) <= 2000
               for c in calls)
    readme = (ROOT / "README.md").read_text()
    assert all(json.dumps(call) in readme for call in calls)


def test_every_part_is_a_command_that_parses(tmp_path: Path) -> None:
    for step in gpu_session.STEPS.values():
        for stage in step.stages:
            for part in stage:
                argv = [a.replace("{out}", str(tmp_path)) for a in part.argv]
                if argv[:2] == ["{python}", "bench/bench_gpu.py"]:
                    opts = bench_gpu.parse(argv[2:])  # an unknown section, shape, run or change exits here
                    assert opts.out == tmp_path and opts.sections and opts.shapes
                    if "--anchor" in argv:
                        assert opts.anchor == (ROOT / gpu_session.ANCHORS / gpu_session.ANCHOR).resolve()
                else:
                    assert argv[:2] == ["bash", "run_tests.sh"]
                    paths = [a.split("=", 1)[-1] for a in argv if a.startswith(("tests/", "--ignore="))]
                    assert all((ROOT / path).is_file() for path in paths), paths
    assert [p.name for p in gpu_session.STEPS["presets"].stages[0]] == ["1.1B"]  # the 55 % figure first


def test_a_step_needs_the_carried_folders(tmp_path: Path) -> None:
    presets, ablation = gpu_session.STEPS["presets"], gpu_session.STEPS["ablation"]
    assert "no wheels in .whl/" in gpu_session.missing_inputs(tmp_path, presets)
    (tmp_path / ".whl").mkdir()
    (tmp_path / ".whl" / "datasets-5.2.0-py3-none-any.whl").write_bytes(b"")
    assert "no .anchors/gpu_textbook_loop.py" in gpu_session.missing_inputs(tmp_path, presets)
    assert "no liger-kernel wheel" in gpu_session.missing_inputs(tmp_path, ablation)
    (tmp_path / ".anchors").mkdir()
    (tmp_path / ".anchors" / "gpu_textbook_loop.py").write_text("")
    (tmp_path / ".whl" / "liger_kernel-0.8.5-py3-none-any.whl").write_bytes(b"")
    assert gpu_session.missing_inputs(tmp_path, presets) is None is gpu_session.missing_inputs(tmp_path, ablation)


def test_the_carried_folders_are_ignored_in_the_checkout_only(tmp_path: Path) -> None:
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    exclude = gpu_session.ignore_locally(tmp_path)
    assert exclude == (tmp_path / ".git" / "info" / "exclude").resolve()
    gpu_session.ignore_locally(tmp_path)  # twice: listed once
    lines = exclude.read_text().splitlines()
    assert lines.count("/.whl/") == 1 and lines.count("/.anchors/") == 1
    (tmp_path / ".whl").mkdir()
    (tmp_path / ".whl" / "a.whl").write_bytes(b"")
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=tmp_path,
                            capture_output=True, text=True, check=True).stdout
    assert ".whl" not in status


def test_a_stage_stops_at_its_deadline_and_keeps_what_the_parts_wrote(tmp_path: Path) -> None:
    quick = gpu_session.Part("quick", ("{python}", "-c", "print('done'); raise SystemExit(3)"))
    # ignores SIGINT, as a stuck child might: SIGKILL ends it
    stuck = gpu_session.Part("stuck", ("{python}", "-c", "import signal, time; signal.signal(signal.SIGINT, "
                                       "signal.SIG_IGN); print('started', flush=True); time.sleep(60)"))
    began = time.monotonic()
    outcomes = gpu_session.run_stage("check", (quick, stuck), tmp_path, clean_env(), began + 2.0, grace=0.5)
    assert time.monotonic() - began < 15
    assert [(o.part.name, o.code) for o in outcomes] == [("quick", 3), ("stuck", None)]
    assert (tmp_path / "check-quick.txt").read_text() == "done\n"
    assert (tmp_path / "check-stuck.txt").read_text() == "started\n"
    assert not [p for p in psutil.process_iter(["cmdline"]) if "signal.SIG_IGN" in " ".join(p.info["cmdline"] or [])]
    text = gpu_session.summary("check", outcomes, ["GPU: none"])
    assert "| stuck | " in text and "| interrupted at the deadline |" in text and "| quick | " in text
    assert "## stuck: check-stuck.txt" in text and "started" in text
