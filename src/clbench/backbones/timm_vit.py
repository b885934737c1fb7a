"""Build a timm ViT from a :class:`BackboneConfig`, with pretrained weights from the hub or a local file.

``pretrained=true`` asks timm for ``<model>.<tag>`` (Hugging Face hub or its local cache; honours
``HF_HUB_OFFLINE``). ``weights=PATH`` loads a local .safetensors/.pth/.npz through timm's own loader,
so the classifier is dropped and position embeddings are resampled to ``img_size`` as timm does; an
.npz is read with timm's loader for Google's original ViT checkpoints (e.g. ViT-B_16.npz, L2P's weights).
``pretrained=true`` with a tag clbench ships (``SHIPPED_WEIGHTS``: ``glyphs``, the micro ViT pretrained on
procedural stroke glyphs by ``make weights``) loads that file from the package, no network needed.
``refiner=true`` then swaps every block's attention for Refiner attention (:mod:`clbench.backbones.refiner`),
which computes the loaded ViT's attention exactly until its refinement is trained.
:func:`weights_file` names the file a config loads, so that a run records its SHA-256.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

import timm
import torch
from timm.models import is_model_in_modules, load_state_dict
from timm.models.vision_transformer import VisionTransformer, checkpoint_filter_fn

from clbench.backbones.refiner import add_refiner
from clbench.config import BackboneConfig
from clbench.errors import ConfigError, WeightsError

log = logging.getLogger(__name__)
VIT_MODULES = ("vision_transformer", "deit")  # the timm modules whose models are VisionTransformers
WEIGHTS_DIR = Path(__file__).resolve().parent.parent / "weights"
SHIPPED_WEIGHTS = {"glyphs": "vit_micro.glyphs.safetensors"}  # tag -> file in clbench/weights (`make weights`)
# The SHA-256 of each shipped file as `make weights` writes it (bit for bit): a copy damaged in place is refused.
SHIPPED_SHA256 = {"vit_micro.glyphs.safetensors": "643dbcc7e3056c6a22cc82e5c7a1e89b0b5edc6273ce2a70e7e9a3815eb7a7f3"}


def local_weights(cfg: BackboneConfig) -> Path | None:
    """The local file a config loads: ``weights`` if set, else the shipped file of a ``pretrained`` shipped tag."""
    if cfg.weights:
        return Path(cfg.weights).expanduser()
    if cfg.pretrained and cfg.tag in SHIPPED_WEIGHTS:
        return WEIGHTS_DIR / SHIPPED_WEIGHTS[cfg.tag]
    return None


def weights_file(cfg: BackboneConfig, model: VisionTransformer) -> Path | None:
    """The file the backbone's weights were loaded from (local, shipped, or the hub's cached copy); None for a
    random initialisation or a hub file that cannot be located."""
    local = local_weights(cfg)
    if local is not None or not cfg.pretrained:
        return local
    return cached_download(model.pretrained_cfg or {})


def cached_download(source: dict[str, Any]) -> Path | None:
    """Where timm's download of a pretrained config (``model.pretrained_cfg``) sits in the local cache, if it does:
    the Hugging Face hub's cache for a hub id, else torch.hub's for a URL."""
    if source.get("hf_hub_id"):
        from huggingface_hub import try_to_load_from_cache

        named = source.get("hf_hub_filename")  # timm's own choice where the config names one
        for filename in (named,) if named else ("model.safetensors", "pytorch_model.bin"):
            found = try_to_load_from_cache(source["hf_hub_id"], filename)
            if isinstance(found, str):
                return Path(found)
    if source.get("url"):
        cached = Path(torch.hub.get_dir()) / "checkpoints" / Path(source["url"]).name
        return cached if cached.is_file() else None
    return None


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def require_tag(cfg: BackboneConfig) -> None:
    """Weights are named exactly, by model and tag: timm resolves a bare name (or a deprecated alias such as
    ``vit_base_patch16_224_in21k``) to whichever tag its version makes the default, and that has changed between
    versions (the ``_in21k`` weights went from Google's original to AugReg's). A tag inside ``model`` belongs in
    ``backbone.tag``. Refused before any work, naming the tags to choose from. A local file (``backbone.weights``)
    is its own name (its SHA-256 is recorded); without a tag, timm's default tag gives only its input statistics,
    which results.json records (``backbone_config.timm_tag``, ``input_mean``, ``input_std``)."""
    import timm.models

    model, _, tag_in_name = cfg.model.partition(".")
    deprecated = timm.models.get_deprecated_models().get(cfg.model)
    if tag_in_name or deprecated:
        now = deprecated or cfg.model
        name, _, tag = now.partition(".")
        raise ConfigError(
            f"Invalid value for `backbone.model`: {cfg.model!r} names its weights by "
            + ("a deprecated alias timm resolves to " if deprecated else "a tag inside the model name, ")
            + f"{now}. Allowed: backbone.model={name} with backbone.tag={tag or '<a tag>'}."
        )
    if cfg.tag is None and cfg.pretrained and not cfg.weights and timm.is_model(model):
        tags = [t.partition(".")[2] for t in timm.models.list_pretrained(f"{model}.*")]
        default = getattr(timm.models.get_pretrained_cfg(model), "tag", None)
        raise ConfigError(
            f"Invalid value for `backbone.tag`: None with backbone.pretrained=true: timm would resolve {model} to its "
            f"current default tag ({default}), which differs between timm versions. Allowed: the tag of the weights, "
            f"one of {', '.join(tags) or '(none: this model has no pretrained weights)'}."
        )


def build_backbone(cfg: BackboneConfig) -> VisionTransformer:
    """The configured ViT without a classifier; raises a clear error when weights cannot be had or are not named
    exactly (:func:`require_tag`)."""
    require_tag(cfg)
    shipped = cfg.tag in SHIPPED_WEIGHTS  # clbench's tag, not timm's: the architecture is the bare model
    name = f"{cfg.model}.{cfg.tag}" if cfg.tag and not shipped else cfg.model
    if not timm.is_model(cfg.model):
        raise ConfigError(
            f"Invalid value for `backbone.model`: {cfg.model!r} is not a timm model. "
            "Allowed: a name from timm.list_models('vit_*'), e.g. vit_base_patch16_224."
        )
    if not is_model_in_modules(cfg.model, VIT_MODULES):
        raise ConfigError(
            f"Invalid value for `backbone.model`: {cfg.model!r} is not a plain Vision Transformer. "
            "Allowed: timm models of the vision_transformer and deit families (vit_*, deit_*)."
        )
    kwargs = dict(num_classes=0, img_size=cfg.img_size, drop_path_rate=cfg.drop_path_rate, **cfg.kwargs)
    path = local_weights(cfg)
    if path is not None:
        if not path.is_file():
            hint = "run `make weights` to regenerate the shipped file" if not cfg.weights else "check the path"
            raise WeightsError(f"The backbone weights file {str(path)!r} does not exist or is not a file: {hint}.")
        if not cfg.weights:
            check_shipped(path)
        overlay = dict(file=str(path), custom_load=path.suffix == ".npz")
        try:
            model = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=overlay, **kwargs)
        except Exception as err:
            architecture(name, cfg, kwargs)  # kwargs that build no model are the config's error, not the file's
            raise WeightsError(
                f"Could not load backbone weights from {path} into {name} ({type(err).__name__}: {err}). "
                "Check that the file is complete and holds weights for this architecture."
            ) from None
        if path.suffix != ".npz":  # timm's .npz reader looks every weight up by name: it cannot skip one
            check_keys(model, path)
    elif cfg.pretrained:
        try:
            model = timm.create_model(name, pretrained=True, **kwargs)
        except Exception as err:
            architecture(name, cfg, kwargs)
            raise WeightsError(
                f"Could not load the pretrained weights of {name} ({type(err).__name__}: {err}). "
                "Offline (or with HF_HUB_OFFLINE=1) timm can only use weights already in the Hugging Face cache: "
                "download them once on a machine with network, or pass a local file with backbone.weights=PATH."
            ) from None
    else:
        model = architecture(name, cfg, kwargs)
    patch = model.patch_embed.patch_size[0]
    if cfg.img_size % patch:
        raise ConfigError(
            f"Invalid value for `backbone.img_size`: {cfg.img_size}. Allowed: a multiple of the patch size {patch} "
            f"(the last {cfg.img_size % patch} pixels would be cut off silently)."
        )
    if cfg.refiner:
        add_refiner(model, cfg.refiner_expand, cfg.refiner_kernel)
    return model


def architecture(name: str, cfg: BackboneConfig, kwargs: dict[str, Any]) -> VisionTransformer:
    """The model without pretrained weights; kwargs timm cannot build a model from are a :class:`ConfigError`."""
    try:
        return timm.create_model(name, pretrained=False, **kwargs)
    except (AssertionError, ValueError, TypeError, RuntimeError) as err:
        raise ConfigError(
            f"Invalid value for `backbone.kwargs`: {dict(cfg.kwargs)} do not build a {cfg.model} "
            f"({type(err).__name__}: {err or 'a timm assertion failed'}). Allowed: an embed_dim divisible by "
            "num_heads, and keyword arguments timm's VisionTransformer takes."
        ) from None


def check_shipped(path: Path) -> None:
    """A file clbench ships must be the one it shipped: a copy changed in place would train on other weights."""
    expected = SHIPPED_SHA256.get(path.name)
    found = sha256(path)
    if expected is not None and found != expected:
        raise WeightsError(
            f"The shipped weights file {path} is damaged: its SHA-256 is {found}, the file clbench ships has "
            f"{expected}. Reinstall clbench, or regenerate the file bit for bit with `make weights`."
        )


def check_keys(model: VisionTransformer, path: Path) -> None:
    """Strict loading: timm loads a headless model with ``strict=False`` (it drops the classifier), so a file whose
    keys belong to another network would leave the ViT random without an error. The file's state dict, adapted as
    timm adapts it (:func:`checkpoint_filter_fn`: position embeddings resampled, layouts converted), must hold every
    weight of the model and nothing else but a classifier; timm's adaptations are logged."""
    raw = load_state_dict(str(path))
    state = checkpoint_filter_fn(dict(raw), model)
    expected = set(model.state_dict())
    head = {k for k in state if k.split(".")[0] in ("head", "fc", "classifier", "head_dist")}
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected - head)
    if missing or unexpected:
        listed = [f"missing {len(missing)}: {', '.join(missing[:8])}" if missing else ""]
        listed += [f"unexpected {len(unexpected)}: {', '.join(unexpected[:8])}" if unexpected else ""]
        raise WeightsError(
            f"The backbone weights file {path} does not fit {model.default_cfg.get('architecture', 'the model')} "
            f"({'; '.join(x for x in listed if x)}). Check backbone.model and backbone.kwargs against the file, or "
            "pass the file written for this architecture."
        )
    if head:
        log.info("%s: classifier %s dropped (clbench adds its own heads)", path, ", ".join(sorted(head)))
    stored = raw.get("pos_embed")
    if stored is not None and stored.shape != model.pos_embed.shape:
        log.info(
            "%s: position embeddings resampled from %s to %s", path, tuple(stored.shape), tuple(model.pos_embed.shape)
        )


def input_stats(model: VisionTransformer, cfg: BackboneConfig) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The mean/std the weights expect (or ``backbone.input_mean``/``input_std`` where given), or identity statistics
    (pixels in [0, 1]) when not normalising."""
    if not cfg.normalize:
        return (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
    if cfg.input_mean is not None and cfg.input_std is not None:
        return tuple(cfg.input_mean), tuple(cfg.input_std)
    pretrained_cfg = model.pretrained_cfg or {}
    return tuple(pretrained_cfg.get("mean", (0.5,) * 3)), tuple(pretrained_cfg.get("std", (0.5,) * 3))
