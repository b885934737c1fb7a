"""A split archive's MD5, checked where the archive lies in ``data.root`` (Protocol P: the maintainers publish the
MD5 of each zip, not of the extracted files). A matching archive is stamped (its size, times and inode, as the image
cache stamps its arrays) in the cache folder, so a 10 GB zip is hashed once, not at every start; an archive that is
absent is not asked for (the extracted folder is what runs read, and results.json records its file list's SHA-256).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path

from clbench.config import DataConfig
from clbench.data.catalog import DatasetFiles
from clbench.data.checksums import signature
from clbench.files import write_atomic

STAMP = "verified-archives.json"


def md5(path: Path) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_archive(files: DatasetFiles, cfg: DataConfig, stamps: Path) -> str | None:
    """Whether the archive of ``files`` in ``data.root``, if it is there, is the maintainers' (its MD5); the problem
    as a message, or None. ``stamps``: the folder of the stamp file (the image cache's root)."""
    if not files.archive or not files.md5 or not cfg.verify_checksums:
        return None
    path = Path(cfg.root).expanduser() / files.archive
    if not path.is_file():
        return None
    try:
        stamped = json.loads((stamps / STAMP).read_text())
    except (OSError, ValueError):
        stamped = {}
    key = str(path.resolve())
    if stamped.get(key) == [files.md5, *signature(path)]:
        return None
    found = md5(path)
    if found != files.md5:
        return (
            f"The archive {path} is not the one its maintainers published (MD5 {found}, published {files.md5}): a "
            f"damaged or different download, so the folder extracted from it may hold another split. Download "
            f"{files.archive} again from {files.url} and extract it; data.verify_checksums=false accepts it as it is."
        )
    with contextlib.suppress(OSError):  # a cache root that cannot be written: checked again at the next start
        stamps.mkdir(parents=True, exist_ok=True)
        write_atomic(stamps / STAMP, json.dumps({**stamped, key: [files.md5, *signature(path)]}))
    return None
