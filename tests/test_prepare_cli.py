"""prepare_dataset.py as a user runs it: output, hit path imports, --verify, --list, --remove, bad input, progress."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import shutil
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

from trainer.config import PROJECT_ROOT
from trainer.data.cache_folder import list_caches

SCRIPT = str(PROJECT_ROOT / "prepare_dataset.py")
TINY = {"source": "stdlib", "vocab_size": 300, "context_length": 32, "max_samples": 20, "val_fraction": 0.1}


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=120,
                          cwd=PROJECT_ROOT, env={**os.environ, **(env or {})})


def fields(stdout: str) -> dict[str, str]:
    """The `name: value` lines the command prints."""
    return {name.strip(): value.strip()
            for name, colon, value in (line.partition(":") for line in stdout.splitlines()) if colon}


def config_file(tmp_path: Path, **data: object) -> str:
    path = tmp_path / f"cfg-{len(list(tmp_path.glob('cfg-*')))}.json"
    path.write_text(json.dumps({"data": {**TINY, "cache_dir": str(tmp_path / "cache"), **data}}))
    return str(path)


def assert_one_line_error(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, str], str]:
    tmp = tmp_path_factory.mktemp("cli")
    config = config_file(tmp)
    result = run("--config", config)
    assert result.returncode == 0, result.stderr
    return config, fields(result.stdout), result.stderr


def test_build_prints_the_figures_and_plain_progress_when_piped(built: tuple[str, dict[str, str], str]) -> None:
    _, out, stderr = built
    for name in ("key", "path", "documents", "tokens", "dtype", "build time", "tokens/s", "peak RSS"):
        assert out.get(name), name
    assert out["status"].startswith("built") and out["dtype"] == "uint16" and out["documents"].startswith("20 ")
    assert Path(out["path"]).name == out["key"] and (Path(out["path"]) / "manifest.json").is_file()
    assert "tokenizing" in stderr and "done:" in stderr and "\x1b[" not in stderr  # plain lines, no terminal codes
    assert "peak RSS" in stderr.split("done:")[-1]


def test_hit_imports_no_heavy_library(built: tuple[str, dict[str, str], str]) -> None:
    config, out, _ = built
    code = ("import runpy, sys\n"
            f"sys.argv = [{SCRIPT!r}, '--config', {config!r}]\n"
            "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\nexcept SystemExit as e:\n    assert not e.code\n"
            "print('HEAVY', [m for m in ('torch', 'transformers', 'datasets') if m in sys.modules])\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=PROJECT_ROOT)
    assert result.returncode == 0, result.stderr
    assert "HEAVY []" in result.stdout and fields(result.stdout)["status"].startswith("hit")
    assert fields(result.stdout)["key"] == out["key"]


def test_verify_passes_then_catches_corruption(built: tuple[str, dict[str, str], str], tmp_path: Path) -> None:
    config, out, _ = built
    ok = run("--config", config, "--verify")
    assert ok.returncode == 0 and fields(ok.stdout)["verify"].startswith("ok")
    root = tmp_path / "cache"
    shutil.copytree(Path(out["path"]).parent, root)
    damaged = config_file(tmp_path)
    tokens = root / out["key"] / "tokens.bin"
    sampled = json.loads((root / out["key"] / "manifest.json").read_text())["files"]["tokens.bin"]["sampled"]
    unsampled = next(b << 16 for b in range(64) if str(b << 16) not in sampled)
    with open(tokens, "r+b") as f:  # a byte the hit's sampled blocks do not cover: only --verify reads it
        f.seek(unsampled)
        first = f.read(1)
        f.seek(unsampled)
        f.write(bytes([first[0] ^ 1]))
    assert_one_line_error(run("--config", damaged, "--verify"), "corrupt", "tokens.bin", "--force")
    with open(tokens, "r+b") as f:  # the first block is sampled: the hit itself sees it and rebuilds
        f.write(b"\0\0")
    rebuilt = run("--config", damaged, "--verify")
    assert rebuilt.returncode == 0 and fields(rebuilt.stdout)["status"].startswith("built")
    assert "rebuilding" in rebuilt.stderr and "sampled blocks" in rebuilt.stderr


def test_list_and_remove(built: tuple[str, dict[str, str], str], tmp_path: Path) -> None:
    config, out, _ = built
    other = config_file(Path(config).parent, context_length=48)
    second = fields(run("--config", other).stdout)
    listing = run("--config", config, "--list")
    assert listing.returncode == 0
    for key in (out["key"], second["key"]):
        assert key in listing.stdout
    assert "context_length 48" in listing.stdout and '"kind": "stdlib"' in listing.stdout
    removed = run("--config", config, "--remove", second["key"][:10])
    assert removed.returncode == 0 and not Path(second["path"]).exists()
    assert second["key"] not in run("--config", config, "--list").stdout
    assert_one_line_error(run("--config", config, "--remove", "ffffffff"), "no cache", "--list")


def test_default_preset_is_production_with_the_stdlib_corpus() -> None:
    result = run("--print-config")
    cfg = json.loads(result.stdout)
    assert cfg["preset"] == "production" and cfg["data"]["source"] == "stdlib"


@pytest.mark.parametrize("data, env, needles", [
    ({"source": "/no/such/corpus.jsonl"}, {}, ("does not exist",)),
    ({"source": "someone/some-dataset"}, {"HF_HUB_OFFLINE": "1"}, ("hub cannot be reached", "local")),
    ({"tokenizer": "someone/no-such-tokenizer"}, {"HF_HUB_OFFLINE": "1"}, ("unknown tokenizer",)),
    ({"vocab_size": 2**33}, {}, ("data.vocab_size must be at most 4,294,967,296",)),
    ({"source": "{tmp}/tiny.txt"}, {}, ("fewer than one context window",)),
], ids=["missing-path", "hub-offline", "unknown-tokenizer", "vocab-over-uint32", "shorter-than-a-window"])
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, data: dict, env: dict, needles: tuple[str, ...]) -> None:
    (tmp_path / "tiny.txt").write_text("hello world")
    data = {k: v.format(tmp=tmp_path) if isinstance(v, str) else v for k, v in data.items()}
    assert_one_line_error(run("--config", config_file(tmp_path, **data), "--quiet", env=env), *needles)
    cache = tmp_path / "cache"
    assert not cache.exists() or not [p for p in cache.iterdir() if p.name not in (".locks", "tokenizers")]


def test_rich_progress_bar_on_a_terminal(tmp_path: Path) -> None:
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # a 120-column terminal
    try:
        proc = subprocess.Popen([sys.executable, SCRIPT, "--config", config_file(tmp_path)], cwd=PROJECT_ROOT,
                                stdout=subprocess.PIPE, stderr=follower, text=True)
        os.close(follower)
        out, _ = proc.communicate(timeout=120)
        chunks = []
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the terminal closed with the process
                break
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(leader)
    terminal = b"".join(chunks).decode(errors="replace")
    assert proc.returncode == 0 and fields(out)["status"].startswith("built")
    assert "tokenizing" in terminal and "\x1b[" in terminal and "━" in terminal  # a live rich bar


def test_a_build_killed_by_sigkill_is_reported_by_the_supervisor(tmp_path: Path) -> None:
    """The supervisor builds in a child process: the out-of-memory killer's SIGKILL (sent here by hand) ends the
    build, not the supervisor, which says so with the host's memory; no rank starts, and nothing half-built is used."""
    import psutil

    cache = tmp_path / "cache"
    proc = subprocess.Popen([sys.executable, "-m", "supervisor", "--debug", "--nproc", "1", "--log-dir",
                             str(tmp_path / "run"), "--set", f"data.cache_dir={cache}", "--set", "data.vocab_size=300",
                             "--set", "data.max_samples=400"],
                            cwd=PROJECT_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        build = None
        while build is None and proc.poll() is None:
            build = next((c for c in psutil.Process(proc.pid).children()
                          if any("prepare_dataset.py" in part for part in c.cmdline())), None)
        assert build is not None, proc.communicate()
        build.kill()
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 137, err
    assert f"the dataset build (prepare_dataset.py, pid {build.pid}) was killed by SIGKILL" in err
    assert "out-of-memory killer" in err and "GiB available now" in err
    assert "CPU0:" not in out + err and not list_caches(cache)
