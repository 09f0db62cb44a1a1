"""Shared helpers for the training rank's tests: a tiny config, a token cache shared by the session, rank processes.

Everything trains a ~30k-parameter Llama on 40 standard-library files tokenized with a 300-token BPE, one thread per
rank (two ranks share the machine's cores; more threads would only spin against each other).
"""

from __future__ import annotations

import copy
import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import pytest

from rank_scripts.harness import project_pythonpath
from trainer.config import Config
from trainer.errors import exit_without_teardown

ROOT = Path(__file__).resolve().parent.parent
MAIN = str(ROOT / "pretrain_main.py")
PYTHON = sys.executable

TINY: dict[str, dict[str, Any]] = {
    "system": {"device": "cpu", "dist_timeout_s": 120.0},
    "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 4, "num_kv_heads": 2, "ffn_hidden_size": 64,
              "max_position_embeddings": 64},
    "data": {"source": "stdlib", "tokenizer": "bpe", "vocab_size": 300, "context_length": 32, "max_samples": 40,
             "val_fraction": 0.05},
    "training": {"max_steps": 6, "batch_size": 4, "grad_accum_nums": 1, "learning_rate": 1e-3, "warmup_steps": 1,
                 "use_amp": False, "precision": "fp32", "strategy": "ddp", "eval_interval": 0, "eval_steps": 2},
    "checkpoint": {"interval": 0, "keep": 2, "save_final": False},
    "logging": {"level": "INFO", "log_interval": 1, "tensorboard": False, "plot": False},
    "debug": {"nan_localize": False, "nan_dump": False},
}

# The log line contract: <LEVEL> | [GPU <id>] Step [<step>/<total>] | Loss: <4 dp> | LR: <.2e> | Grad Norm: <4 dp> |
# ETA: <h:mm:ss>
LOG_LINE = re.compile(r"^(?P<level>[A-Z]+) \| \[GPU (?P<gpu>\S+)\] Step \[(?P<step>\d+)/(?P<total>\d+)\] \| "
                      r"Loss: (?P<loss>-?\d+\.\d{4}|nan) \| LR: (?P<lr>\d\.\d\de[+-]\d\d) \| "
                      r"Grad Norm: (?P<norm>\d+\.\d{4}|nan|inf) \| ETA: (?P<eta>\d+:\d\d:\d\d)$")


