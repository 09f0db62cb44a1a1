"""The token cache: tokenize a corpus once under a content key, then let every rank memory-map it read-only.

`<cache_dir>/<key>/` holds
    tokens.bin            training ids, flat little-endian, each document followed by the end-of-document token;
                          uint16 while every id fits, widened to uint32 the moment one does not (checked per batch)
    doc_offsets.npy       int64 start of every training document, plus the end (documents + 1 entries)
    val_tokens.bin        the held-out documents, same layout (every 1/val_fraction-th document; may be empty)
    val_doc_offsets.npy
    tokenizer.json        + tokenizer_config.json: loadable with PreTrainedTokenizerFast or AutoTokenizer
    manifest.json         written last: format version, dtype, counts, byte sizes, blake2b checksums (of each whole
                          file, and of a few sampled blocks of it), key material, the build's time and peak RSS

The key is a digest of canonical JSON of everything the tokens depend on: the source's content (hashed by content; a
file's digest is remembered under its stat, `trainer.data.digests`, so a hit reads no source file that did not
change), how a .txt file becomes documents, the tokenizer's content, the context length, the sample cap, the
validation fraction and the format version.

What each check of a finished cache covers:
  - opening it (every hit, every rank): the manifest against the folder (key, version, dtype, file sizes, the first and
    last document offsets) and the blake2b of up to `SAMPLED_BLOCKS` blocks of `SAMPLE_BLOCK` bytes spread over each
    file (all of a small file): truncation, a replaced, zeroed or rewritten file. A few changed bytes elsewhere pass;
  - training (`BatchSampler.check`): every batch's ids against the vocabulary, vectorised: damage that would index
    past the embedding is a clear error naming the cache instead of an IndexError or a device-side assert;
  - training, before every read (`MappedFile`, in the rank and in its data-loading workers): the mapped file's size and
    modification time against those it had when the run mapped it: a file truncated or rewritten in place under a
    running job is one line naming it, instead of a bare SIGBUS or zeros trained on to the end;
  - `prepare_dataset.py --verify`: every byte of every file against its checksum.

Build protocol, safe against races and against a builder killed at any instant:
  1. compute the key (hashing only; no tokenizing) and try to open `<key>/`: a final folder only ever appears complete,
     by rename, so a valid one is a hit without taking any lock;
  2. otherwise take `.locks/<key>.lock` (filelock; the OS drops it when its holder dies) and look again: another process
     may have finished meanwhile, and then this one reuses its work;
  3. build into `.build-<key>-<pid>-<start time>/`, fsync every file, write manifest.json last, rename into place.
A killed builder leaves only its `.build-…` folder; the next run sees its process is gone (psutil, start time against
pid reuse) and deletes it (`trainer.data.staging`). The hit path imports neither torch, transformers, datasets nor rich.

Length: the key, the build and the open share the manifest's format and the cache's file names, one contract kept
in one file; the pieces that stand alone (corpus, tokenizer, token stream, staging, digests) are beside it.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
import weakref
from contextlib import closing
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from trainer import durable
from trainer.config import PROJECT_ROOT, Config, DataConfig
from trainer.data.build_progress import BuildProgress, peak_rss_bytes
from trainer.data.corpus import Corpus, open_corpus, split_documents, training_pieces
from trainer.data.digests import DigestMemo, digest, file_digest
from trainer.data.mixture import MixtureSource, mixture_key, refuse_repeats, refuse_unsampled, write_mixture
from trainer.data.paths import Setting, path_errors_named
from trainer.data.staging import build_lock, ensure_writable, publish, remove_dead_leftovers, staging
from trainer.data.token_stream import BATCH_CHARS, DTYPES, TokenStream, encode_pipelined, piece_batches
from trainer.data.tokenizer import (
    BPE,
    TokenizerSpec,
    bpe_recipe,
    check_vocab_size,
    eos_id_of,
    eos_token_of,
    export,
    load_fast,
    locate_pretrained,
    tokenizer_digest,
    train_bpe,
)
from trainer.errors import UserError

FORMAT_VERSION = 2  # bump when the layout or the preprocessing changes: every key changes with it
TOKENS_FILE = "tokens.bin"
OFFSETS_FILE = "doc_offsets.npy"
VAL_TOKENS_FILE = "val_tokens.bin"
VAL_OFFSETS_FILE = "val_doc_offsets.npy"
MANIFEST_FILE = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_META_FILE = "meta.json"
TOKENIZERS_DIR = "tokenizers"  # trained BPEs, one folder per recipe key, beside the token caches
SAMPLE_BLOCK = 1 << 16  # bytes per sampled block, checked on every open
SAMPLED_BLOCKS = 8  # per file: first, last and evenly between (every block of a file of up to 8 blocks)


# ---------------------------------------------------------------------------------------------------------------------
# What prepare() returns and what a rank opens


@dataclass
class CacheInfo:
    """The outcome of `prepare`. `documents` counts both splits; `tokens` is the training split and `val_tokens` the
    held-out one. `build_seconds` is this build's wall time, or on a hit (`built` False) the original build's;
    `peak_rss_bytes` the building process's peak resident memory. For a mixture (`data.mixture`), `path` is its record
    (`trainer.data.mixture`), the counts are the sums over `sources`, each source's own `CacheInfo` in the mixture's
    order."""

    key: str
    path: Path
    documents: int
    tokens: int
    val_tokens: int
    dtype: str
    vocab_size: int
    built: bool
    build_seconds: float
    peak_rss_bytes: int
    sources: list["CacheInfo"] = field(default_factory=list)


@dataclass
class TokenCache:
    """An opened cache: read-only memory maps, so every rank on a host shares one page-cache copy of the corpus."""

    key: str
    path: Path
    manifest: dict[str, Any]
    train: np.ndarray
    val: np.ndarray
    tokenizer_path: Path
    vocab_size: int
    eos_id: int

    @classmethod
    def open(cls, path: Path) -> "TokenCache":
        """Validate the manifest against the files (version, dtype, sizes, offsets, sampled blocks; a bounded read
        whatever the cache's size), then map the tokens."""
        path = Path(path)
        manifest = read_manifest(path)
        problem = manifest_problem(path, manifest)
        if problem:
            raise UserError(f"token cache {path} is invalid ({problem}); rebuild it with prepare_dataset.py --force")
        dtype = DTYPES[manifest["dtype"]]
        return cls(key=manifest["key"], path=path, manifest=manifest,
                   train=map_tokens(path / TOKENS_FILE, dtype, manifest["train"]["tokens"]),
                   val=map_tokens(path / VAL_TOKENS_FILE, dtype, manifest["val"]["tokens"]),
                   tokenizer_path=path / TOKENIZER_FILE, vocab_size=manifest["vocab_size"], eos_id=manifest["eos_id"])

    @property
    def doc_offsets(self) -> np.ndarray:
        return np.load(self.path / OFFSETS_FILE, mmap_mode="r")

    @property
    def val_doc_offsets(self) -> np.ndarray:
        return np.load(self.path / VAL_OFFSETS_FILE, mmap_mode="r")

    def verify(self) -> None:
        """Re-hash every file against the manifest's checksums (reads the whole cache; `open` does not)."""
        for name, expected in self.manifest["files"].items():
            if file_digest(self.path / name) != expected["blake2b"]:
                raise UserError(f"token cache {self.path} is corrupt: {name} does not match its checksum; "
                                f"rebuild it with prepare_dataset.py --force")


def read_manifest(path: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text())
    except FileNotFoundError:
        raise UserError(f"no token cache at {path} (no {MANIFEST_FILE}); build it with prepare_dataset.py") from None
    except (OSError, ValueError) as e:
        raise UserError(f"token cache {path} has an unreadable {MANIFEST_FILE} ({e}); rebuild it with "
                        f"prepare_dataset.py --force") from None
    if not isinstance(manifest, dict):
        raise UserError(f"token cache {path} has a malformed {MANIFEST_FILE}; rebuild it with prepare_dataset.py --force")
    return manifest


def manifest_problem(path: Path, manifest: dict[str, Any]) -> str | None:
    """Why the folder does not match its manifest, or None. Stats, two offsets and at most `SAMPLED_BLOCKS` blocks of
    each file are read: the same cost for any cache size."""
    try:
        if manifest.get("format_version") != FORMAT_VERSION:
            return f"format version {manifest.get('format_version')}, this code reads {FORMAT_VERSION}"
        if manifest["key"] != path.name or digest(manifest["key_material"]) != manifest["key"]:
            return "the key does not match the folder or its key material"
        if manifest["dtype"] not in DTYPES:
            return f"unknown dtype {manifest['dtype']!r}"
        for name, meta in manifest["files"].items():
            size = (path / name).stat().st_size if (path / name).is_file() else None
            if size != meta["bytes"]:
                return f"{name} is {'missing' if size is None else f'{size} bytes'}, the manifest says {meta['bytes']}"
            if sampled_blocks(path / name, size) != meta["sampled"]:
                return f"{name} does not match the checksums of its sampled blocks: it changed after the build"
        itemsize = DTYPES[manifest["dtype"]].itemsize
        for split, tokens_file, offsets_file in (("train", TOKENS_FILE, OFFSETS_FILE),
                                                 ("val", VAL_TOKENS_FILE, VAL_OFFSETS_FILE)):
            counts = manifest[split]
            if manifest["files"][tokens_file]["bytes"] != counts["tokens"] * itemsize:
                return f"{tokens_file} does not hold {counts['tokens']} {manifest['dtype']} tokens"
            offsets = np.load(path / offsets_file, mmap_mode="r")
            if offsets.shape != (counts["documents"] + 1,) or offsets[0] != 0 or offsets[-1] != counts["tokens"]:
                return f"{offsets_file} does not delimit {counts['documents']} documents"
        if TOKENIZER_FILE not in manifest["files"]:
            return f"no {TOKENIZER_FILE}"
    except (KeyError, TypeError, ValueError, OSError) as e:
        return f"malformed manifest or files ({type(e).__name__}: {e})"
    return None


def sampled_blocks(path: Path, size: int) -> dict[str, str]:
    """blake2b of up to `SAMPLED_BLOCKS` blocks spread evenly over the file, by byte offset: cheap enough for every
    open (at most 512 KiB read per file), and it sees a file replaced, zeroed or rewritten after the build."""
    count = -(-size // SAMPLE_BLOCK)
    blocks = sorted({round(i * (count - 1) / (SAMPLED_BLOCKS - 1)) for i in range(SAMPLED_BLOCKS)}) if count else []
    found = {}
    with open(path, "rb") as f:
        for block in blocks:
            f.seek(block * SAMPLE_BLOCK)
            found[str(block * SAMPLE_BLOCK)] = hashlib.blake2b(f.read(SAMPLE_BLOCK), digest_size=16).hexdigest()
    return found


def map_tokens(path: Path, dtype: np.dtype, count: int) -> np.ndarray:
    if count == 0:  # mmap cannot map an empty file
        empty = np.empty(0, dtype=dtype)
        empty.flags.writeable = False
        return empty
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))


