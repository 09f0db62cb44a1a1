"""The token cache: keys and hits, the files and manifest, round trips, races, SIGKILLed builds, corruption, bad input.

Corpora stay tiny (a few dozen stdlib files, a 300-token BPE, short contexts) so the whole file runs in seconds.

Length: one test per behaviour of the one cache contract (`trainer.data.cache`), sharing its small fixtures.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from trainer.config import PROJECT_ROOT, Config
from trainer.data import cache as cache_module
from trainer.data import digests as digests_module
from trainer.data.cache import TOKENIZERS_DIR, CacheInfo, TokenCache, cache_root, prepare
from trainer.data.cache_folder import list_caches
from trainer.data.corpus import open_corpus, split_documents
from trainer.data.staging import BUILD_PREFIX, TRASH_PREFIX, process_tag
from trainer.data.token_stream import TokenStream
from trainer.errors import UserError

TINY = {"source": "stdlib", "vocab_size": 300, "context_length": 32, "max_samples": 24, "val_fraction": 0.1}


def make_config(cache_dir: Path, **data: object) -> Config:
    return Config.from_dict({"data": {**TINY, "cache_dir": str(cache_dir), **data}})


def write_config(path: Path, cfg: Config) -> Path:
    path.write_text(json.dumps({"data": cfg.to_dict()["data"]}))
    return path


def leftovers(root: Path) -> list[Path]:
    return [p for parent in (root, root / TOKENIZERS_DIR) if parent.is_dir()
            for p in parent.iterdir() if p.name.startswith((BUILD_PREFIX, TRASH_PREFIX))]


def final_folders(root: Path) -> list[Path]:
    return [e.path for e in list_caches(root)]


def kill_tree(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
        proc.kill()
    proc.wait()


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Config, CacheInfo]:
    cfg = make_config(tmp_path_factory.mktemp("cache"))
    return cfg, prepare(cfg, show_progress=False)


# ---------------------------------------------------------------------------------------------------------------------
# Build, hit, layout


def test_build_writes_the_layout_and_manifest(built: tuple[Config, CacheInfo]) -> None:
    cfg, info = built
    assert info.built and info.path.name == info.key and info.dtype == "uint16" and info.vocab_size == 300
    cache = TokenCache.open(info.path)
    m = cache.manifest
    assert sorted(m["files"]) == ["doc_offsets.npy", "tokenizer.json", "tokenizer_config.json", "tokens.bin",
                                  "val_doc_offsets.npy", "val_tokens.bin"]
    assert set(m["key_material"]) == {"format_version", "source", "tokenizer", "context_length", "max_samples",
                                      "val_fraction"}
    assert m["key_material"]["source"]["kind"] == "stdlib" and m["key_material"]["tokenizer"]["kind"] == "bpe"
    assert m["train"]["documents"] + m["val"]["documents"] == info.documents == 24
    assert m["val"]["documents"] == 2  # every 10th of 24 documents
    assert (info.path / "tokens.bin").stat().st_size == info.tokens * 2 == cache.train.nbytes
    assert isinstance(cache.train, np.memmap) and not cache.train.flags.writeable
    assert cache.train.dtype == np.dtype("<u2") and len(cache.val) == info.val_tokens > 0
    offsets = cache.doc_offsets
    assert offsets[0] == 0 and offsets[-1] == info.tokens and len(offsets) == m["train"]["documents"] + 1
    assert np.all(cache.train[offsets[1:] - 1] == cache.eos_id)  # every document ends with the end-of-document id
    assert (info.path / "manifest.json").stat().st_mtime_ns >= (info.path / "tokens.bin").stat().st_mtime_ns


def test_unchanged_config_is_a_hit_without_tokenizing(built: tuple[Config, CacheInfo],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, info = built

    def no_tokenizing(*args: object, **kwargs: object) -> None:
        raise AssertionError("a cache hit must not tokenize or train")

    monkeypatch.setattr(cache_module, "write_cache", no_tokenizing)
    monkeypatch.setattr(cache_module, "train_bpe", no_tokenizing)
    hit = prepare(cfg, show_progress=False)
    assert not hit.built and hit.key == info.key and hit.tokens == info.tokens
    assert hit.build_seconds == pytest.approx(TokenCache.open(info.path).manifest["build"]["seconds"])


def test_round_trip_decode_with_transformers(built: tuple[Config, CacheInfo]) -> None:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    cfg, info = built
    cache = TokenCache.open(info.path)
    pieces = list(split_documents(open_corpus(cfg.data).pieces(), cfg.data.max_samples, cfg.data.val_fraction))
    fast = PreTrainedTokenizerFast(tokenizer_file=str(cache.tokenizer_path))
    for tokens, offsets, held_out in ((cache.train, cache.doc_offsets, False), (cache.val, cache.val_doc_offsets, True)):
        originals = "".join(text + "\0" * ends for text, ends, held in pieces if held == held_out).split("\0")[:-1]
        decoded = [fast.decode(tokens[a:b - 1].tolist()) for a, b in zip(offsets[:-1], offsets[1:])]
        assert decoded == originals
    auto = AutoTokenizer.from_pretrained(str(cache.path))
    assert auto.eos_token == "<|endoftext|>" and auto.eos_token_id == cache.eos_id


@pytest.mark.parametrize("change", [{"context_length": 64}, {"max_samples": 23}, {"val_fraction": 0.2},
                                    {"vocab_size": 310}])
def test_any_key_input_changes_the_key(built: tuple[Config, CacheInfo], change: dict[str, object]) -> None:
    cfg, info = built
    other = prepare(make_config(Path(cfg.data.cache_dir), **change), show_progress=False)
    assert other.built and other.key != info.key
    assert prepare(cfg, show_progress=False).key == info.key  # the original is still there, still a hit


def test_source_digests_are_remembered_under_each_files_stat(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hit reads no source file whose stat is unchanged; a touched file is re-read (same content, same key); an
    edited one changes the key; an edit that keeps size and mtime is the documented blind spot, and rehash sees it."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    settled = time.time() - 60  # older than the memo's settling time, as a corpus normally is
    for i in range(6):
        (corpus / f"{i}.txt").write_text(f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * 20)
        os.utime(corpus / f"{i}.txt", (settled, settled))
    reads: list[str] = []
    real_digest = digests_module.file_digest
    monkeypatch.setattr(digests_module, "file_digest", lambda path: reads.append(Path(path).name) or real_digest(path))
    cfg = make_config(tmp_path / "cache", source=str(corpus), max_samples=None)

    def launch(**options: bool) -> CacheInfo:
        reads.clear()
        return prepare(cfg, show_progress=False, **options)

    first = launch()
    assert first.built and sorted(reads) == [f"{i}.txt" for i in range(6)]
    hit = launch()
    assert not hit.built and hit.key == first.key and reads == []
    os.utime(corpus / "2.txt", (settled + 5, settled + 5))  # touched
    touched = launch()
    assert not touched.built and touched.key == first.key and reads == ["2.txt"]
    path = corpus / "3.txt"
    path.write_text(path.read_text().replace("quick", "QUICK", 1))  # same size, mtime put back: not seen...
    os.utime(path, (settled, settled))
    assert launch().key == first.key and reads == []
    rehashed = launch(rehash=True)  # ...until the files are read by content
    assert rehashed.built and rehashed.key != first.key and len(reads) == 6
    path.write_text(path.read_text() + " one more sentence")
    os.utime(path, (settled, settled))
    edited = launch()
    assert edited.built and edited.key not in (first.key, rehashed.key) and reads == ["3.txt"]


def test_a_source_that_changes_while_its_cache_builds_is_named_and_nothing_is_kept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A .txt appended to while its cache builds: the tokens would not be the content the key names."""
    source = tmp_path / "corpus.txt"
    source.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    real_write = cache_module.write_cache

    def write_then_append(*args: object) -> None:
        real_write(*args)
        with source.open("a") as f:  # another program still writing the file
            f.write("one more line, appended during the build\n")

    monkeypatch.setattr(cache_module, "write_cache", write_then_append)
    cfg = make_config(tmp_path / "cache", source=str(source), max_samples=None)
    with pytest.raises(UserError, match=f"data.source {source} changed while it was read to build the token cache"):
        prepare(cfg, show_progress=False)
    assert final_folders(tmp_path / "cache") == [] and leftovers(tmp_path / "cache") == []