def merged(base: dict[str, Any], overrides: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for section, values in overrides.items():
        out.setdefault(section, {}).update(values)
    return out


def tiny_dict(tmp_path: Path, cache_dir: Path, **overrides: dict[str, Any]) -> dict[str, Any]:
    """The tiny run as a config layer; checkpoints and the run folder inside `tmp_path`."""
    paths = {"data": {"cache_dir": str(cache_dir)}, "checkpoint": {"dir": str(tmp_path / "ckpt")},
             "logging": {"run_dir": str(tmp_path / "run")}}
    return merged(merged(TINY, paths), overrides)


def tiny_config(tmp_path: Path, cache_dir: Path, **overrides: dict[str, Any]) -> Config:
    cfg = Config.from_dict(tiny_dict(tmp_path, cache_dir, **overrides))
    cfg.preset = "debug"
    return cfg


def set_flags(layer: dict[str, dict[str, Any]]) -> list[str]:
    """A config layer as `--set section.key=<json>` flags (for runs started by hand)."""
    flags = []
    for section, values in layer.items():
        for key, value in values.items():
            flags += ["--set", f"{section}.{key}={json.dumps(value)}"]
    return flags


@pytest.fixture(scope="session")
def token_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache folder for the whole session: the content-keyed cache builds the tiny corpus once."""
    return tmp_path_factory.getbasetemp() / "token-cache"


@pytest.fixture
def one_thread() -> Iterator[None]:
    """In-process training on one intra-op thread, as each rank process gets (OMP_NUM_THREADS=1)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SPAWNED_WORLD = 2  # the ranks spawn_ranks starts


def spawn_ranks(worker: Callable[[int, Path, Path, Path], None], folder: Path, cache_dir: Path) -> None:
    """`worker(rank, folder, cache_dir, tokenizer)` in each of two processes (torch.multiprocessing) that make a gloo
    group once they call `init_distributed`: the rank's environment variables are set, torch has one thread. A failed
    assertion in either fails the caller with that rank's traceback."""
    import torch.multiprocessing as mp

    from trainer.data.cache import prepare

    cache = prepare(tiny_config(folder, cache_dir), show_progress=False)
    mp.spawn(spawned_rank, args=(worker, free_port(), str(folder), str(cache_dir), str(cache.path / "tokenizer.json")),
             nprocs=SPAWNED_WORLD, join=True)


def spawned_rank(rank: int, worker: Callable[[int, Path, Path, Path], None], port: int, folder: str, cache_dir: str,
                 tokenizer: str) -> None:
    import torch

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(SPAWNED_WORLD), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    worker(rank, Path(folder), Path(cache_dir), Path(tokenizer))
    # as the entry points end: no interpreter finalisation, whose C++ destructors can abort a rank that has finished
    # (std::terminate, exit 134: seen once in twenty runs of a compiled rank); a failure above is raised as ever
    exit_without_teardown(0)


def save_full_params(model: Any, rank: int, path: Path) -> None:
    """A sharded model's parameters, gathered (a collective: every rank calls it) and saved by rank 0."""
    import torch

    params = torch.cat([p.full_tensor().detach().flatten() for p in model.parameters()])
    if rank == 0:
        torch.save(params, path)


def assert_final_model_holds(final: Path, params: Path) -> Any:
    """The `final/` folder loads with transformers and holds exactly the parameters `save_full_params` saved."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(final)  # the inner model's names, every weight
    expected = torch.load(params, weights_only=True)
    assert torch.equal(torch.cat([p.detach().flatten() for p in model.parameters()]), expected)
    return model


def base_env(**extra: str) -> dict[str, str]:
    """The environment of a rank process: no torchrun variables inherited, one thread, unbuffered output."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                        "GPU_RANK", "SUPERVISOR_PROGRESS_FD")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=project_pythonpath(), **extra)
    return env


def rank_env(rank: int, world_size: int, port: int, **extra: str) -> dict[str, str]:
    """torchrun's contract, as the supervisor provides it to a CPU rank."""
    return base_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                    LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **extra)


def kill_tree(proc: subprocess.Popen) -> None:
    """Kill a process and everything it started (used in `finally`, so no test leaves processes behind)."""
    try:
        parent = psutil.Process(proc.pid)
        family = parent.children(recursive=True) + [parent]
    except psutil.NoSuchProcess:
        family = []
    for p in family:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(family, timeout=10)
    proc.wait(timeout=10)


@contextmanager
def kill_on_exit(*procs: subprocess.Popen) -> Iterator[None]:
    try:
        yield
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_tree(proc)


def run_main(args: list[str], cwd: Path, timeout: float = 120, env: dict[str, str] | None = None
             ) -> subprocess.CompletedProcess:
    """`python pretrain_main.py ARGS` to completion, as a run started by hand."""
    proc = subprocess.Popen([PYTHON, MAIN, *args], cwd=cwd, env=env or base_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    with kill_on_exit(proc):
        out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def log_lines(text: str) -> list[re.Match]:
    return [m for m in map(LOG_LINE.match, text.splitlines()) if m]


def history(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "training_history.json").read_text())


def history_losses(run_dir: Path) -> dict[int, float]:
    """Step → loss averaged over ranks, from rank 0's training_history.json."""
    return {r["step"]: r["loss"] for r in history(run_dir)["steps"]}


def checkpoint_content(path: Path) -> dict[str, Any]:
    """A step checkpoint's state.pt, with the model and optimizer read from its dcp/ where it keeps them there (a
    sharded or split one, trainer.checkpoint.store) without a process group: every tensor it holds, as one dict."""
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    content = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
    if (path / "dcp").is_dir():
        with tempfile.TemporaryDirectory() as scratch:
            dcp_to_torch_save(path / "dcp", Path(scratch) / "whole.pt")
            content.update(torch.load(Path(scratch) / "whole.pt", map_location="cpu", weights_only=True))
    return content
