"""Weights & Biases, offline, through the real supervisor and trainer: rank 0 writes a W&B run into the run folder
holding the resolved config and the same scalars as the history (and TensorBoard).

The offline run file (``run-<id>.wandb``) is read back with wandb's own record schema (``wandb_internal_pb2.Record``);
its framing is LevelDB's log format behind a 7-byte W&B header (wandb's Go core writes it; the Python package no longer
ships a reader), unpacked by `records` below.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rank_support import TINY, base_env, history, kill_on_exit, merged, set_flags

wandb = pytest.importorskip("wandb", reason="wandb is an optional extra: pip install -e '.[wandb]'")
from wandb.proto import wandb_internal_pb2  # noqa: E402

HEADER = 7  # b":W&B", a 2-byte magic, a version byte
BLOCK = 32 * 1024  # LevelDB log blocks; a chunk: crc32 (4), length (2, little-endian), type (1), data
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[Any]:
    """Every record of an offline W&B run file, decoded."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a W&B run file"
    out, pending, pos = [], b"", HEADER
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # the block's tail is padding
            pos += BLOCK - pos % BLOCK
            continue
        length, kind = struct.unpack_from("<HB", data, pos + 4)
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0 and length == 0:
            continue
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
    return out


def test_offline_run_logs_the_history_scalars_and_the_config(tmp_path: Path, token_cache_dir: Path) -> None:
    layer = merged(TINY, {"data": {"cache_dir": str(token_cache_dir)}, "checkpoint": {"dir": str(tmp_path / "ckpt")},
                          "training": {"max_steps": 4, "eval_interval": 2},
                          "logging": {"wandb": True, "wandb_project": "trial", "wandb_run_name": "first"}})
    env = base_env()
    env.pop("WANDB_MODE", None)  # unset: the run is offline, which is the documented default
    cmd = [sys.executable, "-m", "supervisor", "--debug", "--nproc", "2", "--no-footer", "--log-dir",
           str(tmp_path / "logs"), *set_flags(layer)]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    with kill_on_exit(proc):
        out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out[-4000:]
    assert "supervisor: W&B: project 'trial', run first, offline (WANDB_MODE unset" in out

    (run_dir,) = (tmp_path / "logs").iterdir()
    (run_file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    got = records(run_file)
    (run,) = [r.run for r in got if r.WhichOneof("record_type") == "run"]
    assert (run.project, run.display_name) == ("trial", "first")

    config = {item.key: json.loads(item.value_json) for item in run.config.update if item.key != "_wandb"}
    assert config == json.loads((run_dir / "config.json").read_text())  # the resolved config, every key

    logged: dict[int, dict[str, float]] = {}
    for r in got:
        if r.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
            logged[items["_step"]] = {k: v for k, v in items.items() if not k.startswith("_")}
    expected = {s["step"]: {f"train/{k}": v for k, v in s.items() if k not in ("step", "val_loss") and v is not None}
                | ({"val/loss": s["val_loss"]} if s["val_loss"] is not None else {})
                for s in history(run_dir)["steps"]}
    assert logged.keys() == expected.keys() == {0, 1, 2, 3}
    for step, scalars in expected.items():
        assert logged[step] == pytest.approx(scalars), step
    assert "val/loss" in logged[1] and "train/loss" in logged[3]
    exits = [r.exit for r in got if r.WhichOneof("record_type") == "exit"]
    assert exits and exits[0].exit_code == 0