class MappedFile:
    """The file a memory-mapped token array reads, held to its size and modification time when the run mapped it. A
    cache rewritten under a running job would be trained on as it now is (zeros, for one zeroed), and one truncated
    ends the rank with a bare SIGBUS at the first read past its end; `check`, an fstat (a microsecond) before every
    read, makes either one line naming the file. An open descriptor is watched, not the path: a cache rebuilt and
    renamed into place leaves the mapped file, and the run, intact."""

    def __init__(self, path: str, size: int, mtime_ns: int) -> None:
        self.path = path
        self.size = size
        self.mtime_ns = mtime_ns
        self.fd = os.open(path, os.O_RDONLY)
        weakref.finalize(self, os.close, self.fd)

    @classmethod
    def of(cls, tokens: np.ndarray) -> MappedFile | None:
        """The watch of a memory-mapped array's file; None for an array held in memory."""
        if not (isinstance(tokens, np.memmap) and tokens.filename):
            return None
        stat = os.stat(tokens.filename)
        return cls(tokens.filename, stat.st_size, stat.st_mtime_ns)

    def __reduce__(self) -> tuple[type[MappedFile], tuple[str, int, int]]:
        return MappedFile, (self.path, self.size, self.mtime_ns)  # a worker watches it again, against the same

    def check(self) -> None:
        stat = os.fstat(self.fd)
        if stat.st_size < self.size:
            how = f"truncated to {stat.st_size:,} of its {self.size:,} bytes"
        elif stat.st_size != self.size or stat.st_mtime_ns != self.mtime_ns:
            how = "rewritten in place"
        else:
            return
        raise UserError(f"token cache file {self.path} was {how} while the run trained on it; rebuild the cache with "
                        f"python prepare_dataset.py --force, then resume the run (--resume auto)")


