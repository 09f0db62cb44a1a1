"""Where checkpoints live on disk, which one a run resumes from, and whether its meta.json fits the run; importable
without torch, so the supervisor (and a rank started by hand, before it imports torch) can reject a bad `--resume`
before any rank builds its model.

    <checkpoint.dir>/step_000500/   one complete checkpoint (it has its meta.json: folders appear complete, by rename)
    <checkpoint.dir>/.tmp-step_…    a save in progress, or one a killed process left (removed by the next save)
    <checkpoint.dir>/.old-…         an older folder of the same name, set aside while its replacement is renamed in
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

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
# The model keys that decide the parameters' shapes (vocab_size aside: None means the tokenizer's). A model started
# from `name_or_path` takes its shape from there, whatever the other keys say.
SHAPE_KEYS = ("architecture", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_hidden_size",
              "tie_word_embeddings")


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
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and step_of(p) is not None and (p / META_FILE).is_file()]
    return sorted(found, key=lambda p: step_of(p) or 0)


def latest_checkpoint(root: Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


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
    must parse and say what `check_meta` reads, its state.pt be a whole archive, the dcp/ of a sharded or split one
    (`trainer.checkpoint.store`) be finished."""
    if path.is_file():
        return archive_damage(path)
    try:
        meta = parse_json((path / META_FILE).read_text())
    except (OSError, ValueError) as e:
        return f"{path / META_FILE} is not readable JSON ({e})"
    fits = (isinstance(meta, dict) and isinstance(meta.get("cache_key"), str) and isinstance(meta.get("step"), int)
            and meta.get("format") in STRATEGY_OF_FORMAT and isinstance(meta.get("config"), dict)
            and isinstance(meta["config"].get("model", {}), dict))
    if not fits:
        return f"{path / META_FILE} lacks the step, format, cache_key or config a checkpoint records"
    if problem := archive_damage(path / STATE_FILE):
        return problem
    if (meta["format"] == SHARDED or meta.get("split") is True) and not (path / DCP_DIR / DCP_METADATA).is_file():
        return f"{path / DCP_DIR} has no {DCP_METADATA} (the save of its shards did not finish)"
    return None


def newest_intact(root: Path, notes: list[str] | None = None) -> Path | None:
    """The latest checkpoint under `root` that is not damaged; each damaged one passed over is said in `notes`.
    None when there is none at all; a UserError when there are some and every one is damaged."""
    found = list_checkpoints(root)
    problems = []
    for path in reversed(found):
        problem = damage(path)
        if problem is None:
            if notes is not None:
                notes += [f"--resume: {p}; resuming from {path}, the newest intact checkpoint" for p in problems]
            return path
        problems.append(problem)
    if problems:
        raise UserError(f"every checkpoint in {root} is damaged ({len(problems)}; the latest: {problems[0]}); start "
                        f"fresh without --resume in another checkpoint.dir, or restore them")
    return None


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
    if path.is_file() or (path / META_FILE).is_file():
        if problem := damage(path):
            try:
                intact = newest_intact(path.parent)
            except UserError:
                intact = None
            instead = f"; the newest intact checkpoint beside it is {intact}: --resume {intact}" if intact else ""
            raise UserError(f"--resume {spec} cannot be resumed: {problem}{instead}")
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
