"""The data pipeline against hostile input, as a user meets it through prepare_dataset.py (and, for validation, a
training run): a read-only shared cache, text that is no Unicode, paths longer than the OS allows, a mixture that
names one corpus twice or gives a source no sample, an empty --remove, validation asked of a corpus without any.

Bad input is one `error:` line and exit 2, with nothing left behind; a read-only cache still serves its hits.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rank_support import tiny_config
from trainer import loop
from trainer.config import PROJECT_ROOT

SCRIPT = str(PROJECT_ROOT / "prepare_dataset.py")
TINY = {"source": "stdlib", "vocab_size": 300, "context_length": 32, "max_samples": 20, "val_fraction": 0.1}
PARAGRAPH = "hello world this is a test sentence. " * 20 + "\n\n"


def run(*args: str, wrap: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """prepare_dataset.py with `args`, started through `wrap` (a command that runs the rest) if given."""
    return subprocess.run([*wrap, sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=120,
                          cwd=PROJECT_ROOT)


def config_file(folder: Path, **data: object) -> str:
    path = folder / f"cfg-{len(list(folder.glob('cfg-*')))}.json"
    path.write_text(json.dumps({"data": {**TINY, "cache_dir": str(folder / "cache"), **data}}))
    return str(path)


def assert_one_line_error(result: subprocess.CompletedProcess[str], *needles: str) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[-1].startswith("error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# ---------------------------------------------------------------------------------------------------------------------
# A read-only cache folder


def read_only(folder: Path) -> tuple[str, ...]:
    """A command prefix: the rest runs with `folder` read-only (bound onto itself and remounted read-only in a mount
    namespace of its own, so the file system answers EROFS to any write, root's included, and nothing stays mounted
    once it ends)."""
    return ("unshare", "--mount", "--map-root-user", "sh", "-c",
            'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"', str(folder))


def test_a_read_only_cache_folder_serves_hits_and_verify_and_refuses_a_build_in_one_line(tmp_path: Path) -> None:
    config = config_file(tmp_path)
    built = run("--config", config, "--quiet")
    assert built.returncode == 0, built.stderr
    cache = tmp_path / "cache"
    (cache / ".file-digests.json").unlink()  # the hit learns every digest again and would remember them
    probe = subprocess.run([*read_only(cache), "sh", "-c", f"! touch {cache / 'probe'}"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a folder read-only in a mount namespace here ({probe.stderr.decode().strip()})")

    hit = run("--config", config, wrap=read_only(cache))
    assert hit.returncode == 0 and "status:     hit" in hit.stdout and not hit.stderr, hit.stderr
    verified = run("--config", config, "--verify", wrap=read_only(cache))
    assert verified.returncode == 0 and "verify:     ok" in verified.stdout, verified.stderr
    assert_one_line_error(run("--config", config_file(tmp_path, context_length=48), wrap=read_only(cache)),
                          f"the cache folder {cache} is not writable (Read-only file system)", "data.cache_dir")
    assert not (cache / ".file-digests.json").exists()  # the memo is only a shortcut: left unwritten

    (tmp_path / "small.txt").write_text(PARAGRAPH * 50)
    mixture = config_file(tmp_path, mixture={"stdlib": 1, str(tmp_path / "small.txt"): 1})
    assert run("--config", mixture, "--quiet").returncode == 0
    shutil.rmtree(cache / "mixtures")  # every source's cache is there, the mixture's record is not
    assert_one_line_error(run("--config", mixture, wrap=read_only(cache)), "is not writable (Read-only file system)")


# ---------------------------------------------------------------------------------------------------------------------
# Text that is no Unicode


@pytest.mark.parametrize("row", [b'{"text": "bad \\ud800 surrogate lorem"}', b'{"text": "raw \xed\xa0\x80 bytes"}'],
                         ids=["escaped", "raw-bytes"])
def test_an_unpaired_surrogate_is_one_line_naming_the_row_for_a_trained_and_a_pretrained_tokenizer(
        tmp_path: Path, row: bytes) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_bytes(b'{"text": "fine words"}\n' * 10 + row + b"\n")
    trained = run("--config", config_file(tmp_path, source=str(rows)), "--quiet")
    assert_one_line_error(trained, f"{rows}, line 11: field 'text' holds an unpaired surrogate (\\ud800")
    tokenizer = next((tmp_path / "cache" / "tokenizers").iterdir(), None)
    assert tokenizer is None  # the failed training kept nothing: build one on a good corpus to encode with
    assert run("--config", config_file(tmp_path), "--quiet").returncode == 0
    tokenizer = next((tmp_path / "cache" / "tokenizers").iterdir())
    pretrained = run("--config", config_file(tmp_path, source=str(rows), tokenizer=str(tokenizer)), "--quiet")
    assert_one_line_error(pretrained, f"{rows}, line 11: field 'text' holds an unpaired surrogate")


def test_a_parquet_string_that_is_not_utf8_is_one_line(tmp_path: Path) -> None:
    value = b"bad \xed\xa0\x80 x"  # pyarrow writes a string column's bytes without checking them
    column = pa.StringArray.from_buffers(3, pa.py_buffer(np.arange(4, dtype=np.int32) * len(value)),
                                         pa.py_buffer(value * 3))
    pq.write_table(pa.table({"text": column}), tmp_path / "bad.parquet")
    assert_one_line_error(run("--config", config_file(tmp_path, source=str(tmp_path / "bad.parquet")), "--quiet"),
                          "bad.parquet: column 'text' holds a value that is not UTF-8 text (byte 4")


# ---------------------------------------------------------------------------------------------------------------------
# Paths longer than the OS allows


def test_a_name_longer_than_the_file_system_allows_is_one_line_naming_the_setting(tmp_path: Path) -> None:
    (tmp_path / "small.txt").write_text(PARAGRAPH * 50)
    long_name = tmp_path / ("a" * 300)
    assert_one_line_error(run("--config", config_file(tmp_path, source=str(tmp_path / "small.txt"),
                                                      cache_dir=str(long_name))),
                          f"data.cache_dir {long_name} cannot be used (File name too long)",
                          "set data.cache_dir to a shorter path")
    assert_one_line_error(run("--config", config_file(tmp_path, source=f"{long_name}.txt")),
                          f"data.source {long_name}.txt cannot be used (File name too long)")
    preflight = subprocess.run([sys.executable, "-m", "supervisor", "--debug", "--dry-run", "--set",
                                f"data.source={long_name}.txt"], capture_output=True, text=True, timeout=120,
                               cwd=PROJECT_ROOT)  # the supervisor opens the sources before anything else
    assert_one_line_error(preflight, f"data.source {long_name}.txt cannot be used (File name too long)")
    assert run("--config", config_file(tmp_path, cache_dir=str(long_name)), "--remove", "ab").returncode == 2
    assert not (tmp_path / "cache").exists()


def test_a_cache_folder_too_long_for_the_files_built_in_it_is_refused_before_any_folder_is_made(
        tmp_path: Path) -> None:
    """About 4,040 bytes: the folder itself could be made, the build's folders below it could not."""
    (tmp_path / "small.txt").write_text(PARAGRAPH * 50)
    deep = tmp_path / "long"
    while len(str(deep)) < 4040 - 200:
        deep /= "b" * 200
    deep /= "b" * (4040 - len(str(deep)) - 1)
    assert_one_line_error(run("--config", config_file(tmp_path, source=str(tmp_path / "small.txt"),
                                                      cache_dir=str(deep))),
                          "is a path of 4,040 bytes", "set data.cache_dir to a shorter path")
    assert not (tmp_path / "long").exists()


