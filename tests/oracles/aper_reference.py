"""An independent, plain-PyTorch reference ("oracle") of APER's classifier, transcribed from the official code
zhoudw-zdw/RevisitingCIL@a2e6b71 (models/aper_adapter.py ``replace_fc`` L39-64; utils/inc_net.py
``MultiBranchCosineIncrementalNet.forward`` L611-626 and ``update_fc`` L592-604; convs/linears.py ``CosineLinear``
L116-138). No clbench code.

    features = cat([branch_0(x), branch_1(x)], 1)        (pretrained, adapted; no normalisation per branch)
    fc.weight[c] = mean of features over class c's training images (only the task's new classes; others kept)
    logits = sigma · normalize(features) @ normalize(fc.weight)^T
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def multibranch_features(branches: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(branches, 1)


def update_fc(weight: torch.Tensor | None, nb_classes: int, dim: int) -> torch.Tensor:
    """The grown head: the old rows, then zero rows for the new classes (a first head: CosineLinear's U(-1/sqrt(d),
    1/sqrt(d)), here zeros: every row is replaced before it is read)."""
    old = weight if weight is not None else torch.zeros(0, dim, dtype=torch.float64)
    return torch.cat([old, torch.zeros(nb_classes - len(old), dim, dtype=old.dtype)])


def replace_fc(weight: torch.Tensor, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Row c of the head = the mean embedding of class c, for every class among ``labels``."""
    weight = weight.clone()
    for class_index in torch.unique(labels):
        data_index = (labels == class_index).nonzero().squeeze(-1)
        weight[class_index] = embeddings[data_index].mean(0)
    return weight


def cosine_logits(features: torch.Tensor, weight: torch.Tensor, sigma: float = 1.0) -> torch.Tensor:
    return sigma * F.linear(F.normalize(features, p=2, dim=1), F.normalize(weight, p=2, dim=1))