# ---------------------------------------------------------------------------------------------------------------------
# Keys and paths


def cache_root(data: DataConfig) -> Path:
    """data.cache_dir; a relative path is relative to the project root, not to wherever the command runs."""
    root = Path(data.cache_dir).expanduser()
    return root if root.is_absolute() else PROJECT_ROOT / root


def config_paths(data: DataConfig) -> list[Setting]:
    """The paths `data` names, by setting: what an OSError about a path is put down to (`path_errors_named`)."""
    named = [("data.cache_dir", cache_root(data))]
    if data.tokenizer != BPE:
        named.append(("data.tokenizer", Path(data.tokenizer).expanduser()))
    return named + [("data.mixture source" if data.mixture else "data.source", Path(source).expanduser())
                    for source in data.mixture or [data.source]]


def key_material(data: DataConfig, source: dict[str, Any], tokenizer: TokenizerSpec) -> dict[str, Any]:
    return {"format_version": FORMAT_VERSION, "source": source, "tokenizer": tokenizer.identity,
            "context_length": data.context_length, "max_samples": data.max_samples, "val_fraction": data.val_fraction}


# ---------------------------------------------------------------------------------------------------------------------
# Writing the cache


def write_cache(folder: Path, key: str, material: dict[str, Any], corpus: Corpus, spec: TokenizerSpec,
                data: DataConfig, progress: BuildProgress) -> None:
    """Tokenize the corpus into `folder` and write the manifest last."""
    started = time.perf_counter()
    tokenizer = load_fast(spec.folder)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    check_vocab_size(vocab_size, f"tokenizer {spec.description}")
    eos_id = eos_id_of(tokenizer, spec.eos_token, spec.folder)
    export(tokenizer, spec.folder, folder, spec.eos_token)

    train = TokenStream(folder / TOKENS_FILE, folder / OFFSETS_FILE)
    val = TokenStream(folder / VAL_TOKENS_FILE, folder / VAL_OFFSETS_FILE)
    try:
        progress.phase("tokenizing", total=capped(corpus.size_hint(), data.max_samples))
        pieces = split_documents(corpus.pieces(), data.max_samples, data.val_fraction)
        with closing(encode_pipelined(tokenizer, eos_id, piece_batches(pieces, BATCH_CHARS))) as batches:
            for batch in batches:
                train.append(batch.train_ids, batch.train_ends)
                val.append(batch.val_ids, batch.val_ends)
                progress.advance(batch.documents, batch.tokens)
        if DTYPES["uint32"] in (train.dtype, val.dtype):  # one dtype for both splits
            train.widen()
            val.widen()
        train.close()
        val.close()
    except BaseException:
        train.abort()
        val.abort()
        raise
    progress.end_phase()

    if train.documents + val.documents == 0:
        raise UserError(f"data.source {data.source} holds no documents (only empty files or rows); "
                        f"point it at a non-empty corpus")
    if train.tokens < data.context_length + 1:
        raise UserError(f"the corpus gives {train.tokens:,} training tokens, fewer than one context window "
                        f"({data.context_length:,} + 1); use more documents (data.max_samples, data.source) or a "
                        f"shorter data.context_length")
    write_manifest(folder, key=key, material=material, description={"source": corpus.description,
                                                                     "tokenizer": spec.description},
                   train=train, val=val, vocab_size=vocab_size, eos_id=eos_id, eos_token=spec.eos_token,
                   tokenizer_train_seconds=spec.train_seconds, build_seconds=time.perf_counter() - started)


