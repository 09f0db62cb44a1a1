"""Where documents come from: the interpreter's own standard library, local files, or a Hugging Face hub dataset.

A corpus does two things: it describes itself as *key material* (`identity()`, what makes two corpora the same for the
token cache) and it yields its documents in a fixed order, as pieces (`pieces()`, `trainer.data.pieces`: a document of
any size arrives in bounded pieces, each saying whether its document ends with it). Identity is content, not names:
local files are hashed byte for byte (the digests remembered under each file's stat, `trainer.data.digests`), so
editing a file changes the cache key; a hub dataset is pinned to the commit its revision resolves to. A `.txt` file
becomes documents as `data.sample_by` says, and that enters the key.

`.txt`, `.jsonl` (either also compressed) and `.parquet` files are read here (`trainer.data.formats`: for JSON Lines
the standard library's parser costs a quarter of the CPU time `datasets`' streaming reader does, and a bad row is named
by its line; Parquet through pyarrow directly); a `.json` array goes through `datasets`. `datasets` and
`huggingface_hub` are imported only inside the functions that read those or resolve a hub name, because the cache-hit
path (compute the key, open the cache) must not pay for them.
"""

from __future__ import annotations

import errno
import glob
import io
import math
import os
import platform
import re
import stat
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from trainer.config import DataConfig
from trainer.data.digests import DigestMemo, fingerprint
from trainer.data.formats import (
    SUPPORTED,
    FileFormat,
    file_format,
    first_line,
    jsonl_texts,
    no_field,
    opened,
    parquet_texts,
    text_of,
)
from trainer.data.paths import path_errors_named
from trainer.data.pieces import (
    SAMPLE_BY_DOCUMENT,
    Piece,
    describe_sample_by,
    document_items,
    mark_ends,
    separator_of,
    text_items,
)
from trainer.errors import UserError

STDLIB_SOURCE = "stdlib"
READ_BATCH_ROWS = 1024  # rows per `datasets` batch: big enough to keep Python per-row work out of the profile
HUB_TIMEOUT_S = 10.0
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
SHARD = re.compile(r"(?P<split>[A-Za-z][\w]*)-\d+-of-\d+\.")  # a hub snapshot's file: data/train-00000-of-00004.parquet


# ---------------------------------------------------------------------------------------------------------------------
# The corpus protocol and the three kinds


class Corpus(Protocol):
    description: str  # for humans: progress lines, --list

    def identity(self, digests: DigestMemo) -> dict[str, Any]:
        """Key material: equal exactly when the documents are equal. Local files are hashed through `digests`."""

    def pieces(self) -> Iterator[Piece]:
        """Every non-empty document as pieces, in a deterministic order."""

    def size_hint(self) -> int | None:
        """How many documents `pieces()` will yield at most, when that is known cheaply."""


@dataclass
class StdlibCorpus:
    """The running interpreter's standard library, one document per `*.py` file: a real code corpus on any machine,
    with no network. site-packages is excluded (it differs between environments); files sorted by relative path."""

    root: Path = field(default_factory=lambda: Path(sysconfig.get_paths()["stdlib"]))
    files: list[Path] = field(init=False)
    description: str = field(init=False)

    def __post_init__(self) -> None:
        self.files = stdlib_files(self.root)
        self.description = f"the Python {platform.python_version()} standard library ({len(self.files)} files)"

    def identity(self, digests: DigestMemo) -> dict[str, Any]:
        return {"kind": STDLIB_SOURCE, "python": platform.python_version(), "files": len(self.files),
                "content": fingerprint(self.files, self.root, digests.digest)}

    def pieces(self) -> Iterator[Piece]:
        return mark_ends(document_items(self.documents()))

    def documents(self) -> Iterator[str]:
        """Every file that decodes as UTF-8, whole."""
        for path in self.files:
            try:
                text = path.read_bytes().decode("utf-8")
            except UnicodeDecodeError:  # a few test modules are deliberately written in legacy encodings
                continue
            if text:
                yield text

    def size_hint(self) -> int | None:
        return len(self.files)


