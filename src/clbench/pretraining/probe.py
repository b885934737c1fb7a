"""`python -m clbench.pretraining.probe`: how well a backbone's frozen features transfer, per task of a benchmark.

A linear probe (scikit-learn's logistic regression) is fitted on the frozen pooled features of each task's training
images (test-time transform, no augmentation) and scored on the task's test images: the task-incremental accuracy
a linear head could reach without touching the backbone. Comparing ``backbone.pretrained=true`` with ``false``
measures what pretraining brings to the frozen-backbone methods (L2P, MEAT, Piggyback, SupSup).
"""

from __future__ import annotations

import argparse

import torch
from sklearn.linear_model import LogisticRegression

from clbench.config import RunConfig
from clbench.data import Split
from clbench.loop.runtime import build_runtime


@torch.no_grad()
def frozen_features(cfg: RunConfig) -> list[tuple[torch.Tensor, ...]]:
    """(train features, train labels, test features, test labels) of every task, from the frozen backbone."""
    method, rt = build_runtime(cfg)
    vit = method.backbone.eval()

    def features(split: Split) -> torch.Tensor:
        return torch.cat(
            [vit.forward_head(vit.forward_features(rt.test_tf(x)), pre_logits=True) for x, _ in split.batches(256)]
        )

    return [
        (features(train), train.y, features(test), test.y)
        for train, test in zip(rt.benchmark.train, rt.benchmark.test, strict=True)
    ]


def linear_probe(cfg: RunConfig) -> list[float]:
    """Per task: % test accuracy of a logistic regression on the frozen features of the task's training images."""
    accuracies = []
    for x_tr, y_tr, x_te, y_te in frozen_features(cfg):
        probe = LogisticRegression(max_iter=2000).fit(x_tr.cpu().numpy(), y_tr.cpu().numpy())
        accuracies.append(100.0 * probe.score(x_te.cpu().numpy(), y_te.cpu().numpy()))
    return accuracies


def main() -> None:
    from hydra import compose, initialize_config_dir

    from clbench.config import config_dir, validate

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="clbench overrides, e.g. data=digits_5tasks backbone=vit_micro")
    args = parser.parse_args()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        for pretrained in (True, False):
            overrides = [*args.overrides, f"backbone.pretrained={str(pretrained).lower()}", "logger.mode=disabled"]
            acc = linear_probe(validate(compose("config", overrides=overrides)))
            label = "pretrained" if pretrained else "random init"
            print(f"{label:>12}: mean {sum(acc) / len(acc):.1f}%  per task {[round(a, 1) for a in acc]}")


if __name__ == "__main__":
    main()