@pytest.mark.parametrize("when", ["tokenizing", "publishing"])
def test_the_cache_folder_deleted_during_a_build_is_one_line_and_nothing_is_kept(
        built: tuple[Config, CacheInfo], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str) -> None:
    """The cache folder removed while a build writes into it (a clean-up, `rm -rf` of the wrong folder): one line
    saying so, not a FileNotFoundError from the next write or from the rename that publishes, and nothing left."""
    root = tmp_path / "cache"
    real_write = cache_module.write_cache

    def deleting(*args: object) -> None:
        if when == "tokenizing":
            shutil.rmtree(root)
        real_write(*args)
        if when == "publishing":
            shutil.rmtree(root)

    monkeypatch.setattr(cache_module, "write_cache", deleting)
    cfg = make_config(root, tokenizer=str(built[1].path))  # a tokenizer outside the folder that goes
    with pytest.raises(UserError, match=f"^{root} was deleted while the token cache was being built in it; nothing "
                                        f"was kept: run again"):
        prepare(cfg, show_progress=False)
    assert not root.exists() or (final_folders(root) == [] and leftovers(root) == [])


def test_sample_by_cuts_a_txt_file_into_documents_and_enters_the_key(built: tuple[Config, CacheInfo],
                                                                     tmp_path: Path) -> None:
    _, info = built
    stories = ["\n\n".join(f"story {s} paragraph {p}: the fox\njumps over the dog {p} times." for p in range(3))
               for s in range(3)]
    path = tmp_path / "stories.txt"
    path.write_text("\n<|endoftext|>\n".join(stories) + "\n<|endoftext|>\n")
    keys = set()
    for sample_by, documents in (("document", 1), ("paragraph", 7), ("line", 21), ("<|endoftext|>", 3)):
        cfg = make_config(tmp_path / "cache", source=str(path), tokenizer=str(info.path), sample_by=sample_by,
                          max_samples=None, val_fraction=0.0, context_length=8)
        found = prepare(cfg, show_progress=False)
        manifest = TokenCache.open(found.path).manifest
        assert found.documents == documents
        assert manifest["key_material"]["source"]["sample_by"] == sample_by
        assert sample_by in manifest["description"]["source"] or sample_by == "document"
        keys.add(found.key)
    assert len(keys) == 4


