"""What a number was measured with: library versions, the device, and the clbench commit (results.json's
``versions``, ``git_commit`` and ``git_dirty``), so that two runs that differ only there can be told apart."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch

PACKAGES = ("timm", "hydra-core", "omegaconf", "numpy")


def package_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def device_name(device: torch.device) -> str:
    """The GPU's name (``NVIDIA H100 80GB HBM3``), or the CPU's architecture and core count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.machine()}, {os.cpu_count()} cores)"


def versions(device: torch.device) -> dict[str, Any]:
    """Python, clbench and the libraries that shape the numbers; CUDA and cuDNN where the run uses them."""
    from clbench import __version__

    cuda = device.type == "cuda"
    return {
        "python": platform.python_version(),
        "clbench": __version__,
        "torch": torch.__version__,  # with its build tag (2.5.1+cu124), which the package metadata leaves out
        **{name: package_version(name) for name in PACKAGES},
        "cuda": torch.version.cuda if cuda else None,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "device": device_name(device),
    }


SOURCE = Path(__file__).resolve().parent


def git_state(source: Path = SOURCE) -> tuple[str | None, bool | None]:
    """The commit of the checkout clbench is imported from, and whether its tracked files differ from it; (None,
    None) for an installed wheel or where git is absent."""

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=source, capture_output=True, text=True, timeout=10, check=True)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip()

    commit = git("rev-parse", "HEAD")
    if not commit:
        return None, None
    return commit, bool(git("status", "--porcelain", "--untracked-files=no"))
