"""Before any work: every dataset and weights file a run needs that is not there, named in one message.

Each reader would otherwise stop at the first missing file, one run per missing dataset, and timm would retry an
unreachable hub for a minute before saying the weights are missing. This looks only at presence (the readers check
checksums and contents as they load), asks the network nothing but whether the hub answers at all (a few seconds),
and skips what ``data.download=true`` will fetch.
"""

from __future__ import annotations

import socket
import threading
from pathlib import Path
from urllib.parse import urlparse

from clbench.config import BackboneConfig, DataConfig
from clbench.data.catalog import dataset_files
from clbench.data.sources import BUILT_IN, own_split, reads_folder
from clbench.errors import DataError

PROBE_TIMEOUT_S = 3.0  # how long the hub may take to accept a connection before it counts as unreachable
MADE_WITHOUT_FILES = ("digits", "synthetic")


def needed_datasets(cfg: DataConfig) -> list[str]:
    """The datasets (source names or folders under ``data.root``) a benchmark reads, in the order it reads them."""
    if cfg.source == "sequence":
        return list(cfg.datasets)
    name = cfg.folder if cfg.source == "image_folder" else cfg.source
    return [] if name in MADE_WITHOUT_FILES or name is None else [name]


Status = tuple[bool, str]  # whether a prerequisite is there (or will be fetched), and a line saying so


def missing_paths(name: str, cfg: DataConfig, root: Path) -> list[Path]:
    """The paths of dataset ``name`` that are not there: none when it can be read (an image folder, one that stands
    in for a built-in layout, a built-in layout, or one ``data.download=true`` fetches)."""
    files = dataset_files(name, cfg.protocol)
    folder = root / name
    if cfg.source == "image_folder" and cfg.folder_split == "own":  # the split archive's own train/ and test/
        return [] if own_split(folder) else [p for p in (folder / "train", folder / "test") if not p.is_dir()]
    if reads_folder(name, cfg) and folder.is_dir():
        return []
    if name in BUILT_IN and (files.present(root) or (cfg.download and files.downloads)):
        return []
    return [root / path for path in files.needs if not (root / path).exists()] or [folder]


def datasets_status(cfg: DataConfig) -> list[Status]:
    """For each dataset the benchmark reads: on disk, fetched by ``data.download=true``, or missing (every missing
    path, the layout, the archive and where it comes from)."""
    root = Path(cfg.root).expanduser().resolve()
    lines = []
    for name in dict.fromkeys(needed_datasets(cfg)):
        files = dataset_files(name, cfg.protocol)
        missing = missing_paths(name, cfg, root)
        if not missing:
            fetched = name in BUILT_IN and not files.present(root) and not reads_folder(name, cfg)
            there = f"fetched into {root} by data.download=true" if fetched else f"in {root}/{files.layout}"
            lines.append((True, f"{name}: {files.title} ({files.size}), {there}"))
            continue
        if files.archive:
            fetch = f"Get {files.archive} (MD5 {files.md5}) from {files.url} and extract it into {root}"
        else:
            how = "or run with data.download=true" if files.downloads else "and copy it there (data.download cannot)"
            fetch = f"Get it from {files.url} {how}"
        where = f"expected as {root}/{files.layout}; missing: {', '.join(map(str, missing))}"
        lines.append((False, f"{name}: {files.title} ({files.size}), {where}. {fetch}."))
    return lines


def missing_datasets(cfg: DataConfig) -> list[str]:
    """One line for each dataset that is neither on disk nor fetched by ``data.download=true``."""
    return [line for there, line in datasets_status(cfg) if not there]


def hub_reachable(url: str, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether ``url``'s host accepts a TCP connection within ``timeout`` seconds (a DNS look-up that hangs counts as
    no: it runs in a thread given up on at the deadline)."""
    host = urlparse(url).hostname
    if not host:
        return False
    answer: list[bool] = []

    def connect() -> None:
        try:
            socket.create_connection((host, 443), timeout=timeout).close()
            answer.append(True)
        except OSError:
            answer.append(False)

    probe = threading.Thread(target=connect, daemon=True)
    probe.start()
    probe.join(timeout)
    return bool(answer and answer[0])


def weights_status(cfg: BackboneConfig) -> Status:
    """Where the backbone's weights come from (a local or shipped file, the hub's cache, the hub, none: a random
    initialisation), or why they cannot be had: a file that does not exist, or hub weights in no local cache while the
    hub cannot be reached (``HF_HUB_OFFLINE=1``, or no network)."""
    from clbench.backbones.timm_vit import SHIPPED_WEIGHTS, local_weights

    local = local_weights(cfg)
    if local is None and not (cfg.pretrained and cfg.tag not in SHIPPED_WEIGHTS):
        return True, f"none: {cfg.name} starts from a random initialisation (backbone.pretrained=false)"
    if local is None:
        return hub_weights(cfg)
    if local.is_file():
        return True, f"the file {local}"
    if cfg.weights:
        return False, f"backbone.weights={cfg.weights}: no such file. Point backbone.weights at the checkpoint."
    return False, f"The shipped weights {local} are missing: run `make weights` to regenerate them."


def missing_weights(cfg: BackboneConfig) -> list[str]:
    """One line if the backbone's weights cannot be had (:func:`weights_status`)."""
    there, line = weights_status(cfg)
    return [] if there else [line]


def hub_weights(cfg: BackboneConfig) -> Status:
    """:func:`weights_status` for weights timm downloads (the Hugging Face hub, or a URL)."""
    import timm
    from huggingface_hub import constants

    from clbench.backbones.timm_vit import cached_download

    name = f"{cfg.model}.{cfg.tag}" if cfg.tag else cfg.model
    try:
        source = timm.models.get_pretrained_cfg(name).to_dict()
    except Exception:  # an unknown model or tag: build_backbone refuses it with the allowed names
        return True, f"{name}: not a pretrained config timm knows (the run refuses it with the allowed names)"
    url = constants.ENDPOINT if source.get("hf_hub_id") else str(source.get("url") or "")
    cached = cached_download(source)
    if cached is not None:
        return True, f"{name}, in the local cache: {cached}"
    if not constants.HF_HUB_OFFLINE and hub_reachable(url):
        return True, f"{name}, downloaded from {urlparse(url).hostname} when the run starts"
    why = "HF_HUB_OFFLINE=1" if constants.HF_HUB_OFFLINE else f"{urlparse(url).hostname} cannot be reached"
    return False, (
        f"Pretrained weights {name} (backbone.tag={cfg.tag}): not in the local cache, and {why}. Download them once "
        f"where there is network (python -c \"import timm; timm.create_model('{name}', pretrained=True)\") or pass a "
        "local file: backbone.weights=PATH (.safetensors, .pth or .npz)."
    )


def check_prerequisites(data: DataConfig, backbone: BackboneConfig) -> None:
    """Raise one :class:`DataError` listing every missing dataset and weights file, before any work starts."""
    lines = missing_datasets(data) + missing_weights(backbone)
    if lines:
        count = f"{len(lines)} prerequisites are" if len(lines) > 1 else "a prerequisite is"
        where = "Data lives under data.root (or the CLBENCH_DATA environment variable that presets read)."
        raise DataError(f"{count} missing; nothing was started. {where}\n" + "\n".join(f"  - {x}" for x in lines))