def write_manifest(folder: Path, *, key: str, material: dict[str, Any], description: dict[str, str],
                   train: TokenStream, val: TokenStream, vocab_size: int, eos_id: int, eos_token: str,
                   tokenizer_train_seconds: float, build_seconds: float) -> None:
    """The last file of a build: counts, sizes and checksums of everything else in `folder`, and the key material."""
    files = {path.name: {"bytes": path.stat().st_size, "blake2b": file_digest(path),
                         "sampled": sampled_blocks(path, path.stat().st_size)} for path in sorted(folder.iterdir())}
    manifest = {
        "format_version": FORMAT_VERSION,
        "key": key,
        "key_material": material,
        "description": description,
        "dtype": train.dtype.name,
        "vocab_size": vocab_size,
        "eos_id": eos_id,
        "eos_token": eos_token,
        "train": {"documents": train.documents, "tokens": train.tokens},
        "val": {"documents": val.documents, "tokens": val.tokens},
        "files": files,
        "tokenizer": {"train_seconds": tokenizer_train_seconds},
        "build": {"seconds": build_seconds, "created": time.time(), "host": platform.node(),
                  "python": platform.python_version(), "peak_rss_bytes": peak_rss_bytes()},
    }
    durable.write_json_durably(folder / MANIFEST_FILE, manifest)


def capped(hint: int | None, max_samples: int | None) -> int | None:
    if hint is None:
        return max_samples
    return hint if max_samples is None else min(hint, max_samples)


