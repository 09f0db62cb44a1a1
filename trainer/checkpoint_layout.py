"""Where checkpoints live on disk and which one a run resumes from; importable without torch, so the supervisor can
reject a bad `--resume` before it starts any rank.

    <checkpoint.dir>/step_000500/   one complete checkpoint (it has its meta.json: folders appear complete, by rename)
    <checkpoint.dir>/.tmp-step_…    a save in progress, or one a killed process left (removed by the next save)
    <checkpoint.dir>/.old-…         an older folder of the same name, set aside while its replacement is renamed in
"""

from __future__ import annotations

from pathlib import Path

from trainer.config import Config
from trainer.errors import UserError

STEP_PREFIX = "step_"
TMP_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"
META_FILE = "meta.json"


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


def find_resume(cfg: Config) -> Path | None:
    """The checkpoint `checkpoint.resume` asks for: None (fresh start), "auto" (the latest, if any) or a path: a
    checkpoint folder, a `.pt` file, or a folder holding checkpoints (its latest)."""
    spec = cfg.checkpoint.resume
    if spec is None:
        return None
    if spec == "auto":
        return latest_checkpoint(Path(cfg.checkpoint.dir))
    path = Path(spec)
    if path.is_file() or (path / META_FILE).is_file():
        return path
    latest = latest_checkpoint(path) if path.is_dir() else None
    if latest is None:
        what = "no such file or folder" if not path.exists() else "no checkpoint there"
        raise UserError(f"--resume {spec}: {what}; give a step_<n> checkpoint folder, a folder holding them, a .pt "
                        f"file, or auto")
    return latest
