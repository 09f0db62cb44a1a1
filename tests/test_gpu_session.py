"""bench/gpu_session.py, the GPU checks in two commands, as far as a machine without a GPU can check it: the
calls it prints (and docs/testing.md shows), that each step's parts are commands that parse, what each step leaves under
$OUT, the folders it needs before a step starts, the checkout's exclude file, a step with real wheels and processes
(what goes on whose path, the summary after every stage), and a stage's deadline (SIGINT, then SIGKILL, what the
parts wrote kept, none left running)."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import time
import zipfile
from importlib import metadata
from pathlib import Path

import psutil
import pytest

from rank_scripts.harness import ROOT, clean_env

sys.path.insert(0, str(ROOT / "bench"))
import bench_checkpoint  # noqa: E402
import bench_gpu  # noqa: E402
import gpu_runs  # noqa: E402
import gpu_session  # noqa: E402


def test_the_calls_are_printed_and_in_the_docs() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_session.py"), "calls"], capture_output=True,
                          text=True, timeout=60, env=clean_env())
    assert done.returncode == 0, done.stderr
    calls = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [c["command"] for c in calls] == [f"bash bench/gpu_session.sh {s}" for s in ("presets", "tier", "ablation")]
    assert all(c["carry"] == [".whl", ".anchors"] and c["timeout_s"] == 600 and len(c["command"]) <= 2000
               for c in calls)
    docs = "\n".join(page.read_text() for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    assert all(json.dumps(call) in docs for call in calls)


def commands(part: gpu_session.Part) -> list[list[str]]:
    """A part's commands: the ones a chain runs one after another, each without a leading `nice -n N`."""
    found = [shlex.split(c) for c in part.argv[2].split("; ")] if part.argv[:2] == ("bash", "-c") else [[*part.argv]]
    return [argv[3:] if argv[:2] == ["nice", "-n"] else argv for argv in found]


def test_every_part_is_a_command_that_parses(tmp_path: Path) -> None:
    for step in gpu_session.STEPS.values():
        for part in (part for stage in step.stages for part in stage):
            for argv in commands(part):
                argv = [a.replace("{out}", str(tmp_path)) for a in argv]
                if argv[:2] == ["{python}", "bench/bench_gpu.py"]:
                    opts = bench_gpu.parse(argv[2:])  # an unknown section, shape, run or change exits here
                    assert opts.out == tmp_path and opts.sections and opts.shapes
                    if "--anchor" in argv:
                        assert opts.anchor == (ROOT / gpu_session.ANCHORS / gpu_session.ANCHOR).resolve()
                elif argv[:2] == ["{python}", "bench/bench_checkpoint.py"]:
                    assert bench_checkpoint.parse(argv[2:]).gpu == 0  # an unknown preset or strategy exits here
                elif argv[:3] == ["{python}", "-m", "supervisor"]:
                    preset = argv[argv.index("--preset") + 1]
                    assert "--dry-run" in argv and (ROOT / "presets" / f"{preset}.json").is_file()
                else:
                    assert argv[:2] == ["bash", "run_tests.sh"]
                    paths = [a.split("=", 1)[-1] for a in argv if a.startswith(("tests/", "--ignore="))]
                    assert all((ROOT / path).is_file() for path in paths), paths
    (gpu,) = [part for part in gpu_session.STEPS["presets"].stages[0] if part.name == "gpu"]
    assert "--shapes" in commands(gpu)[0] and commands(gpu)[0][commands(gpu)[0].index("--shapes") + 1] == "1.1B"


def test_each_step_leaves_what_the_gpu_machine_hands_back(tmp_path: Path) -> None:
    """At most 8 files under $OUT, none in a folder, each named in letters, digits, '.', '_' and '-' alone: the rest
    would not come back."""
    for step in gpu_session.STEPS.values():
        names = {f"{step.name}.md"}
        for part in (part for stage in step.stages for part in stage):
            names.add(f"{step.name}-{part.name}.txt")
            for argv in (argv for argv in commands(part) if argv[:2] == ["{python}", "bench/bench_gpu.py"]):
                opts = bench_gpu.parse([a.replace("{out}", str(tmp_path)) for a in argv[2:]])
                assert not isinstance(opts, Path)
                names |= {"bench_gpu.md", gpu_runs.CONSOLES}
                names |= {bench_gpu.Piece(section, shape, opts.runs if section == "training" else opts.ablations)
                          .file_name for section in opts.sections for shape in opts.shapes}
        assert len(names) <= 8, (step.name, sorted(names))
        assert all(re.fullmatch(r"[A-Za-z0-9._-]+", name) for name in names), sorted(names)


