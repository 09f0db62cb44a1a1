"""The set-up step behind the shell scripts: which interpreter runs, and that nothing is installed when one is given."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BOOTSTRAP = ROOT / "supervisor" / "bootstrap.py"
SHOW = ["-c", "import os, sys; print(sys.executable); print(os.environ['PYTHONPATH'].split(os.pathsep)[0])"]


def run_bootstrap(env: dict[str, str], interpreter: str = sys.executable) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "VIRTUAL_ENV")}
    return subprocess.run([interpreter, str(BOOTSTRAP), *SHOW], env={**clean, **env}, capture_output=True, text=True,
                          timeout=60)


def interpreter_elsewhere(tmp_path: Path) -> Path:
    """This interpreter, packages and all, under another path: a virtual environment is linked in whole (a lone link
    to a venv's python is a bare python: the venv is found beside the path it was started by)."""
    if sys.prefix == sys.base_prefix:
        (tmp_path / "bin").mkdir()
        (tmp_path / "bin" / "python").symlink_to(sys.executable)
        return tmp_path / "bin" / "python"
    (tmp_path / "env").symlink_to(sys.prefix)
    return tmp_path / "env" / "bin" / "python"


def test_python_variable_is_used_as_is(tmp_path: Path) -> None:
    fake = interpreter_elsewhere(tmp_path)
    out = run_bootstrap({"PYTHON": str(fake)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [str(fake), str(ROOT)]
    assert "[setup]" not in out.stderr  # nothing installed


def test_active_virtualenv_is_used_as_is(tmp_path: Path) -> None:
    python = interpreter_elsewhere(tmp_path)
    out = run_bootstrap({"VIRTUAL_ENV": str(python.parent.parent)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == str(python)
    assert "[setup]" not in out.stderr


def test_python_without_the_dependencies_is_refused_before_anything_starts(tmp_path: Path) -> None:
    bare = tmp_path / "bare-python"
    # the standard library only: no site-packages (-S), nor what PYTHONPATH adds (-E: a GPU machine's carried wheels)
    bare.write_text(f"#!/bin/sh\nexec {sys.executable} -S -E \"$@\"\n")
    bare.chmod(0o755)
    out = run_bootstrap({"PYTHON": str(bare)})
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == (f"error: PYTHON={bare}: {bare} lacks torch, transformers, datasets, tokenizers, numpy, psutil, "
                          f"rich, filelock, nvidia-ml-py, safetensors, matplotlib, python-hostlist, zstandard, pyarrow, xxhash; "
                          f"install them with "
                          f"{bare} -m pip install -e '{ROOT}', or leave PYTHON and VIRTUAL_ENV unset to use the "
                          f"project's own environment\n")


def test_interpreter_with_all_dependencies_is_used_without_installing() -> None:
    out = run_bootstrap({})  # this interpreter runs the tests, so it has every dependency
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == sys.executable
    assert "[setup]" not in out.stderr


def test_shell_scripts_only_delegate() -> None:
    for script in ("run_training.sh", "train_gpu.sh", "train_auto_gpu.sh", "run_tests.sh"):
        lines = [line for line in (ROOT / script).read_text().splitlines() if line and not line.startswith("#")]
        assert len(lines) == 1 and lines[0].startswith('exec python3 "$(dirname "$0")/supervisor/bootstrap.py"'), script


def test_python_given_by_name_is_found_on_path() -> None:
    """`PYTHON=python3 bash run_training.sh ...`: a name, resolved on PATH as the shell would."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])  # python3 = this interpreter's
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "VIRTUAL_ENV")}
    out = subprocess.run(["bash", str(ROOT / "run_training.sh"), "--debug", "--max-steps", "4", "--print-config"],
                         env={**clean, "PYTHON": "python3", "PATH": path}, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert '"preset": "debug"' in out.stdout and '"max_steps": 4' in out.stdout
    assert "[setup]" not in out.stderr
