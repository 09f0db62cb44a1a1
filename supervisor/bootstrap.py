"""Pick the Python environment for an entry point, creating the project's own once if needed, then exec it.

Usage (what the shell scripts run): ``python3 supervisor/bootstrap.py -m supervisor ARGS...``

Which interpreter, first match wins:
1. ``PYTHON=/path/to/python`` or a name on ``PATH`` (``PYTHON=python3``): used as is, nothing installed.
2. An active virtual environment (``VIRTUAL_ENV``): used as is, nothing installed.
   Either must have the dependencies: one lacking some is refused with one line naming them and the install command,
   before anything starts (not a ModuleNotFoundError from deep inside a run, or from one node of several).
3. The interpreter running this file, when it already has every dependency (for example your CUDA build of torch).
4. The project-local ``.venv/``: created on first use (torch pinned to 2.13.0 where no torch is importable, then
   ``pip install -e .[test]``), reused afterwards; it is reinstalled only when ``pyproject.toml`` changes.

Standard library only: it runs before any dependency exists.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NoReturn

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
STAMP = VENV / ".installed-pyproject-sha256"
REQUIRED_MODULES = ("torch", "transformers", "datasets", "tokenizers", "numpy", "psutil", "rich", "filelock",
                    "pynvml", "safetensors", "matplotlib", "hostlist",
                    "zstandard", "pyarrow", "xxhash")
TEST_MODULES = ("pytest",)
PACKAGES = {"pynvml": "nvidia-ml-py", "hostlist": "python-hostlist"}  # where the pip package is named otherwise
PROBE = "import importlib.util, sys; print(*(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))"
TORCH_PIN = "torch==2.13.0"  # the CPU build the project's machines carry; a torch already present is never replaced


USER_ERROR_EXIT_CODE = 2  # as trainer.errors says; this file may not import the project


def say(message: str) -> None:
    print(f"[setup] {message}", file=sys.stderr, flush=True)


def bad_input(message: str) -> NoReturn:
    """One `error:` line and exit 2, like every other entry point's bad input."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(USER_ERROR_EXIT_CODE)


def pyproject_digest() -> str:
    return hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()


def has_dependencies() -> bool:
    return all(importlib.util.find_spec(name) is not None for name in REQUIRED_MODULES + TEST_MODULES)


def check_dependencies(python: str, where: str, argv: list[str]) -> None:
    """A given interpreter must have what the entry point imports (the test extra too for the test suite)."""
    tests = argv[:2] == ["-m", "pytest"]
    modules = REQUIRED_MODULES + (TEST_MODULES if tests else ())
    try:
        probe = subprocess.run([python, "-c", PROBE, *modules], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        bad_input(f"{where}: cannot run {python} ({e}); set PYTHON to a Python interpreter")
    if probe.returncode != 0:
        bad_input(f"{where}: {python} did not run as a Python interpreter; set PYTHON to one")
    missing = probe.stdout.split()
    if missing:
        packages = ", ".join(PACKAGES.get(m, m) for m in missing)
        target = f"{ROOT}[test]" if tests else str(ROOT)
        bad_input(f"{where}: {python} lacks {packages}; install them with {python} -m pip install -e '{target}', or "
                  f"leave PYTHON and VIRTUAL_ENV unset to use the project's own environment")


def venv_python() -> Path:
    return VENV / "bin" / "python"


def ensure_project_venv() -> Path:
    python = venv_python()
    if python.exists() and STAMP.exists() and STAMP.read_text().strip() == pyproject_digest():
        return python
    if not python.exists():
        say(f"creating {VENV} (first run only)")
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    has_torch = subprocess.run([str(python), "-c", "import torch"], capture_output=True).returncode == 0
    if not has_torch:
        say(f"installing {TORCH_PIN}")
        subprocess.run(pip + [TORCH_PIN], check=True)
    say("installing the project and its dependencies")
    subprocess.run(pip + ["-e", f"{ROOT}[test]"], check=True)
    STAMP.write_text(pyproject_digest() + "\n")
    return python


def given_python(name: str) -> str:
    """PYTHON as a path or a command name, resolved as the shell would (`os.execv` wants a path)."""
    found = shutil.which(name)
    if found is None:
        where = "not an executable file" if os.sep in name else "not a command on PATH"
        bad_input(f"PYTHON={name}: {where}; set PYTHON to a Python interpreter (a path, or a name such as python3), "
                  f"or leave it unset to use the project's own environment")
    return str(found)


def choose_python(argv: list[str]) -> str:
    if os.environ.get("PYTHON"):
        python = given_python(os.environ["PYTHON"])
        check_dependencies(python, f"PYTHON={os.environ['PYTHON']}", argv)
        return python
    if os.environ.get("VIRTUAL_ENV"):
        python = str(Path(os.environ["VIRTUAL_ENV"]) / "bin" / "python")
        check_dependencies(python, f"VIRTUAL_ENV={os.environ['VIRTUAL_ENV']}", argv)
        return python
    if has_dependencies():
        return sys.executable
    return str(ensure_project_venv())


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit("usage: bootstrap.py -m MODULE [ARGS...] | bootstrap.py SCRIPT [ARGS...]")
    try:
        python = choose_python(argv)
    except subprocess.CalledProcessError as e:
        sys.exit(f"error: setting up the environment failed ({' '.join(map(str, e.cmd))} exited {e.returncode})")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    try:
        os.execv(python, [python, *argv])
    except OSError as e:  # a file that is not a program (a folder, a script without #!, no permission)
        bad_input(f"cannot run {python}: {e.strerror}; set PYTHON to a Python interpreter")


if __name__ == "__main__":
    main(sys.argv[1:])