def test_sample_by_is_refused_for_a_source_without_txt_files(tmp_path: Path) -> None:
    (tmp_path / "rows.jsonl").write_text('{"text": "a row"}\n')
    with pytest.raises(UserError, match="data.sample_by 'line' applies to .txt files"):
        prepare(make_config(tmp_path / "cache", source=str(tmp_path / "rows.jsonl"), sample_by="line"),
                show_progress=False)


def test_a_hub_source_is_keyed_by_its_resolved_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    from trainer.data import corpus as corpus_module

    texts = [f"hub document {i}: " + "lorem ipsum dolor sit amet " * 30 for i in range(8)]
    monkeypatch.setattr(datasets, "load_dataset",
                        lambda *args, **kwargs: datasets.Dataset.from_dict({"text": texts}).to_iterable_dataset())
    head = {"commit": "aaa"}  # what the hub says the revision points at, as the branch moves on
    monkeypatch.setattr(corpus_module, "resolve_hub_commit", lambda name, revision: head["commit"])
    cfg = make_config(tmp_path / "cache", source="someone/data", max_samples=None, streaming=True)
    first = prepare(cfg, show_progress=False)
    assert first.built and first.documents == 8
    assert TokenCache.open(first.path).manifest["key_material"]["source"]["revision"] == "aaa"
    assert not prepare(cfg, show_progress=False).built
    head["commit"] = "bbb"
    moved = prepare(cfg, show_progress=False)
    assert moved.built and moved.key != first.key