# ---------------------------------------------------------------------------------------------------------------------
# The tokenizer: a trained BPE cached under its recipe, or a pretrained one located by name


def obtain_tokenizer(data: DataConfig, corpus: Corpus, source: dict[str, Any], root: Path,
                     progress: BuildProgress, build: bool = True) -> TokenizerSpec | None:
    """The tokenizer's spec; None when the BPE is not trained yet and `build` is False."""
    if data.tokenizer != BPE:
        folder = locate_pretrained(data.tokenizer)
        return TokenizerSpec(folder=folder, identity={"kind": "pretrained", "content": tokenizer_digest(folder)},
                             eos_token=eos_token_of(folder), description=data.tokenizer)
    recipe = bpe_recipe(data, source)
    recipe_key = digest(recipe)
    parent = root / TOKENIZERS_DIR
    final = parent / recipe_key
    spec = read_trained_bpe(final, recipe_key, data)
    if spec is not None or not build:
        return spec
    ensure_writable(root)
    with build_lock(root, f"tokenizer-{recipe_key}", progress):
        spec = read_trained_bpe(final, recipe_key, data)
        if spec is not None:
            return spec
        with staging(parent, recipe_key, "tokenizer") as folder:
            started = time.perf_counter()
            progress.message(f"training a byte-level BPE of {data.vocab_size:,} tokens on {corpus.description}")
            progress.phase("training BPE", total=capped(corpus.size_hint(), data.max_samples))
            pieces = training_pieces(progress.counted(corpus.pieces()), data.max_samples, data.val_fraction)
            train_bpe(pieces, data.vocab_size, folder)
            progress.end_phase()
            if progress.phase_documents == 0:
                raise UserError(f"data.source {data.source} holds no documents to train a tokenizer on; "
                                f"point it at a non-empty corpus")
            durable.write_json_durably(folder / TOKENIZER_META_FILE, {
                "recipe_key": recipe_key, "recipe": recipe, "content": tokenizer_digest(folder),
                "train_seconds": time.perf_counter() - started, "documents": progress.phase_documents})
            publish(folder, final)
    spec = read_trained_bpe(final, recipe_key, data)
    if spec is None:
        raise RuntimeError(f"the tokenizer just trained in {final} does not validate")
    return spec


def read_trained_bpe(folder: Path, recipe_key: str, data: DataConfig) -> TokenizerSpec | None:
    """The cached BPE if its meta file matches the recipe and its files still hash to the recorded digest."""
    try:
        meta = json.loads((folder / TOKENIZER_META_FILE).read_text())
    except (OSError, ValueError):
        return None
    content = tokenizer_digest(folder)
    if meta.get("recipe_key") != recipe_key or meta.get("content") != content:
        return None
    return TokenizerSpec(folder=folder, identity={"kind": BPE, "content": content}, eos_token=eos_token_of(folder),
                         description=f"bpe {data.vocab_size:,}", train_seconds=meta.get("train_seconds", 0.0))


# ---------------------------------------------------------------------------------------------------------------------
# prepare: hit, or build under the lock


def prepare(cfg: Config, *, force: bool = False, show_progress: bool | None = None, rehash: bool = False) -> CacheInfo:
    """The token cache for `cfg.data`, built if needed. Safe to call from every rank at once: exactly one process
    builds, the others wait on the lock and reuse its result. `show_progress`: None shows a rich bar on a terminal
    and plain lines otherwise, True forces the bar, False is silent. `rehash`: read every source file by content
    instead of trusting the digests remembered under unchanged stats."""
    info = find_or_build(cfg, force=force, show_progress=show_progress, rehash=rehash, build=True)
    assert info is not None
    return info


def find(cfg: Config) -> CacheInfo | None:
    """The token cache for `cfg.data` if it exists and validates (a hit, as cheap as `prepare`'s), else None: building
    is left to a process of its own (`prepare_dataset.py`), whose death by the out-of-memory killer its parent can
    still report."""
    return find_or_build(cfg, force=False, show_progress=False, rehash=False, build=False)


