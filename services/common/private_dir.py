"""A private per-run folder (0700) under the temp dir, for secrets that must not outlive the run.

Lifecycle: `PrivateRunDir(prefix)` first removes the folders of earlier runs whose owner died
without cleaning up (SIGKILL, OOM: their private keys and passwords would otherwise stay on disk
for good), then makes its own and writes the owner's pid into it; `close()` removes it. A folder
counts as abandoned only when its pid file names a process that no longer exists; one without a
pid file, or whose pid is alive (even reused by another process), is left alone.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

OWNER_FILE = "owner.pid"


def _owner_alive(folder: Path) -> bool:
    try:
        pid = int((folder / OWNER_FILE).read_text())
    except (OSError, ValueError):
        return True  # not ours to judge: no (readable) pid file
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, another user's
    return True


def remove_abandoned(prefix: str, root: str | None = None) -> list[Path]:
    """Remove `root`/`prefix`* folders of this user whose owner process is gone."""
    removed = []
    for folder in Path(root or tempfile.gettempdir()).glob(f"{prefix}*"):
        try:
            mine = folder.is_dir() and not folder.is_symlink() and \
                folder.stat().st_uid == os.getuid()
        except OSError:
            continue
        if mine and not _owner_alive(folder):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


class PrivateRunDir:
    def __init__(self, prefix: str, root: str | None = None):
        remove_abandoned(prefix, root)
        self._tmp = tempfile.TemporaryDirectory(prefix=prefix, dir=root)
        self.path = self._tmp.name
        (Path(self.path) / OWNER_FILE).write_text(str(os.getpid()))

    def close(self) -> None:
        self._tmp.cleanup()