def test_a_local_tokenizer_folder_and_its_content_in_the_key(built: tuple[Config, CacheInfo], tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    cfg, info = built
    folder = tmp_path / "tok"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((info.path / name).read_bytes())
    pretrained = make_config(tmp_path / "cache", tokenizer=str(folder))
    first = prepare(pretrained, show_progress=False)
    assert first.built and first.vocab_size == 300
    assert np.array_equal(TokenCache.open(first.path).train, TokenCache.open(info.path).train)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_tokens(["<|an-extra-token|>"])
    tok.save(str(folder / "tokenizer.json"))
    changed = prepare(pretrained, show_progress=False)
    assert changed.built and changed.key != first.key and changed.vocab_size == 301


def test_a_slow_tokenizer_folder_is_converted(built: tuple[Config, CacheInfo], tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    cfg, info = built
    folder = tmp_path / "gpt2-style"
    folder.mkdir()
    Tokenizer.from_file(str(info.path / "tokenizer.json")).model.save(str(folder))  # vocab.json + merges.txt only
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "GPT2Tokenizer", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}))
    converted = prepare(make_config(tmp_path / "cache", tokenizer=str(folder)), show_progress=False)
    assert np.array_equal(TokenCache.open(converted.path).train, TokenCache.open(info.path).train)


def test_a_relative_cache_dir_is_relative_to_the_project_root(tmp_path: Path) -> None:
    assert cache_root(make_config(Path("cache/datasets")).data) == PROJECT_ROOT / "cache" / "datasets"
    assert cache_root(make_config(tmp_path).data) == tmp_path


def test_ids_widen_to_uint32_when_one_does_not_fit(tmp_path: Path) -> None:
    stream = TokenStream(tmp_path / "t.bin", tmp_path / "o.npy")
    stream.append(np.array([1, 2, 0, 65535, 0, 7], dtype=np.uint32), np.array([3, 5]))
    assert stream.dtype == np.dtype("<u2")
    stream.append(np.array([70000, 5, 0], dtype=np.uint32), np.array([3]))  # the document begun above ends here
    stream.close()
    assert stream.dtype == np.dtype("<u4")
    assert np.fromfile(tmp_path / "t.bin", dtype="<u4").tolist() == [1, 2, 0, 65535, 0, 7, 70000, 5, 0]
    assert np.load(tmp_path / "o.npy").tolist() == [0, 3, 5, 9]


# ---------------------------------------------------------------------------------------------------------------------
# Concurrency and crashes (real processes, real signals)


def cli(config: Path) -> list[str]:
    return [sys.executable, str(PROJECT_ROOT / "prepare_dataset.py"), "--config", str(config)]


