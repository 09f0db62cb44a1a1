"""Where checkpoints live on disk, which one a run resumes from, and whether its meta.json fits the run; importable
without torch, so the supervisor (and a rank started by hand, before it imports torch) can reject a bad `--resume`
before any rank builds its model.

    <checkpoint.dir>/step_000500/   one complete checkpoint (it has its meta.json: folders appear complete, by rename)
    <checkpoint.dir>/.tmp-step_…    a save in progress, or one a killed process left (removed by the next save)
    <checkpoint.dir>/.old-…         an older folder of the same name, set aside while its replacement is renamed in

Each file of a checkpoint folder is recorded in its meta.json (`files`: its size and xxh3-64 checksum, taken by the
rank that wrote it right after writing it), so that damage the atomic save cannot rule out (a disk fault, a copy cut
short, a hand edit, files copied from another checkpoint) is found before the tensors are trusted: sizes here, with a
stat each (`damage`, before any rank starts), checksums by the ranks before they load (`verify_files`, every byte
read once, the files shared among the ranks by trainer.checkpoint.store). A checkpoint written before its files were
recorded has no `files`: its structure alone is checked, and it loads unverified. A checkpoint that is one `.pt` file
(the NaN guard's `nan_grad_step_<n>.pt`) has its record beside it, `nan_grad_step_<n>.pt.json` (`file_records`).

Length: all that the supervisor reads of checkpoints without torch (names, the meta record, damage, which one a resume
means) is this one module, so that what it decides before any rank starts and what the ranks decide agree.
"""

from __future__ import annotations

import json
import time
import zipfile
from collections.abc import Iterable
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path, PurePosixPath
from typing import Any

import xxhash

from trainer.checkpoint import claim
from trainer.config import Config
from trainer.config.json_text import parse_json
from trainer.durable import check_writable
from trainer.errors import UserError

STEP_PREFIX = "step_"
TMP_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"
META_FILE = "meta.json"
STATE_FILE = "state.pt"  # torch.save's zip archive: scheduler, scaler, RNGs; model and optimizer in the full format
DCP_DIR = "dcp"  # the sharded format's torch.distributed.checkpoint folder
DCP_METADATA = ".metadata"  # written last by torch.distributed.checkpoint
FULL, SHARDED = "full", "sharded"  # a checkpoint's format: one full state (DDP, one process) or FSDP2's shards
STRATEGY_OF_FORMAT = {FULL: "ddp", SHARDED: "fsdp"}
CHECKSUM = "xxh3_64"  # what meta.json records of each file beside its size: tens of GB/s on one core, so a file is
#                       checked at the speed of the disk it is read from (it finds damage, not tampering)
READ_CHUNK = 8 << 20
RECORD_SUFFIX = ".json"  # a `.pt` checkpoint's record of itself (size, checksum), beside it: <name>.pt.json
# The folder of the node's memory copy of the latest state (trainer.checkpoint.memory), under /dev/shm: the supervisor
# makes it new for each run, names it to the ranks and removes it on every exit path
MEMORY_DIR_ENV = "SUPERVISOR_MEMORY_DIR"
MEMORY_PREFIX = "local"  # each rank's copies there are named after its local rank
# The model keys that decide the parameters' shapes (vocab_size aside: None means the tokenizer's). A model started
# from `name_or_path` takes its shape from there, whatever the other keys say.
SHAPE_KEYS = ("architecture", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_hidden_size",
              "tie_word_embeddings")