def stdlib_files(root: Path) -> list[Path]:
    files: list[Path] = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in ("site-packages", "dist-packages", "__pycache__")]
        files += [Path(folder, name) for name in names if name.endswith(".py")]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


@dataclass
class LocalCorpus:
    """Local files (`trainer.data.formats`). A .txt file is read here, streaming, and cut into documents as
    `sample_by` says; a .jsonl file here too, a row per line, and a .parquet file a column batch at a time; a .json
    array through `datasets.load_dataset` in streaming mode (the files are already on disk, so materialising them as
    Arrow would only copy them)."""

    source: str
    text_field: str
    files: list[Path]
    root: Path
    sample_by: str = SAMPLE_BY_DOCUMENT
    description: str = field(init=False)

    def __post_init__(self) -> None:
        if self.sample_by != SAMPLE_BY_DOCUMENT and not self.text_files:
            raise UserError(f"data.sample_by {self.sample_by!r} applies to .txt files and {self.source} has none; "
                            f"leave data.sample_by at 'document'")
        how = f", {describe_sample_by(self.sample_by)}" if self.text_files else ""
        self.description = f"{self.source} ({len(self.files)} file{'s' * (len(self.files) != 1)}{how})"

    @property
    def text_files(self) -> int:
        return sum(format_of(p).reader == "text" for p in self.files)

    def identity(self, digests: DigestMemo) -> dict[str, Any]:
        material: dict[str, Any] = {"kind": "local", "files": len(self.files),
                                    "content": fingerprint(self.files, self.root, digests.digest)}
        if self.text_files < len(self.files):
            material["text_field"] = self.text_field  # a .txt file has no fields; elsewhere the field picks the text
        if self.text_files:
            material["sample_by"] = self.sample_by  # how a .txt file becomes documents
        return material

    def pieces(self) -> Iterator[Piece]:
        return mark_ends(self.items())

    def items(self) -> Iterator[str | None]:
        separator = separator_of(self.sample_by)
        # One load_dataset call per run of .json files, so a folder may mix formats in sorted order.
        for builder, run in runs_by_reader(self.files):
            if builder != "json":
                for path in run:
                    yield from self.file_items(path, format_of(path), separator)
                continue
            import datasets

            datasets.disable_progress_bars()
            try:
                dataset = datasets.load_dataset(builder, data_files=[str(p) for p in run], split="train",
                                                streaming=True)
                yield from document_items(texts(dataset, self.text_field, self.source))
            except UserError:
                raise
            except Exception as e:  # noqa: BLE001 - pyarrow/json errors: say which files, in one line
                raise UserError(f"cannot read {self.source} as {builder} ({type(e).__name__}: "
                                f"{first_line(e)}); check the files are valid {builder} data") from None

    def file_items(self, path: Path, form: FileFormat, separator: re.Pattern[str] | None) -> Iterator[str | None]:
        if form.reader == "text":
            yield from read_text_file(path, form.compression, separator)
        elif form.reader == "jsonl":
            yield from document_items(jsonl_texts(path, form.compression, self.text_field))
        else:
            yield from document_items(parquet_texts(path, self.text_field))

    def size_hint(self) -> int | None:
        one_document_per_file = self.sample_by == SAMPLE_BY_DOCUMENT and self.text_files == len(self.files)
        return len(self.files) if one_document_per_file else None


def read_text_file(path: Path, compression: str | None,
                   separator: re.Pattern[str] | None) -> Iterator[str | None]:
    try:
        with opened(path, compression, []) as stream:
            yield from text_items(io.TextIOWrapper(stream, encoding="utf-8"), separator)
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not UTF-8 text (byte {e.start}: {e.reason}); convert it to UTF-8") from None


def format_of(path: Path) -> FileFormat:
    form = file_format(path)
    if form is None:
        raise UserError(f"data.source file {path} is not one of {SUPPORTED}; convert it or pick other files")
    return form


