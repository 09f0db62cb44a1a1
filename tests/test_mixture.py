"""Weighted mixtures (`data.mixture`): the config, one cache per source (nothing rebuilt when a weight changes or a
source is added), shares that follow the weights, the same batches however the ranks split them, a resume that
reproduces the uninterrupted losses bit for bit, and what the log and the history say per source."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from rank_support import history, history_losses, tiny_config
from trainer import loop
from trainer.config import PROJECT_ROOT, Config
from trainer.data.batches import MixtureSampler
from trainer.data.cache import prepare
from trainer.data.mixture import Schedule, read_mixture
from trainer.data.training_data import TrainingData
from trainer.errors import UserError


def code_rows(names: list[str]) -> list[dict[str, str]]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [{"text": (stdlib / name).read_text(encoding="utf-8")} for name in names]


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, float]:
    """Three sources of three formats: the standard library (40 files), a .jsonl.zst, and a tiny Parquet file that
    runs out within a few steps."""
    folder = tmp_path_factory.mktemp("sources")
    rows = code_rows(["json/encoder.py", "json/decoder.py", "csv.py", "heapq.py", "bisect.py", "abc.py"])
    data = "".join(json.dumps(row) + "\n" for row in rows).encode()
    (folder / "code.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(data))
    pq.write_table(pa.Table.from_pylist([{"text": "a tiny source: " + "x y " * 30}]), folder / "tiny.parquet")
    return {"stdlib": 0.5, str(folder / "code.jsonl.zst"): 0.3, str(folder / "tiny.parquet"): 0.2}


def mixture_config(tmp_path: Path, cache_dir: Path, mixture: dict[str, float], **overrides: dict) -> Config:
    data = {"mixture": mixture, **overrides.pop("data", {})}
    return tiny_config(tmp_path, cache_dir, data=data, **overrides)


# ---------------------------------------------------------------------------------------------------------------------
# The config


def test_mixture_from_the_command_line_and_its_refusals(tmp_path: Path) -> None:
    def run(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(PROJECT_ROOT / "prepare_dataset.py"), "--debug", "--print-config",
                               *flags], capture_output=True, text=True, timeout=60)

    shown = run("--set", 'data.mixture={"web/*.parquet": 0.7, "code.jsonl.zst": 3}')
    assert json.loads(shown.stdout)["data"]["mixture"] == {"web/*.parquet": 0.7, "code.jsonl.zst": 3.0}
    for flags, message in [(('data.mixture={"a.jsonl": 0}',), "data.mixture weight of a.jsonl must be a finite "
                                                              "number above 0, got 0"),
                           (('data.mixture={"a.jsonl": "x"}',), "data.mixture['a.jsonl'] expects float"),
                           (("data.mixture={}",), "data.mixture is empty"),
                           (('data.mixture={"a.jsonl": 1e308, "b.jsonl": 1e308}',),
                            ("data.mixture weights add up to more than the largest number (1.79769e+308); only their "
                             "ratios matter")),
                           (('data.mixture={"a.jsonl": 1}', "data.source=b.jsonl"), "are exclusive")]:
        result = run(*[part for flag in flags for part in ("--set", flag)])
        assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert message in result.stderr


# ---------------------------------------------------------------------------------------------------------------------
# The schedule


def test_shares_follow_the_weights_within_one_percent_over_any_100_steps() -> None:
    """4,096-token batches of 256-token windows: 16 samples a step, 1,600 in 100 steps."""
    weights = [0.55, 0.3, 0.1, 0.05]
    schedule = Schedule(weights)
    source, index = schedule.locate(np.arange(300_000))
    share = np.asarray(weights) / sum(weights)
    for start in range(0, len(source) - 1600, 16 * 37):
        counts = np.bincount(source[start:start + 1600], minlength=len(weights))
        assert np.abs(counts / 1600 - share).max() < 0.01
    for i in range(len(weights)):  # each source's samples are its next ones, none skipped or repeated
        assert np.array_equal(index[source == i], np.arange(np.sum(source == i)))
    assert np.array_equal(schedule.counts(300_000), np.bincount(source))


def test_the_batches_do_not_depend_on_how_the_ranks_split_them() -> None:
    rng = np.random.default_rng(0)
    streams = [rng.integers(0, 300, size=n).astype(np.uint16) for n in (5000, 700, 90)]

    def steps(world: int, accum: int, micro: int) -> list[np.ndarray]:
        samplers = [MixtureSampler(streams, [5, 3, 2], 8, micro, accum, world, rank, seed=7) for rank in range(world)]
        return [np.concatenate([s.get_step(step).reshape(-1, 9) for s in samplers]) for step in range(40)]

    two_ranks = steps(2, 1, 3)
    assert all(np.array_equal(a, b) for a, b in zip(two_ranks, steps(1, 2, 3)))
    assert all(np.array_equal(a, b) for a, b in zip(two_ranks, steps(3, 1, 2)))
    assert MixtureSampler(streams, [5, 3, 2], 8, 3, 1, 2, 0, seed=7).epochs(40)[2] > 1  # the small one repeats


# ---------------------------------------------------------------------------------------------------------------------
# Caches


def test_each_source_is_its_own_cache_and_a_weight_or_a_new_source_rebuilds_nothing(
        sources: dict[str, float], tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = prepare(mixture_config(tmp_path, cache, sources), show_progress=False)
    assert first.built and len(first.sources) == 3 and all(s.built for s in first.sources)
    key, recorded = read_mixture(first.path)
    assert key == first.key and [r.source for r in recorded] == list(sources)
    assert [r.key for r in recorded] == [s.key for s in first.sources]
    reweighted = dict(sources, stdlib=2.0)
    second = prepare(mixture_config(tmp_path, cache, reweighted), show_progress=False)
    assert not second.built and second.key != first.key
    assert [s.key for s in second.sources] == [s.key for s in first.sources]
    alone = prepare(tiny_config(tmp_path, cache), show_progress=False)  # the first source alone: the same cache
    assert not alone.built and alone.key == first.sources[0].key
    extra = tmp_path / "extra.jsonl"
    extra.write_text("".join(json.dumps(row) + "\n" for row in code_rows(["textwrap.py"])))
    grown = prepare(mixture_config(tmp_path, cache, {**sources, str(extra): 1.0}), show_progress=False)
    assert [s.built for s in grown.sources] == [False, False, False, True]
    listed = subprocess.run([sys.executable, str(PROJECT_ROOT / "prepare_dataset.py"), "--list", "--set",
                             f"data.cache_dir={json.dumps(str(cache))}"], capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0 and f"mixture {first.key}  3 sources" in listed.stdout
    assert all(s.key in listed.stdout for s in grown.sources)


def test_a_missing_source_of_a_mixture_is_one_line(tmp_path: Path, sources: dict[str, float]) -> None:
    with pytest.raises(UserError, match="data.source .*missing.jsonl does not exist"):
        prepare(mixture_config(tmp_path, tmp_path / "cache", {**sources, str(tmp_path / "missing.jsonl"): 1}),
                show_progress=False)


# ---------------------------------------------------------------------------------------------------------------------
# Training


def test_a_mixture_trains_resumes_bit_identically_and_reports_each_source(
        sources: dict[str, float], tmp_path: Path, token_cache_dir: Path, one_thread: None,
        capsys: pytest.CaptureFixture[str]) -> None:
    every = {"training": {"max_steps": 6, "eval_interval": 3}, "checkpoint": {"interval": 3, "keep": 5},
             "data": {"val_fraction": 0.34}}  # every third document held out: the .jsonl.zst source has 2 of 6
    straight = mixture_config(tmp_path / "straight", token_cache_dir, sources, **every)
    assert loop.train(straight) == 0
    log = capsys.readouterr().out
    expected = history_losses(Path(straight.logging.run_dir))
    resumed = mixture_config(tmp_path / "resumed", token_cache_dir, sources, training=every["training"],
                             data=every["data"],
                             checkpoint={"resume": str(Path(straight.checkpoint.dir) / "step_000003")})
    assert loop.train(resumed) == 0
    got = history_losses(Path(resumed.logging.run_dir))
    assert got.keys() == {3, 4, 5} and all(got[s] == expected[s] for s in got)  # bit-identical on CPU

    tiny = list(sources)[2]
    assert "dataset: mixture" in log and all(f"source {name}: weight" in log for name in sources)
    assert log.count(f"source {tiny} ran out after") == 1
    by_source = log.split("val loss by source ")[1].splitlines()[0]  # the tiny source holds out no document
    assert log.count(f"WARNING | training.eval_interval is 3, but no validation window of 33 tokens fits in source "
                     f"{tiny} (0 validation tokens): the validation leaves it out") == 1
    assert [part.rsplit(" ", 1)[0] for part in by_source.split(" | ")[0].split(", ")] == list(sources)[:2]
    recorded = history(Path(straight.logging.run_dir))["run"]["sources"]
    assert [r["source"] for r in recorded] == list(sources) and [r["weight"] for r in recorded] == [0.5, 0.3, 0.2]
    assert sum(r["tokens_trained"] for r in recorded) == 6 * 4 * 32
    data = TrainingData.open(prepare(straight, show_progress=False).path)
    assert data.mixture and recorded[2]["epochs"] > 1