@dataclass
class CheckpointMeta:
    """What a checkpoint is, readable without loading any tensor."""

    step: int  # optimizer steps completed: a resumed run continues with this step index
    format: str  # "full" | "sharded"
    cache_key: str
    world_size: int
    data: dict[str, int]  # the data position: the sampler is a pure function of these and the step
    model_shapes: dict[str, list[int]]
    config: dict[str, Any]
    saved_at: float = field(default_factory=time.time)
    # the full format: model and optimizer in dcp/, each rank's share (`replicated_share`), not in state.pt. Absent
    # from the meta.json of checkpoints written before it existed: those keep everything in state.pt
    split: bool = False
    # each file of the folder by its path in it: {"bytes": size, "xxh3_64": checksum} (trainer.checkpoint.layout),
    # recorded in meta.json once every rank's files are written; empty in state.pt's copy, in a `.pt` file, and in
    # checkpoints written before files were recorded (those load unverified)
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    # the loop's own state beyond the tensors (the loss-spike detector's window, trainer.diagnosis.spikes); empty in
    # checkpoints written before it existed
    loop: dict[str, Any] = field(default_factory=dict)

    @property
    def in_dcp(self) -> bool:
        """Whether the model and optimizer are in dcp/ (the sharded format, or a split full one)."""
        return self.format == SHARDED or self.split

    @classmethod
    def from_dict(cls, raw: Any) -> CheckpointMeta:
        """The meta a checkpoint recorded; a ValueError says what is missing or foreign in a record edited by hand."""
        if not isinstance(raw, dict):
            raise ValueError("is not a JSON object")
        known = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
        if missing := sorted(required - raw.keys()):
            raise ValueError(f"lacks {', '.join(missing)}")
        if foreign := sorted(raw.keys() - known):
            raise ValueError(f"has keys a checkpoint does not record: {', '.join(foreign)}")
        return cls(**raw)


def human_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def memory_file(folder: Path, local_rank: int, slot: int, suffix: str) -> Path:
    """One of a rank's two copies in the node's memory (trainer.checkpoint.memory): `local<i>.<slot>.bin` (its tensors),
    `local<i>.<slot>.json` (its header)."""
    return folder / f"{MEMORY_PREFIX}{local_rank}.{slot}.{suffix}"


def memory_copies(folder: Path) -> dict[int, dict[int, dict[str, Any]]]:
    """The steps of which the node's memory holds a whole copy, each with its copies' headers by local rank: a step
    whose writers (its headers' `local_world_size` of them) all published a header for it. Headers only: the ranks
    check the tensors before they trust them."""
    by_step: dict[int, dict[int, dict[str, Any]]] = {}
    for path in folder.glob(f"{MEMORY_PREFIX}*.json"):
        try:
            header = json.loads(path.read_text())
            by_step.setdefault(header["step"], {})[header["local_rank"]] = header
        except (OSError, ValueError, KeyError, TypeError):
            continue  # written only once its copy is complete: one that does not read is no copy
    return {step: headers for step, headers in by_step.items()
            if set(headers) == set(range(next(iter(headers.values()))["local_world_size"]))}


def memory_step(folder: Path, world_size: int) -> int | None:
    """The newest step of which the node's memory holds a whole copy that a group of `world_size` ranks can load
    (FSDP2's shards only on as many ranks as wrote them); None where there is none. What the supervisor says a
    restart's ranks will load first (they check the copy before they trust it)."""
    usable = [step for step, headers in memory_copies(folder).items()
              if all(h["format"] != SHARDED or h["world_size"] == world_size for h in headers.values())]
    return max(usable, default=None)


def check_checkpoint_dir(cfg: Config) -> None:
    """checkpoint.dir, checked writable before any rank starts (or, by hand, before the data is tokenized), so that a
    folder the run cannot write is not found at the first save, minutes in."""
    check_writable(Path(cfg.checkpoint.dir), "the checkpoint folder",
                   "set checkpoint.dir to a writable folder, e.g. --set checkpoint.dir=/tmp/checkpoints")


def step_path(root: Path, step: int) -> Path:
    return root / f"{STEP_PREFIX}{step:06d}"


