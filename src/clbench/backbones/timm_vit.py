"""Build a timm ViT from a :class:`BackboneConfig`, with pretrained weights from the hub or a local file.

``pretrained=true`` asks timm for ``<model>.<tag>`` (Hugging Face hub or its local cache; honours
``HF_HUB_OFFLINE``). ``weights=PATH`` loads a local .safetensors/.pth/.npz through timm's own loader,
so the classifier is dropped and position embeddings are resampled to ``img_size`` as timm does; an
.npz is read with timm's loader for Google's original ViT checkpoints (e.g. ViT-B_16.npz, L2P's weights).
``refiner=true`` then swaps every block's attention for Refiner attention (:mod:`clbench.backbones.refiner`),
which computes the loaded ViT's attention exactly until its refinement is trained.
"""

from __future__ import annotations

from pathlib import Path

import timm
from timm.models import is_model_in_modules
from timm.models.vision_transformer import VisionTransformer

from clbench.backbones.refiner import add_refiner
from clbench.config import BackboneConfig
from clbench.errors import ConfigError, WeightsError

VIT_MODULES = ("vision_transformer", "deit")  # the timm modules whose models are VisionTransformers


def build_backbone(cfg: BackboneConfig) -> VisionTransformer:
    """The configured ViT without a classifier; raises a clear error when weights cannot be had."""
    name = f"{cfg.model}.{cfg.tag}" if cfg.tag else cfg.model
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
    if cfg.weights:
        path = Path(cfg.weights).expanduser()
        if not path.is_file():
            raise WeightsError(f"backbone.weights={str(path)!r} does not exist or is not a file.")
        overlay = dict(file=str(path), custom_load=path.suffix == ".npz")
        try:
            model = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=overlay, **kwargs)
        except Exception as err:
            raise WeightsError(
                f"Could not load backbone weights from {path} into {name} ({type(err).__name__}: {err}). "
                "Check that the file is complete and holds weights for this architecture."
            ) from None
    elif cfg.pretrained:
        try:
            model = timm.create_model(name, pretrained=True, **kwargs)
        except Exception as err:
            raise WeightsError(
                f"Could not load the pretrained weights of {name} ({type(err).__name__}: {err}). "
                "Offline (or with HF_HUB_OFFLINE=1) timm can only use weights already in the Hugging Face cache: "
                "download them once on a machine with network, or pass a local file with backbone.weights=PATH."
            ) from None
    else:
        model = timm.create_model(name, pretrained=False, **kwargs)
    if cfg.refiner:
        add_refiner(model, cfg.refiner_expand, cfg.refiner_kernel)
    return model


def input_stats(model: VisionTransformer, cfg: BackboneConfig) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The mean/std the weights expect, or identity statistics (pixels in [0, 1]) when not normalising."""
    if not cfg.normalize:
        return (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
    pretrained_cfg = model.pretrained_cfg or {}
    return tuple(pretrained_cfg.get("mean", (0.5,) * 3)), tuple(pretrained_cfg.get("std", (0.5,) * 3))