def test_three_processes_at_once_build_exactly_once(tmp_path: Path) -> None:
    config = write_config(tmp_path / "cfg.json", make_config(tmp_path / "cache", max_samples=80))
    procs = [subprocess.Popen(cli(config), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(3)]
    try:
        outputs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            kill_tree(p)
    assert [p.returncode for p in procs] == [0, 0, 0], [err for _, err in outputs]
    statuses = [next(line for line in out.splitlines() if line.startswith("status:")) for out, _ in outputs]
    assert sum("built" in s for s in statuses) == 1 and sum("hit" in s for s in statuses) == 2, statuses
    assert len({next(line for line in out.splitlines() if line.startswith("key:")) for out, _ in outputs}) == 1
    assert len(final_folders(tmp_path / "cache")) == 1 and not leftovers(tmp_path / "cache")


def test_a_build_killed_at_random_points_is_never_accepted(tmp_path: Path) -> None:
    sized = {"max_samples": 100, "vocab_size": 400}  # big enough that a kill can land in every phase
    config = write_config(tmp_path / "cfg.json", make_config(tmp_path / "timing", **sized))
    started = time.perf_counter()
    subprocess.run(cli(config), check=True, capture_output=True, timeout=120)
    full = time.perf_counter() - started  # one whole run: start-up, BPE training, tokenizing, publishing
    rng = random.Random(1234)
    # Uniform kill times over a whole run, plus kills timed from the moment each phase's build folder appears.
    plans = [("after", rng.uniform(0.1, 1.0) * full) for _ in range(3)]
    plans += [("tokenizer", rng.uniform(0, 0.05)), ("tokens", rng.uniform(0, 0.05))]
    killed_mid_build = []
    for trial, (trigger, delay) in enumerate(plans):
        root = tmp_path / f"cache{trial}"
        trial_config = write_config(tmp_path / f"cfg{trial}.json", make_config(root, **sized))
        proc = subprocess.Popen(cli(trial_config), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            watch = root / TOKENIZERS_DIR if trigger == "tokenizer" else root
            deadline = time.monotonic() + 60
            while trigger != "after" and proc.poll() is None and time.monotonic() < deadline and not any(
                    p.name.startswith(BUILD_PREFIX) for p in (watch.iterdir() if watch.is_dir() else [])):
                time.sleep(0.002)
            time.sleep(delay)
            proc.send_signal(signal.SIGKILL)
        finally:
            kill_tree(proc)
        for folder in final_folders(root):  # a folder that survived must be complete and intact
            TokenCache.open(folder).verify()
        completed = bool(final_folders(root))
        killed_mid_build.append(bool(leftovers(root)))
        info = prepare(make_config(root, **sized), show_progress=False)
        assert info.built != completed, (trigger, delay)
        assert not leftovers(root), (trigger, delay)
        TokenCache.open(info.path).verify()
    assert any(killed_mid_build), "no kill landed inside a build; the test proves nothing"


def test_leftovers_of_dead_builders_are_removed_and_live_ones_kept(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    cfg = make_config(root)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = root / f"{BUILD_PREFIX}{'0' * 32}-{dead.pid}-{round(time.time() * 1000)}"
    live = root / f"{BUILD_PREFIX}{'1' * 32}-{process_tag()}"
    for folder in (stale, live):
        folder.mkdir(parents=True)
        (folder / "tokens.bin").write_bytes(b"partial")
    prepare(cfg, show_progress=False)
    assert not stale.exists() and live.exists()


# ---------------------------------------------------------------------------------------------------------------------
# Validation and corruption


def copy_of(info: CacheInfo, tmp_path: Path) -> tuple[Config, Path]:
    """A private copy of the shared cache folder, to damage."""
    cfg = make_config(tmp_path / "cache")
    shutil.copytree(Path(info.path).parent, tmp_path / "cache")
    return cfg, tmp_path / "cache" / info.key


def overwrite(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_damaged_tokens_are_caught_by_the_sampled_blocks_the_bound_check_and_verify(built: tuple[Config, CacheInfo],
                                                                                     tmp_path: Path) -> None:
    from trainer.data.batches import BatchSampler

    _, info = built
    cfg, folder = copy_of(info, tmp_path)
    tokens = folder / "tokens.bin"
    sampled = {int(k) for k in TokenCache.open(folder).manifest["files"]["tokens.bin"]["sampled"]}
    assert 0 in sampled and len(sampled) == cache_module.SAMPLED_BLOCKS  # more blocks than samples: some unsampled
    unsampled = next(b * cache_module.SAMPLE_BLOCK for b in range(1, 64) if b * cache_module.SAMPLE_BLOCK not in sampled)
    # In the vocabulary, inside a sampled block: every open (a hit, a rank) refuses it, and prepare rebuilds.
    overwrite(tokens, 100, (7).to_bytes(2, "little") * 8)
    with pytest.raises(UserError, match="tokens.bin does not match the checksums of its sampled blocks"):
        TokenCache.open(folder)
    assert prepare(cfg, show_progress=False).built
    # In the vocabulary, outside the sampled blocks: only --verify sees it.
    overwrite(tokens, unsampled, (7).to_bytes(2, "little") * 8)
    cache = TokenCache.open(folder)
    with pytest.raises(UserError, match="tokens.bin does not match its checksum"):
        cache.verify()
    # Beyond the vocabulary: the batch that holds it is refused, naming the cache and --verify.
    overwrite(tokens, unsampled + 64, (cache.vocab_size + 5).to_bytes(2, "little"))
    sampler = BatchSampler(cache.train, 32, 1024, 1, 1, 0, seed=0, vocab_size=cache.vocab_size, origin=str(folder))
    batches = (sampler.get(step, 0) for step in range(sampler.windows_per_epoch // 1024 + 1))
    with pytest.raises(UserError, match=f"token cache {folder} holds id {cache.vocab_size + 5}.*--verify"):
        for batch in batches:
            sampler.check(batch)


def damage_under_a_run(folder: Path, damage: str, workers: int = 0) -> str:
    """Train-read step 0 of the cache in `folder`, damage its tokens.bin as `damage` says, read step 1: the error line,
    or "" when step 1 was read. In a process of its own, since a regression here is a SIGBUS, which would end pytest."""
    script = f"""
import sys
from trainer.data.batches import BatchSampler, StepLoader
from trainer.data.cache import TokenCache
from trainer.errors import UserError
cache = TokenCache.open({str(folder)!r})
sampler = BatchSampler(cache.train, 32, 4, 1, 1, 0, seed=0, vocab_size=cache.vocab_size, origin={str(folder)!r})
try:
    with StepLoader(sampler, end_step=4, num_workers={workers}) as loader:
        loader.get(0)
        with open(cache.path / "tokens.bin", "r+b") as f:
            if {damage!r} == "zeroed":
                f.write(bytes(len(cache.train) * cache.train.itemsize))
            else:
                f.truncate(100)
        loader.get(1)
except UserError as e:
    print("error:", e, file=sys.stderr)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            cwd=PROJECT_ROOT, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr


@pytest.mark.parametrize("damage", ["zeroed", "truncated"])
def test_a_cache_damaged_under_a_running_job_stops_its_next_read_naming_the_file(
        built: tuple[Config, CacheInfo], tmp_path: Path, damage: str) -> None:
    """Zeroed in place while a run trains on it, the cache would be trained on as zeros to the end; truncated, the
    rank's next read past its new end is a bare SIGBUS. Either way the next read is one line naming the file."""
    _, folder = copy_of(built[1], tmp_path)
    tokens = folder / "tokens.bin"
    how = "rewritten in place" if damage == "zeroed" else f"truncated to 100 of its {tokens.stat().st_size:,} bytes"
    err = damage_under_a_run(folder, damage)
    said = (f"error: token cache file {tokens} was {how} while the run trained on it; rebuild the cache with python "
            f"prepare_dataset.py --force, then resume the run (--resume auto)")
    assert err.splitlines() == [said], err


@pytest.mark.slow
def test_a_cache_truncated_under_a_data_loading_worker_is_the_same_line(built: tuple[Config, CacheInfo],
                                                                        tmp_path: Path) -> None:
    """A worker process reads the windows (training.num_workers): the rank says what happened to the file, not that
    its worker failed."""
    _, folder = copy_of(built[1], tmp_path)
    err = damage_under_a_run(folder, "truncated", workers=1)
    said = f"error: token cache file {folder / 'tokens.bin'} was truncated to 100 "
    assert err.splitlines()[-1].startswith(said), err


@pytest.mark.parametrize("damage", ["truncate", "drop_manifest", "bad_version", "offsets"])
def test_a_damaged_cache_is_refused_and_rebuilt(built: tuple[Config, CacheInfo], tmp_path: Path, damage: str) -> None:
    _, info = built
    cfg, folder = copy_of(info, tmp_path)
    if damage == "truncate":
        with open(folder / "tokens.bin", "r+b") as f:
            f.truncate(100)
    elif damage == "drop_manifest":
        (folder / "manifest.json").unlink()
    elif damage == "bad_version":
        manifest = json.loads((folder / "manifest.json").read_text())
        manifest["format_version"] = 0
        (folder / "manifest.json").write_text(json.dumps(manifest))
    else:
        offsets = np.load(folder / "doc_offsets.npy")
        offsets[-1] += 1
        np.save(folder / "doc_offsets.npy", offsets)
    with pytest.raises(UserError):
        TokenCache.open(folder)
    rebuilt = prepare(cfg, show_progress=False)
    assert rebuilt.built and rebuilt.key == info.key and not leftovers(tmp_path / "cache")
    TokenCache.open(rebuilt.path).verify()


def test_force_rebuilds_in_place(built: tuple[Config, CacheInfo], tmp_path: Path) -> None:
    _, info = built
    cfg, folder = copy_of(info, tmp_path)
    again = prepare(cfg, force=True, show_progress=False)
    assert again.built and again.path == folder and not leftovers(tmp_path / "cache")
    assert np.array_equal(TokenCache.open(folder).train, TokenCache.open(info.path).train)


# ---------------------------------------------------------------------------------------------------------------------
# Bad input: one clear error, no partial cache


def assert_nothing_left(root: Path) -> None:
    assert not final_folders(root) and not leftovers(root)


def test_empty_corpus(tmp_path: Path) -> None:
    (tmp_path / "corpus").mkdir()
    for name in ("a.txt", "b.txt"):
        (tmp_path / "corpus" / name).write_text("")
    with pytest.raises(UserError, match="holds no documents"):
        prepare(make_config(tmp_path / "cache", source=str(tmp_path / "corpus")), show_progress=False)
    assert_nothing_left(tmp_path / "cache")


def test_corpus_shorter_than_one_context_window(tmp_path: Path) -> None:
    (tmp_path / "tiny.txt").write_text("hello world")
    with pytest.raises(UserError, match="fewer than one context window"):
        prepare(make_config(tmp_path / "cache", source=str(tmp_path / "tiny.txt"), context_length=512),
                show_progress=False)
    assert_nothing_left(tmp_path / "cache")


def test_unknown_tokenizer_path(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="does not exist"):
        prepare(make_config(tmp_path / "cache", tokenizer=str(tmp_path / "no-such-tokenizer")), show_progress=False)
    assert_nothing_left(tmp_path / "cache")


def test_vocabulary_larger_than_uint32(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="data.vocab_size must be at most 4,294,967,296"):
        make_config(tmp_path / "cache", vocab_size=2**32 + 1)  # the config's bound, before any work
    cfg = make_config(tmp_path / "cache")
    cfg.data.vocab_size = 2**32 + 1  # past the config's check: the tokenizer's own, as for a hub tokenizer's size
    with pytest.raises(UserError, match="does not fit 32-bit token ids"):
        prepare(cfg, show_progress=False)
    assert_nothing_left(tmp_path / "cache")


def test_unwritable_cache_folder(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("not a folder")
    with pytest.raises(UserError, match="not writable"):
        prepare(make_config(tmp_path / "a-file" / "cache"), show_progress=False)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through any permission bits")
def test_read_only_cache_folder(tmp_path: Path) -> None:
    (tmp_path / "ro").mkdir(mode=0o555)
    with pytest.raises(UserError, match="not writable"):
        prepare(make_config(tmp_path / "ro"), show_progress=False)


def test_disk_full_while_writing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(self: TokenStream, ids: np.ndarray, lengths: np.ndarray) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(TokenStream, "append", full)
    root = tmp_path / "cache"
    with pytest.raises(UserError, match="no space left on the device"):
        prepare(make_config(root), show_progress=False)
    assert not final_folders(root) and not leftovers(root)


def test_the_hit_path_imports_no_heavy_library(built: tuple[Config, CacheInfo], tmp_path: Path) -> None:
    cfg, info = built
    config = write_config(tmp_path / "cfg.json", cfg)
    code = (
        "import json, sys\n"
        "from trainer.config import Config\n"
        "from trainer.data.cache import prepare\n"
        f"info = prepare(Config.from_dict(json.load(open({str(config)!r}))), show_progress=False)\n"
        "heavy = [m for m in ('torch', 'transformers', 'datasets', 'tokenizers', 'rich') if m in sys.modules]\n"
        "print(json.dumps({'built': info.built, 'heavy': heavy}))\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=PROJECT_ROOT, capture_output=True, text=True,
                            timeout=60, check=True)
    assert json.loads(result.stdout) == {"built": False, "heavy": []}