def test_prepare_needs_the_projects_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The versions it pins are this interpreter's: one without the project's packages is told which to use."""
    def not_installed(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(gpu_session.metadata, "version", not_installed)
    anchor = tmp_path / gpu_session.ANCHOR
    anchor.write_text("")
    with pytest.raises(SystemExit, match=r"lacks datasets, .*the project's Python \(\.venv/bin/python"):
        gpu_session.prepare(anchor)


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


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
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
    outcomes = gpu_session.run_stage("check", (quick, stuck), tmp_path, lambda part: clean_env(), began + 2.0,
                                     grace=0.5)
    assert time.monotonic() - began < 15
    assert [(o.part.name, o.code) for o in outcomes] == [("quick", 3), ("stuck", None)]
    assert (tmp_path / "check-quick.txt").read_text() == "done\n"
    assert (tmp_path / "check-stuck.txt").read_text() == "started\n"
    assert not [p for p in psutil.process_iter(["cmdline"]) if "signal.SIG_IGN" in " ".join(p.info["cmdline"] or [])]
    text = gpu_session.summary("check", outcomes, ["GPU: none"])
    assert "| stuck | " in text and "| interrupted at the deadline |" in text and "| quick | " in text
    assert "## stuck: check-stuck.txt" in text and "started" in text


def wheel(folder: Path, name: str) -> None:
    """A wheel of one empty module, as pip installs it."""
    info = f"{name}-1.0.dist-info"
    files = {f"{name}.py": "", f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(folder / f"{name}-1.0-py3-none-any.whl", "w") as archive:
        for path, text in files.items():
            archive.writestr(path, text)


def test_a_step_installs_the_wheels_and_writes_its_summary_after_every_stage(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The carried wheels are importable in every part, liger-kernel's only in a part that asks for it (with it
    `training.loss=auto` changes); the summary is on disk before the next stage starts, so a command stopped from
    outside keeps it, and it shows the commands as they ran."""
    monkeypatch.setattr(sys, "path", [*sys.path])  # the step adds the wheels' folders to its own path
    root, out = tmp_path / "root", tmp_path / "out"
    (root / ".whl").mkdir(parents=True)
    wheel(root / ".whl", "carried")
    wheel(root / ".whl", "liger_kernel")
    probe = "import carried, importlib.util as u, sys; print('liger', u.find_spec('liger_kernel') is not None)"
    first = gpu_session.Part("first", ("{python}", "-c", probe))
    second = gpu_session.Part("second", ("{python}", "-c", f"{probe}; print(open(sys.argv[1]).read().count('| first "
                                                           "|'))", "{out}/check.md"), liger=True)
    step = gpu_session.Step("check", ((first,), (second,)), budget=120.0)
    assert gpu_session.run_step(step, out, 120.0, root=root, sites=tmp_path / "sites") == 0
    assert (out / "check-first.txt").read_text() == "liger False\n"
    assert (out / "check-second.txt").read_text() == "liger True\n1\n"
    text = (out / "check.md").read_text()
    assert f"| second | `{sys.executable} -c " in text and f" {out}/check.md` | 0 |" in text
    assert sorted(p.name for p in out.iterdir()) == ["check-first.txt", "check-second.txt", "check.md"]


def test_the_tier_step_runs_every_gpu_test_file_but_the_memory_estimate() -> None:
    """Its files are listed in the order a lease runs them: a file added to tests/gpu/ must be listed too."""
    files = {str(path.relative_to(ROOT)) for path in (ROOT / "tests" / "gpu").glob("test_*.py")}
    assert len(gpu_session.TIER_ORDER) == len(set(gpu_session.TIER_ORDER))
    assert set(gpu_session.TIER_ORDER) == files - {gpu_session.MEMORY_TEST}
