"""Files replaced in one step: written beside their final name, then renamed over it, so a reader
(or a resume after a kill) sees the old file or the new one, never half of one. A rename within a
folder is atomic on POSIX filesystems (and on NFS for a single client)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


@contextlib.contextmanager
def replacing(path: Path, durable: bool = False):
    """Yields a temporary path in `path`'s folder (hidden, unique to this process) for
    the caller to write; when the block ends without an error the file replaces `path`, else it is
    removed and `path` is left as it was. `durable`: fsync the file before the rename, so that after
    a power loss the name never points to a file whose blocks were not written yet."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # no glob for the final name matches it
    try:
        yield tmp
        if durable:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(path: Path, text: str, durable: bool = False) -> None:
    with replacing(path, durable) as tmp:
        Path(tmp).write_text(text)
