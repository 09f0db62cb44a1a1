"""pretrain_main.py as real processes: by hand, as the supervisor starts it (--run-config, torchrun's variables,
the progress pipe), under plain torchrun; SIGTERM, SIGUSR1, exact resume, refusals and user errors."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from rank_support import (
    MAIN,
    PYTHON,
    TINY,
    base_env,
    free_port,
    history,
    history_losses,
    kill_on_exit,
    log_lines,
    merged,
    rank_env,
    run_main,
    set_flags,
    tiny_config,
)
from trainer.config import Config

STEPS = 60  # the two-rank runs: long enough that a SIGTERM sent after step 3 lands mid-run


def test_single_process_run_by_hand(tmp_path: Path, token_cache_dir: Path) -> None:
    """`python pretrain_main.py --debug --set ...`: run folder logs/<run-id>/, checkpoints in .checkpoints/, a final
    model that transformers loads and generates with; then a resume with another model shape is refused, and a fresh
    start supersedes the finished run."""
    layer = merged(TINY, {"data": {"cache_dir": str(token_cache_dir)}, "training": {"max_steps": 4, "eval_interval": 2},
                          "checkpoint": {"interval": 2, "save_final": True}, "logging": {"plot": True},
                          "debug": {"nan_localize": True, "nan_dump": True}})
    result = run_main(["--debug", *set_flags(layer)], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = log_lines(result.stdout)
    assert [(m["gpu"], int(m["step"]), int(m["total"])) for m in lines] == [("0", s, 4) for s in range(4)]
    assert "INFO | world size: 1 (gloo)" in result.stdout and "INFO | dataset: cache " in result.stdout

    (run_dir,) = (tmp_path / "logs").iterdir()
    assert Config.load(run_dir / "config.json").preset == "debug"
    record = history(run_dir)
    assert record["run"]["status"] == "completed" and [r["step"] for r in record["steps"]] == [0, 1, 2, 3]
    assert [r["val_loss"] is not None for r in record["steps"]] == [False, True, False, True]
    assert (run_dir / "training_history.png").stat().st_size > 1000
    assert sorted(p.name for p in (tmp_path / ".checkpoints").iterdir()) == ["final", "step_000002", "step_000004"]

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tmp_path / ".checkpoints" / "final")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / ".checkpoints" / "final")
    prompt = tokenizer("def main(", return_tensors="pt").input_ids
    generated = model.generate(prompt, max_new_tokens=5, do_sample=False)
    assert generated.shape == (1, prompt.shape[1] + 5)
    assert isinstance(tokenizer.decode(generated[0]), str)

    wider = merged(layer, {"model": {"hidden_size": 64}})
    refused = run_main(["--debug", *set_flags(wider), "--resume", "auto"], cwd=tmp_path)
    assert refused.returncode == 2
    (line,) = refused.stderr.strip().splitlines()
    assert line.startswith("error: checkpoint .checkpoints/step_000004 holds a different model shape")

    # A fresh start in the same folder supersedes the finished run: its first checkpoint replaces them, so neither
    # pruning nor a later --resume auto can take the earlier run's step_000004 for this run's.
    quick = {"training": {"max_steps": 3}, "logging": {"plot": False}, "debug": {"nan_localize": False,
                                                                              "nan_dump": False}}
    again = run_main(["--debug", *set_flags(merged(layer, quick))], cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert ("INFO | .checkpoints holds a finished earlier run (up to step_000004): this run starts from step 0"
            in again.stdout)
    assert sorted(p.name for p in (tmp_path / ".checkpoints").iterdir()) == ["final", "step_000002", "step_000003"]


class ProgressPipe:
    """The supervisor's side of a rank's progress channel."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        self.buffer = b""
        self.events: list[dict[str, Any]] = []

    def poll(self, timeout: float = 0.1) -> None:
        if select.select([self.read_fd], [], [], timeout)[0]:
            chunk = os.read(self.read_fd, 65536)
            self.buffer += chunk
            *lines, self.buffer = self.buffer.split(b"\n")
            self.events += [json.loads(line) for line in lines if line]

    def wait_for_step(self, step: int, proc: subprocess.Popen, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not any(e["event"] == "step" and e["step"] >= step for e in self.events):
            assert proc.poll() is None, f"the rank exited early ({proc.returncode})"
            assert time.monotonic() < deadline, "no progress"
            self.poll()

    def close(self) -> None:
        os.close(self.read_fd)


def launch(config: Path, pipes: list[ProgressPipe] | None = None) -> list[subprocess.Popen]:
    """Two CPU ranks exactly as the supervisor starts them."""
    port = free_port()
    procs = []
    for rank in range(2):
        extra = {"SUPERVISOR_PROGRESS_FD": str(pipes[rank].write_fd)} if pipes else {}
        procs.append(subprocess.Popen(
            [PYTHON, MAIN, "--run-config", str(config)], cwd=config.parent, env=rank_env(rank, 2, port, **extra),
            pass_fds=[pipes[rank].write_fd] if pipes else [], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True))
    return procs


def finish(procs: list[subprocess.Popen]) -> list[tuple[int, str, str]]:
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        results.append((proc.returncode, out, err))
    return results


def write_run_config(folder: Path, cache_dir: Path, ckpt: Path, resume: str | None = None) -> Path:
    """What the supervisor writes to logs/<run-id>/config.json (the run folder is the file's folder)."""
    cfg = tiny_config(folder, cache_dir, training={"max_steps": STEPS},
                      checkpoint={"dir": str(ckpt), "resume": resume})
    cfg.save(folder / "config.json")
    return folder / "config.json"


def test_sigterm_on_one_rank_stops_both_with_a_checkpoint_and_resume_is_exact(tmp_path: Path,
                                                                              token_cache_dir: Path) -> None:
    ckpt = tmp_path / "ckpt"
    pipes = [ProgressPipe(), ProgressPipe()]
    stopped = launch(write_run_config(tmp_path / "stopped", token_cache_dir, ckpt), pipes)
    with kill_on_exit(*stopped):
        for pipe in pipes:
            os.close(pipe.write_fd)
        pipes[1].wait_for_step(3, stopped[1])
        os.kill(stopped[0].pid, signal.SIGUSR1)  # the supervisor's stack-dump request: answered, not fatal
        stopped[1].send_signal(signal.SIGTERM)  # only rank 1 is told; rank 0 learns it through the agreement
        results = finish(stopped)
    for pipe in pipes:
        pipe.poll(0)
        pipe.close()
    assert [code for code, _, _ in results] == [0, 0], results[0][2][-2000:] + results[1][2][-2000:]
    assert "Current thread" in results[0][2] or "Thread 0x" in results[0][2]  # faulthandler's dump on stderr
    assert all("stopping after step" in out for _, out, _ in results)
    (saved,) = [p.name for p in ckpt.iterdir()]
    stop_step = int(saved.removeprefix("step_"))
    assert 3 <= stop_step < STEPS
    assert history(tmp_path / "stopped")["run"]["status"] == "stopped"
    phases = [e["phase"] for e in pipes[0].events if e["event"] == "phase"]
    assert phases[:5] == ["distributed", "dataset", "model", "resume", "training"]
    assert [e["step"] for e in pipes[0].events if e["event"] == "step"] == list(range(1, stop_step + 1))
    last = [pipe.events[-1] for pipe in pipes]  # each rank's last record: stopped, and which one got the signal
    assert [(e["event"], e["step"], e["signal"]) for e in last] == [("stopped", stop_step, None),
                                                                   ("stopped", stop_step, "SIGTERM")]

    resumed = launch(write_run_config(tmp_path / "resumed", token_cache_dir, ckpt, resume="auto"))
    straight = launch(write_run_config(tmp_path / "straight", token_cache_dir, tmp_path / "ckpt-straight"))
    with kill_on_exit(*resumed, *straight):
        results = finish(resumed) + finish(straight)
    assert [code for code, _, _ in results] == [0, 0, 0, 0], results[0][2][-3000:]
    assert f"resumed from {ckpt / saved} at step {stop_step}" in results[0][1]
    expected = history_losses(tmp_path / "straight")
    got = history_losses(tmp_path / "resumed")
    assert sorted(got) == list(range(stop_step, STEPS))
    assert all(got[s] == expected[s] for s in got)  # bit-identical to the uninterrupted run


@pytest.mark.slow
def test_plain_torchrun_with_two_ranks_sharded(tmp_path: Path) -> None:
    """`torchrun --nproc-per-node 2 pretrain_main.py --debug ...` with FSDP2: both ranks log every step, both ask for
    the token cache at once and share the one folder it builds (its lock), and the final model is gathered from the
    shards. In the slow tier: the default suite runs the README's plain torchrun command, FSDP2's sharded checkpoint
    and gathered final model in tests/test_distributed.py, and the cache's lock in tests/test_cache.py."""
    layer = merged(TINY, {"data": {"cache_dir": str(tmp_path / "cache")}, "model": {"num_layers": 2},
                          "training": {"max_steps": 3, "strategy": "fsdp", "grad_accum_nums": 2},
                          "checkpoint": {"save_final": True}})
    torchrun = Path(PYTHON).with_name("torchrun")  # this interpreter's: the project's .venv is not everywhere
    proc = subprocess.Popen([str(torchrun), "--nproc-per-node", "2", MAIN, "--debug",
                             *set_flags(layer)], cwd=tmp_path, env=base_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    with kill_on_exit(proc):
        out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    seen = sorted((m["gpu"], int(m["step"])) for m in log_lines(out))
    assert seen == [(gpu, step) for gpu in ("0", "1") for step in range(3)]
    assert "strategy: fsdp" in out
    caches = [p for p in (tmp_path / "cache").iterdir() if not p.name.startswith(".") and p.name != "tokenizers"]
    assert len(caches) == 1 and err.count("tokenizing") <= 1  # only rank 0 reports a build, and at most one
    assert (tmp_path / ".checkpoints" / "step_000003" / "dcp").is_dir()
    assert (tmp_path / ".checkpoints" / "final" / "model.safetensors").is_file()


@pytest.mark.parametrize("args, message", [
    (["--run-config", "config.json", "--set", "training.max_steps=5"], "error: --run-config takes a resolved config"),
    (["--debug", "--set", "training.max_steps=0"], "error: training.max_steps must be positive"),
])
def test_user_errors_are_one_line_and_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    result = run_main(args, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [result.stderr.strip()] and result.stderr.startswith(message)


def test_a_rank_opens_the_token_cache_the_supervisor_found(tmp_path: Path, token_cache_dir: Path) -> None:
    """The supervisor finds the run's token cache before any rank starts and names it to the ranks
    (SUPERVISOR_TOKEN_CACHE): a rank opens it as it is and keys no corpus (a stat per source file, every rank of every
    group): here its config's cache folder, empty, stays untouched and the rank trains on the cache it was given."""
    from trainer.data import TOKEN_CACHE_ENV
    from trainer.data.cache import prepare

    found = prepare(tiny_config(tmp_path / "found", token_cache_dir), show_progress=False)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    config = write_run_config(tmp_path / "run", elsewhere, tmp_path / "ckpt")
    done = subprocess.run([PYTHON, MAIN, "--run-config", str(config)], cwd=config.parent, capture_output=True,
                          text=True, timeout=180, env=rank_env(0, 1, free_port(), **{TOKEN_CACHE_ENV: str(found.path)}))
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"Step [{STEPS - 1}/{STEPS}]" in done.stdout and list(elsewhere.iterdir()) == []
