"""The run folder's file operations: atomic writes and the up-front check that a folder can be written.

Free of torch, so the CLI can refuse a bad output folder before anything heavy is imported.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from clbench.errors import ConfigError


def write_atomic(path: Path, data: bytes | str) -> None:
    """Write via a temporary file in the same folder and rename, so readers never see a partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def check_writable(folder: Path) -> None:
    """Refuse an output folder that cannot be written (a file in the way, no permission, a full disk) before any
    work starts; creates it otherwise."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        write_atomic(folder / ".clbench_write_test", b"")
        (folder / ".clbench_write_test").unlink()
    except OSError as err:
        raise ConfigError(
            f"Cannot write in the output folder {folder} ({type(err).__name__}: {err.strerror or err}). "
            "Choose another with hydra.run.dir=PATH (hydra.sweep.dir=PATH for -m), or free space there."
        ) from None