def step_of(path: Path) -> int | None:
    name = path.name
    if not name.startswith(STEP_PREFIX) or not name[len(STEP_PREFIX):].isdigit():
        return None
    return int(name[len(STEP_PREFIX):])


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first (a folder is complete once it has its final name)."""
    try:
        if not root.is_dir():
            return []
        found = [p for p in root.iterdir() if step_of(p) is not None and complete(p)]
    except OSError as e:
        raise UserError(f"the checkpoint folder {root} cannot be read ({e.strerror or e}); give this user read "
                        f"access to it, or set checkpoint.dir to another folder") from None
    return sorted(found, key=lambda p: step_of(p) or 0)


def complete(path: Path) -> bool:
    """Whether the step folder `path` has its meta.json. One this user cannot look into counts: its check says it
    cannot be read, where leaving it out would pass over it in silence."""
    try:
        return path.is_dir() and (path / META_FILE).is_file()
    except PermissionError:
        return True


def latest_checkpoint(root: Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


# ---------------------------------------------------------------------------------------------------------------------
# Files as their writers recorded them


def file_record(path: Path) -> dict[str, Any]:
    """A file's size and checksum as meta.json records them, the file read once through one buffer."""
    digest, size = xxhash.xxh3_64(), 0
    buffer = bytearray(READ_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
            size += n
    return {"bytes": size, CHECKSUM: digest.hexdigest()}


def record_files(folder: Path, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """`file_record` of each of `names` (paths relative to `folder`, with `/`), by name."""
    return {name: file_record(folder / name) for name in names}


def recorded_files(meta: dict[str, Any]) -> dict[str, dict[str, Any]] | None:
    """meta.json's record of the checkpoint's files: {} for a checkpoint written before files were recorded, None
    for a record this version cannot read (a hand edit, or a name outside the checkpoint)."""
    files = meta.get("files") or {}
    if not isinstance(files, dict):
        return None
    for name, entry in files.items():
        parts = PurePosixPath(name).parts
        if (not parts or parts[0] == "/" or ".." in parts or not isinstance(entry, dict)
                or not isinstance(entry.get("bytes"), int) or not isinstance(entry.get(CHECKSUM), str)):
            return None
    return files


def record_path(checkpoint_file: Path) -> Path:
    """Where a `.pt` checkpoint's record of its size and checksum is: beside it, its name and `.json`."""
    return checkpoint_file.with_name(checkpoint_file.name + RECORD_SUFFIX)


def record_name(path: Path) -> str:
    """What holds the checkpoint `path`'s record of its files, as a message names it."""
    return META_FILE if path.is_dir() else record_path(path).name


def file_records(path: Path) -> dict[str, dict[str, Any]] | None:
    """What a checkpoint records of its files, by their paths in its folder: a folder's meta.json `files`, a `.pt`
    file's own record beside it (by its name, in its parent folder). {} for none recorded (written before records
    were kept), None for a record this version cannot read."""
    if path.is_dir():
        return recorded_files(json.loads((path / META_FILE).read_text()))
    try:
        record = json.loads(record_path(path).read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):
        return None
    return recorded_files({"files": {path.name: record}})


def size_damage(path: Path, files: dict[str, dict[str, Any]], record: str = META_FILE) -> str | None:
    """The first recorded file of the checkpoint `path` that is missing or of another size than `record` (meta.json,
    or a `.pt` file's record beside it) says, said."""
    for name, entry in files.items():
        try:
            size = (path / name).stat().st_size
        except FileNotFoundError:
            return f"{path / name} is missing ({record} records {entry['bytes']:,} bytes)"
        except OSError as e:
            return f"{path / name} cannot be read ({e.strerror or e})"
        if size != entry["bytes"]:
            return f"{path / name} is {size:,} bytes, {record} recorded {entry['bytes']:,}"
    return None


def verify_files(path: Path, names: list[str], files: dict[str, dict[str, Any]],
                 record: str = META_FILE) -> str | None:
    """The first of `names` (recorded in `files`) that differs from its record, said: every size first (a stat each),
    then every checksum (each file read once)."""
    if problem := size_damage(path, {name: files[name] for name in names}, record):
        return problem
    for name in names:
        try:
            found = file_record(path / name)
        except OSError as e:
            return f"{path / name} cannot be read ({e.strerror or e})"
        if found["bytes"] != files[name]["bytes"]:  # changed since its size was checked
            return f"{path / name} is {found['bytes']:,} bytes, {record} recorded {files[name]['bytes']:,}"
        if found[CHECKSUM] != files[name][CHECKSUM]:
            return f"{path / name} has checksum {found[CHECKSUM]}, {record} recorded {files[name][CHECKSUM]}"
    return None


def checksum_damage(path: Path) -> str | None:
    """`verify_files` over every file the checkpoint `path` records, in this one process (one `damage` found whole:
    its record reads)."""
    files = file_records(path) or {}
    return verify_files(path if path.is_dir() else path.parent, sorted(files), files, record_name(path))


# ---------------------------------------------------------------------------------------------------------------------
# Damage: what the atomic save cannot rule out (a disk fault, a copy cut short, a hand edit), found without torch and
# without reading the tensors, so that `--resume` passes over or refuses such a checkpoint before any rank starts


def archive_damage(path: Path) -> str | None:
    """What is wrong with a `torch.save` file, or None. A zip keeps its directory at its end, so a file cut short
    has lost it; an entry reaching past the end is a file cut short too."""
    try:
        size = path.stat().st_size
        if size == 0:
            return f"{path} is empty"
        with zipfile.ZipFile(path) as archive:
            entries = archive.infolist()
    except FileNotFoundError:
        return f"{path} is missing"
    except (OSError, zipfile.BadZipFile, ValueError) as e:
        return f"{path} is not a torch.save archive, or one cut short ({e})"
    if not any(e.filename.endswith("/data.pkl") for e in entries):
        return f"{path} is a zip archive but not one torch.save wrote"
    if any(e.header_offset + e.compress_size > size for e in entries):
        return f"{path} is cut short"
    return None


def damage(path: Path) -> str | None:
    """What makes a checkpoint (a folder or a `.pt` file) unusable, or None when it looks whole: a folder's meta.json
    must parse and say what `check_meta` reads, its state.pt be a whole archive, each file it records be there at its
    recorded size, the dcp/ of a sharded or split one (`trainer.checkpoint.store`) be finished. Checksums are left to
    the ranks (`verify_files`): they read every byte."""
    if path.is_file():
        files = file_records(path)
        if files is None:
            return f"{record_path(path)} is not a record of {path.name} this version reads"
        return archive_damage(path) or size_damage(path.parent, files, record_name(path))
    try:
        meta = parse_json((path / META_FILE).read_text())
    except OSError as e:
        return f"{path / META_FILE} cannot be read ({e.strerror or e})"
    except ValueError as e:
        return f"{path / META_FILE} is not readable JSON ({e})"
    fits = (isinstance(meta, dict) and isinstance(meta.get("cache_key"), str) and isinstance(meta.get("step"), int)
            and meta.get("format") in STRATEGY_OF_FORMAT and isinstance(meta.get("config"), dict)
            and isinstance(meta["config"].get("model", {}), dict))
    if not fits:
        return f"{path / META_FILE} lacks the step, format, cache_key or config a checkpoint records"
    try:
        CheckpointMeta.from_dict(meta)
    except ValueError as e:
        return f"{path / META_FILE} {e}"
    if problem := archive_damage(path / STATE_FILE):
        return problem
    files = recorded_files(meta)
    if files is None:
        return f"{path / META_FILE} records its files in a form this version does not read"
    if problem := size_damage(path, files):
        return problem
    if (meta["format"] == SHARDED or meta.get("split") is True) and not (path / DCP_DIR / DCP_METADATA).is_file():
        return f"{path / DCP_DIR} has no {DCP_METADATA} (the save of its shards did not finish)"
    return None


def scan(root: Path, known: dict[Path, str] | None = None,
         up_to: int | None = None) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint under `root` (of a step at most `up_to`, where given) that looks intact (None where none
    does), and the damaged ones newer than it, newest first, each with what is wrong with it: what `damage` finds, or
    what `known` says (the ranks' checks of checksums and their loads, which find what the files alone do not show)."""
    known = known or {}
    damaged = []
    for path in reversed(list_checkpoints(root)):
        if up_to is not None and (step_of(path) or 0) > up_to:
            continue
        problem = known.get(path) or damage(path)
        if problem is None:
            return path, damaged
        damaged.append((path, problem))
    return None, damaged


def passed_over(problem: str, intact: Path) -> str:
    """The line that says a damaged checkpoint was passed over for `intact`."""
    return f"--resume: {problem}; resuming from {intact}, the newest intact checkpoint"


def all_damaged(root: Path, damaged: list[tuple[Path, str]]) -> UserError:
    return UserError(f"every checkpoint in {root} is damaged ({len(damaged)}; the latest: {damaged[0][1]}); start "
                     f"fresh without --resume in another checkpoint.dir, or restore them")


def newest_intact(root: Path, notes: list[str] | None = None, known: dict[Path, str] | None = None) -> Path | None:
    """The latest checkpoint under `root` that is not damaged (`scan`); each damaged one passed over is said in
    `notes`. None when there is none at all; a UserError when there are some and every one is damaged."""
    intact, damaged = scan(root, known)
    if intact is None:
        if damaged:
            raise all_damaged(root, damaged)
        return None
    if notes is not None:
        notes += [passed_over(problem, intact) for _, problem in damaged]
    return intact


def names_one(cfg: Config) -> bool:
    """Whether `checkpoint.resume` names one checkpoint (a folder or a `.pt` file): a damaged one is then refused,
    where `auto` and a folder holding checkpoints pass over it for the newest intact one."""
    spec = cfg.checkpoint.resume
    if spec is None or spec == "auto":
        return False
    path = Path(spec)
    try:
        return path.is_file() or (path / META_FILE).is_file()
    except PermissionError:  # one this user cannot look into: its check says so
        return True


def refusal(spec: str, path: Path, problem: str, known: dict[Path, str] | None = None) -> UserError:
    """`--resume spec` (the checkpoint `path`) refused for `problem`, naming the newest intact checkpoint beside it."""
    try:
        intact = newest_intact(path.parent, known=known)
    except UserError:
        intact = None
    instead = f"; the newest intact checkpoint beside it is {intact}: --resume {intact}" if intact else ""
    return UserError(f"--resume {spec} cannot be resumed: {problem}{instead}")


def find_resume(cfg: Config, notes: list[str] | None = None) -> Path | None:
    """The checkpoint `checkpoint.resume` asks for: None (fresh start), "auto" (the latest intact one, if any) or a
    path: a checkpoint folder, a `.pt` file, or a folder holding checkpoints (its latest intact one). A damaged
    latest checkpoint is passed over, said in `notes`; a damaged one named by its path is refused, naming the
    newest intact one beside it."""
    spec = cfg.checkpoint.resume
    if spec is None:
        return None
    if spec == "auto":
        return newest_intact(Path(cfg.checkpoint.dir), notes)
    path = Path(spec)
    if names_one(cfg):
        if problem := damage(path):
            raise refusal(spec, path, problem)
        return path
    latest = newest_intact(path, notes) if path.is_dir() else None
    if latest is None:
        what = "no such file or folder" if not path.exists() else "no checkpoint there"
        raise UserError(f"--resume {spec}: {what}; give a step_<n> checkpoint folder, a folder holding them, a .pt "
                        f"file, or auto")
    return latest


def earlier_run(cfg: Config) -> list[Path]:
    """The checkpoints a run without --resume finds in checkpoint.dir: a finished earlier run's, which this run
    supersedes (trainer.loop removes them once it has published a checkpoint of its own, so that neither pruning nor a
    later --resume auto takes them for this run's). An unfinished earlier run is refused instead: starting it over
    from step 0 is almost always a forgotten --resume auto, and its checkpoints would be lost."""
    if cfg.checkpoint.resume is not None:
        return []
    found = list_checkpoints(Path(cfg.checkpoint.dir))
    if not found:
        return []
    latest = found[-1]
    try:
        planned = json.loads((latest / META_FILE).read_text())["config"]["training"]["max_steps"]
    except (OSError, ValueError, KeyError, TypeError):
        planned = None  # unreadable: treated as unfinished, the safe side
    if planned is None or (step_of(latest) or 0) < planned:
        if claim.held(Path(cfg.checkpoint.dir)):  # not an earlier run: a live one, still writing there
            raise claim.in_use(Path(cfg.checkpoint.dir))
        of = f" of {planned}" if planned is not None else ""
        raise UserError(f"{cfg.checkpoint.dir} holds an unfinished run (up to {latest.name}{of} steps); continue it "
                        f"with --resume auto, or start a new run elsewhere with --set checkpoint.dir=DIR (or delete "
                        f"its checkpoints first)")
    return found


def other_data(path: Path, theirs: str, ours: str) -> UserError:
    return UserError(f"checkpoint {path} was trained on dataset cache {theirs}, but this run uses {ours}; resume "
                     f"with the same data settings, or start fresh without --resume")


def other_shape(path: Path, detail: str) -> UserError:
    return UserError(f"checkpoint {path} holds a different model shape: {detail}; resume with the same model "
                     f"settings, or start fresh without --resume")


def other_format(path: Path, written: str) -> UserError:
    return UserError(f"checkpoint {path} was written in the {written} format; resume it with "
                     f"--set training.strategy={STRATEGY_OF_FORMAT[written]}")


def check_meta(path: Path, cfg: Config, cache_key: str, tokenizer_vocab: int) -> None:
    """Refuse a checkpoint folder whose meta.json says it was trained on other data, has another model shape or is
    in the other strategy's format: one line before any rank starts, where the rank would refuse it only after
    building (and, on GPUs, sharding) the model. trainer.checkpoint.store.check_compatible still compares the tensors
    themselves when the rank loads them; a `.pt` file keeps its meta among its tensors and is checked there alone."""
    if not (path / META_FILE).is_file():
        return
    meta = json.loads((path / META_FILE).read_text())
    if meta["cache_key"] != cache_key:
        raise other_data(path, meta["cache_key"], cache_key)
    theirs, ours = meta["config"].get("model", {}), cfg.model.__dict__
    keys = ["name_or_path"] if theirs.get("name_or_path") or ours["name_or_path"] else ["name_or_path", *SHAPE_KEYS]
    differ = [f"model.{k} is {theirs[k]} there and {ours[k]} here" for k in keys
              if k in theirs and theirs[k] != ours[k]]  # a key the checkpoint does not record: the rank checks
    vocab = theirs.get("vocab_size") or tokenizer_vocab, ours["vocab_size"] or tokenizer_vocab
    if vocab[0] != vocab[1]:
        differ.append(f"a vocabulary of {vocab[0]} there and {vocab[1]} here")
    if differ:
        raise other_shape(path, ", ".join(differ))
    if STRATEGY_OF_FORMAT[meta["format"]] != cfg.training.strategy:
        raise other_format(path, meta["format"])


def check_resume(cfg: Config, cache_key: str, tokenizer_vocab: int) -> None:
    """The checkpoint this run would resume from, if any, checked against it (`check_meta`)."""
    if (path := find_resume(cfg)) is not None:
        check_meta(path, cfg, cache_key, tokenizer_vocab)
