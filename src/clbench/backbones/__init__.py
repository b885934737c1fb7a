"""timm Vision Transformers built headless (``num_classes=0``): methods own their heads."""

from clbench.backbones.timm_vit import build_backbone, input_stats, sha256, weights_file

__all__ = ["build_backbone", "input_stats", "sha256", "weights_file"]