def find_or_build(cfg: Config, *, force: bool, show_progress: bool | None, rehash: bool,
                  build: bool) -> CacheInfo | None:
    """The cache of `cfg.data`'s source, or of each source of its mixture (one process, one at a time: memory holds
    one build's batches). Every source's content is keyed before anything is built, so a hit costs a stat per file."""
    data = cfg.data
    refuse_unsampled(data.mixture or {})
    root = cache_root(data)
    digests = DigestMemo.load(root, rehash=rehash)
    with path_errors_named(config_paths(data)), closing(BuildProgress.create(show_progress)) as progress:
        for parent in (root, root / TOKENIZERS_DIR):
            remove_dead_leftovers(parent)
        sources = [replace(data, source=name, mixture=None) for name in data.mixture] if data.mixture else [data]
        corpora = [open_corpus(source) for source in sources]
        identities = [corpus.identity(digests) for corpus in corpora]
        refuse_repeats([source.source for source in sources], identities)
        digests.save()
        # A mixture's trained BPE is its first source's: adding a source or changing a weight rebuilds nothing.
        spec = obtain_tokenizer(sources[0], corpora[0], identities[0], root, progress, build)
        if spec is None:
            return None
        infos = []
        for source, corpus, identity in zip(sources, corpora, identities):
            info = find_or_build_source(source, corpus, identity, spec, root, progress, digests, force=force,
                                        build=build)
            if info is None:
                return None
            infos.append(info)
        digests.save()  # the cache folder exists now, if it did not before
        return mixture_info(root, data, infos) if data.mixture else infos[0]


def find_or_build_source(data: DataConfig, corpus: Corpus, source: dict[str, Any], spec: TokenizerSpec, root: Path,
                         progress: BuildProgress, digests: DigestMemo, *, force: bool,
                         build: bool) -> CacheInfo | None:
    """One source's cache: a hit without any lock, else built under the key's lock (see the module docstring)."""
    material = key_material(data, source, spec)
    key = digest(material)
    final = root / key
    if not force and (cache := try_open(final, progress)) is not None:
        return cache_info(cache, built=False)
    if not build:
        return None
    ensure_writable(root)
    with build_lock(root, key, progress):
        if not force and (cache := try_open(final)) is not None:  # built by the process we waited for
            return cache_info(cache, built=False)
        started = time.perf_counter()
        progress.message(f"building token cache {key} from {corpus.description} with {spec.description}")
        with staging(root, key, "token cache") as folder:
            write_cache(folder, key, material, corpus, spec, data, progress)
            # (a file whose stat is unchanged since it was hashed above is not read again, even with rehash)
            if corpus.identity(replace(digests, rehash=False)) != source:
                raise UserError(f"data.source {data.source} changed while it was read to build the token cache "
                                f"(a file written to, added or removed); nothing was kept: build again once it "
                                f"no longer changes")
            publish(folder, final)
        seconds = time.perf_counter() - started
    return cache_info(TokenCache.open(final), built=True, seconds=seconds)


def mixture_info(root: Path, data: DataConfig, infos: list[CacheInfo]) -> CacheInfo:
    """The mixture's record (written once) and its sums; the widest dtype of its sources."""
    assert data.mixture is not None
    sources = [MixtureSource(name, weight, info.key) for (name, weight), info in zip(data.mixture.items(), infos)]
    return CacheInfo(key=mixture_key(sources), path=write_mixture(root, sources),
                     documents=sum(i.documents for i in infos), tokens=sum(i.tokens for i in infos),
                     val_tokens=sum(i.val_tokens for i in infos),
                     dtype=max((i.dtype for i in infos), key=lambda name: DTYPES[name].itemsize),
                     vocab_size=infos[0].vocab_size, built=any(i.built for i in infos),
                     build_seconds=sum(i.build_seconds for i in infos),
                     peak_rss_bytes=max(i.peak_rss_bytes for i in infos), sources=infos)


def try_open(final: Path, progress: BuildProgress | None = None) -> TokenCache | None:
    """The cache if it exists and validates, else None (an invalid one is reported, then rebuilt over)."""
    if not (final / MANIFEST_FILE).is_file():
        return None
    try:
        return TokenCache.open(final)
    except UserError as e:
        if progress is not None:
            progress.message(f"rebuilding: {e}")
        return None


def cache_info(cache: TokenCache, built: bool, seconds: float | None = None) -> CacheInfo:
    m = cache.manifest
    return CacheInfo(key=cache.key, path=cache.path, documents=m["train"]["documents"] + m["val"]["documents"],
                     tokens=m["train"]["tokens"], val_tokens=m["val"]["tokens"], dtype=m["dtype"],
                     vocab_size=cache.vocab_size, built=built,
                     build_seconds=m["build"]["seconds"] if seconds is None else seconds,
                     peak_rss_bytes=m["build"]["peak_rss_bytes"])
