"""An OSError about a path the config names, as the user's error: one line naming the setting, the path and the OS's
reason, wherever the path is first used (a stat, a listing, a mkdir), instead of a traceback from that place.

What the OS says of a path itself (a name longer than the file system allows, a file where a folder should be, no
permission) is the user's to fix, not the program's; any other OSError (a disk that fails, a full one, which the
build's staging names itself) is left as it is.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from trainer.errors import UserError

PATH_ERRNOS = frozenset({errno.ENAMETOOLONG, errno.ELOOP, errno.ENOTDIR, errno.ENOENT, errno.EACCES, errno.EPERM})

Setting = tuple[str, Path]  # a config key and the path it names: ("data.cache_dir", /data/token-cache)


@contextmanager
def path_errors_named(settings: Sequence[Setting]) -> Iterator[None]:
    """Within the block, an OSError about a path becomes a UserError naming the setting (of `settings`) whose path
    holds it."""
    try:
        yield
    except OSError as e:
        if e.errno not in PATH_ERRNOS or e.filename is None:
            raise
        raise path_error(settings, e) from None


def path_error(settings: Sequence[Setting], error: OSError) -> UserError:
    """The line for `error`: the setting's own value first (what the user typed), the path the OS refused after it
    where that is deeper (a file or folder under it)."""
    path = Path(os.path.abspath(os.fsdecode(error.filename)))
    found = next(((key, value) for key, value in settings if path.is_relative_to(value.absolute())), None)
    if found is None:
        return UserError(f"cannot use {path} ({error.strerror}); check {', '.join(key for key, _ in settings)}")
    key, value = found
    at = "" if path == value.absolute() else f": {path}"
    fix = "a shorter path" if error.errno == errno.ENAMETOOLONG else "another path"
    return UserError(f"{key} {value} cannot be used ({error.strerror}{at}); set {key} to {fix}")