def runs_by_reader(files: list[Path]) -> Iterator[tuple[str, list[Path]]]:
    run: list[Path] = []
    for path in files:
        if run and format_of(path).reader != format_of(run[-1]).reader:
            yield format_of(run[-1]).reader, run
            run = []
        run.append(path)
    if run:
        yield format_of(run[-1]).reader, run


@dataclass
class HubCorpus:
    """A dataset on the Hugging Face hub, pinned to the commit its revision resolves to (so "main" moving on means a
    new cache). With `streaming` the rows are tokenized as they arrive and never materialised on disk."""

    name: str
    config: str | None
    split: str
    revision: str | None
    streaming: bool
    text_field: str
    commit: str | None = None  # what `revision` resolved to; set by identity()
    description: str = field(init=False)

    def __post_init__(self) -> None:
        self.description = f"hub dataset {self.name}" + (f" ({self.config})" if self.config else "") + f" [{self.split}]"

    def identity(self, digests: DigestMemo) -> dict[str, Any]:
        if self.commit is None:
            self.commit = resolve_hub_commit(self.name, self.revision)
        return {"kind": "hub", "name": self.name, "config": self.config, "split": self.split,
                "revision": self.commit, "text_field": self.text_field}

    def pieces(self) -> Iterator[Piece]:
        return mark_ends(self.items())

    def items(self) -> Iterator[str | None]:
        import datasets

        datasets.disable_progress_bars()
        revision = self.commit or self.revision
        try:
            dataset = datasets.load_dataset(self.name, self.config, split=self.split, revision=revision,
                                            streaming=self.streaming)
            yield from document_items(texts(dataset, self.text_field, self.name))
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - network, missing config/split: one line instead of a traceback
            raise UserError(f"cannot load hub dataset {self.name} (config {self.config}, split {self.split}): "
                            f"{type(e).__name__}: {first_line(e)}") from None

    def size_hint(self) -> int | None:
        return None