# ---------------------------------------------------------------------------------------------------------------------
# Mixtures


def test_a_mixture_naming_one_corpus_twice_is_refused_naming_both(tmp_path: Path) -> None:
    (tmp_path / "small.txt").write_text(PARAGRAPH * 50)
    (tmp_path / "c").mkdir()
    first, second = str(tmp_path / "small.txt"), f"{tmp_path}/./small.txt"
    mixture = {first: 1, second: 1, f"{tmp_path}/c/../small.txt": 1}
    assert_one_line_error(run("--config", config_file(tmp_path, mixture=mixture)),
                          f"data.mixture lists '{first}' and '{second}', which are the same files")


def test_a_mixture_weight_too_small_for_a_sample_is_refused_naming_the_smallest_that_gets_one(tmp_path: Path) -> None:
    (tmp_path / "small.txt").write_text(PARAGRAPH * 50)
    (tmp_path / "other.txt").write_text(PARAGRAPH.replace("hello", "other") * 50)
    other = str(tmp_path / "other.txt")

    def prepared(weight: float) -> subprocess.CompletedProcess[str]:
        return run("--config", config_file(tmp_path, mixture={str(tmp_path / "small.txt"): 1, other: weight}),
                   "--quiet")

    assert_one_line_error(prepared(1e-320), f"data.mixture weight 9.99989e-321 of {other} is too small",
                          "give it at least 7.63e-06")
    assert prepared(7.63e-06).returncode == 0  # the weight named is enough


# ---------------------------------------------------------------------------------------------------------------------
# Flags, and validation asked of a corpus without any


@pytest.mark.parametrize("key", ["", " "])
def test_an_empty_remove_key_is_refused(tmp_path: Path, key: str) -> None:
    assert_one_line_error(run("--config", config_file(tmp_path), "--remove", key), "--remove needs a cache key")
    assert not (tmp_path / "cache").exists()  # not taken for a build of the default cache


def test_validation_asked_of_a_corpus_without_any_is_a_warning(tmp_path: Path, one_thread: None,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "one.txt").write_text(PARAGRAPH * 20)  # one document: nothing to hold out
    cfg = tiny_config(tmp_path, tmp_path / "cache", data={"source": str(tmp_path / "one.txt")},
                      training={"max_steps": 2, "eval_interval": 1})
    assert loop.train(cfg) == 0
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1 and "training.eval_interval is 1, but no validation window of 33 tokens fits in the " \
                                  "corpus (0 validation tokens): validation is off" in warnings[0], warnings