def resolve_hub_commit(name: str, revision: str | None) -> str:
    """The commit sha that `revision` (default: the main branch) points at; one bounded request."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    try:
        info = HfApi().dataset_info(name, revision=revision, timeout=HUB_TIMEOUT_S)
    except RevisionNotFoundError:
        raise UserError(f"hub dataset {name} has no revision '{revision}'; fix data.revision") from None
    except RepositoryNotFoundError:
        raise UserError(f"data.source '{name}' is neither a local path nor a dataset on the Hugging Face hub; "
                        f"fix the name or point data.source at a local file, folder or glob ({SUPPORTED})") from None
    except Exception as e:  # noqa: BLE001 - offline mode, DNS, refused, timeout: all mean the same to the user
        raise UserError(f"data.source '{name}' is not a local path and the Hugging Face hub cannot be reached "
                        f"({first_line(e)}); use a local file, folder or glob of {SUPPORTED} instead, "
                        f"e.g. --set data.source=path/to/corpus.jsonl") from None
    if not info.sha:
        raise UserError(f"the hub returned no commit for dataset {name}; set data.revision to a commit sha")
    return info.sha


def texts(dataset: Any, text_field: str, origin: str) -> Iterator[str]:
    """The non-empty `text_field` values of a `datasets` (Iterable)Dataset, read in column batches."""
    for batch in dataset.iter(batch_size=READ_BATCH_ROWS):
        if text_field not in batch:
            raise no_field(text_field, batch, origin)
        for value in batch[text_field]:
            if text := text_of(value, text_field, origin):
                yield text


# ---------------------------------------------------------------------------------------------------------------------
# Choosing the corpus from data.source


def open_corpus(data: DataConfig) -> Corpus:
    """`stdlib`, an existing local path or glob, or else a hub dataset name."""
    source = data.source.strip()
    if source == STDLIB_SOURCE:
        return StdlibCorpus()
    with path_errors_named([("data.source", Path(source).expanduser())]):  # also where the preflight opens it
        files, root = local_files(source, data.split)
    if files is not None:
        return LocalCorpus(source=source, text_field=data.text_field, files=files, root=root, sample_by=data.sample_by)
    return HubCorpus(name=source, config=data.hub_config, split=data.split, revision=data.revision,
                     streaming=data.streaming, text_field=data.text_field)


def local_files(source: str, split: str) -> tuple[list[Path] | None, Path]:
    """The files a local source names, sorted; (None, ...) when it can only be a hub name."""
    path = Path(source).expanduser()
    if glob.has_magic(source):
        matches = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
        if not matches:
            raise UserError(f"data.source glob '{source}' matches no files")
        for p in matches:
            format_of(p)
        return matches, common_root(matches)
    if path.is_dir():
        found = sorted(p for p in path.rglob("*") if p.is_file() and file_format(p) is not None
                       and not any(part.startswith(".") for part in p.relative_to(path).parts))
        if not found:
            raise UserError(f"data.source folder {source} holds no {SUPPORTED} files")
        return split_shards(found, split, source), path
    if path.is_file():
        format_of(path)
        return [path], path.parent
    if (kind := odd_file(path)) is not None:
        raise UserError(f"data.source {source} is {kind}, not a file or folder of {SUPPORTED}; give a regular file, "
                        f"a folder or a glob")
    if looks_like_path(source):
        raise UserError(f"data.source {source} does not exist; give an existing file, folder or glob of {SUPPORTED}, "
                        f"'stdlib', or a hub dataset name")
    return None, path


def split_shards(files: list[Path], split: str, source: str) -> list[Path]:
    """A folder laid out as a hub snapshot names its shards by split (`data/train-00000-of-00004.parquet`,
    `validation-00000-of-00001.parquet`): where several splits are there, data.split picks its own."""
    splits = {m["split"] for p in files if (m := SHARD.match(p.name))}
    if len(splits) < 2:
        return files
    if split not in splits:
        raise UserError(f"data.source folder {source} holds the splits {', '.join(sorted(splits))}; set data.split "
                        f"to one of them")
    return [p for p in files if (m := SHARD.match(p.name)) and m["split"] == split]


ODD_KINDS = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"))


def odd_file(path: Path) -> str | None:
    """What `path` is when it exists but is neither a regular file nor a folder (reading /dev/zero or a FIFO would
    never end), or a symbolic link that leads nowhere; None when there is nothing at `path`."""
    try:
        mode = path.stat().st_mode
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "a symbolic link loop"
        if path.is_symlink():
            return f"a symbolic link to {os.readlink(path)}, which does not exist"
        return None
    return next((kind for test, kind in ODD_KINDS if test(mode)), "neither a file nor a folder")



def looks_like_path(source: str) -> bool:
    """A string that cannot be a hub id (`name` or `owner/name`) is meant as a path."""
    return (source.startswith(("/", ".", "~")) or file_format(Path(source)) is not None
            or HUB_ID.fullmatch(source) is None)


def common_root(files: list[Path]) -> Path:
    root = Path(os.path.commonpath([str(p.resolve()) for p in files]))
    return root.parent if root.is_file() else root


# ---------------------------------------------------------------------------------------------------------------------
# Sample cap and the validation split


def is_validation(index: int, fraction: float) -> bool:
    """Every 1/fraction-th document is held out: exactly floor(n * fraction) of the first n, spread evenly through the
    corpus, decided from the index alone (so a stream of unknown length splits the same way every time)."""
    return math.floor((index + 1) * fraction) > math.floor(index * fraction)


def split_documents(pieces: Iterable[Piece], max_samples: int | None,
                    val_fraction: float) -> Iterator[tuple[str, bool, bool]]:
    """(piece, ends its document?, held out?) for the pieces of the first `max_samples` documents; every piece of a
    document goes where its document goes."""
    index = 0
    for text, ends in pieces:
        if max_samples is not None and index >= max_samples:
            return
        yield text, ends, is_validation(index, val_fraction)
        index += ends


def training_pieces(pieces: Iterable[Piece], max_samples: int | None, val_fraction: float) -> Iterator[str]:
    """The pieces of the documents that end up in the training split (what a tokenizer trained on the source sees:
    pieces end at word boundaries, so its word counts are the whole documents')."""
    return (text for text, _, held_out in split_documents(pieces, max_samples, val_fraction) if not held_out)
