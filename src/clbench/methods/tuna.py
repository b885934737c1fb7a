"""TUNA, Task-specific and UNiversal Adapters (Wang, Zhou, Ye, ICCV 2025): an AdaptFormer adapter set per task on the
frozen pretrained ViT, trained with CosFace on bias-free cosine heads and kept apart from the earlier sets by an
orthogonality term; after each task a universal adapter merged from every task's (EMR), the heads aligned on class
Gaussians; a test image scored by the task adapter of least entropy together with the universal one. Official code:
the upstream commit 77d4f10 read through the fork Ngahoang2005/ICCV2025-TUNA (models/tuna.py, backbone/vit_tuna.py,
backbone/linears.py L13-62, exps/tuna_*.json, logs/tuna/*).

Task t (tuna.py ``_train`` L128-140, ``_init_train`` L178-216):

- Train: adapter set A_t (task 0: fresh, W_up = 0; later: a copy of A_{t-1}, the code's ``cur_adapter`` never being
  re-initialised, vit_tuna.py L344-353) and the task's head, a bias-free Linear(d, C_t) drawn N(0, 0.02) truncated
  whose logits are cos(phi_t(x), w_c) (linears.py L13-62). Loss: CosFace over the task's classes,
  -log(e^{s(c_y - m)} / (e^{s(c_y - m)} + sum_{k != y} e^{s c_k})) with s = ``scale`` 20 and m = ``margin``
  (L17-53, L190); from the second task, with ``use_orth``, plus reg e^{-(t+1)} sum_{i<t} (1/L) sum_l
  |mean_{a,b} <u_a^{t,l}, u_b^{i,l}>|, u_a^{i,l} the unit rows of block l's up-projection of A_i (L192-193,
  L217-233): the absolute value of the mean cosine, not the mean of absolute cosines.
- Statistics (an observe pass, test transform): every new class's mean and covariance of phi_t, + 1e-4 I (L234-266).
- Universal adapter (t >= 1, ``merge`` vit_tuna.py L382-397 with ``emr_merge`` L82-114): every scalar of every tensor
  merged over A_0 .. A_t (raw values): g = +1 if their mean is > 0 else -1, the merged value g max{|theta_i| :
  sign(theta_i) = g} (0 if none agrees).
- Classifier alignment (t >= 1, L269-354): every head on samples of the class Gaussians, CE of s cos over the seen
  classes (:class:`~clbench.methods.parts.gaussian_alignment.GaussianAligner`).

Prediction (``_eval_cnn`` L376-423): after task 0 the cosines through A_0. After task t >= 1, l_i = s cos(phi_i(x), w)
over the seen classes for every task adapter i; i* the one whose softmax has the least entropy (per image; ties: the
lowest i); l_u the same through the universal adapter; the score softmax(l_u) + softmax(l_{i*}). t + 2 ViT forwards.
TIL: the task's own adapter and head, one forward.

The official code departs from that description in five places, each an option whose other value is the code's
(results.json ``tuna`` records them):

- ``universal``: the code's universal pass (``adapter_id = t + 1``) runs ``cur_adapter``, i.e. A_t, not the merged
  adapter, which it builds and never uses (vit_tuna.py L418-424): ``last`` (t + 1 forwards: A_t's are reused) | ``emr``.
- ``freeze_old_adapters``: the code's optimizer holds every adapter tensor (L142-147) and the orthogonality term is not
  detached, so the stored sets' up-projections take its gradient and weight decay in every later task: ``false`` |
  ``true`` (stored sets frozen).
- ``decay_old_heads``: the code's optimizer holds every head (L145-146, ``update(freeze_old=False)``) and its loss takes
  the cosines of all of them (L188-190), so the earlier heads get a zero gradient and shrink under weight decay and
  momentum through every later task (their direction, all that a cosine reads, stays; the alignment's steps on them
  grow as 1 / |w|^2): ``true`` | ``false`` (trained in their task and the alignment only).
- ``alignment.mean_shrink``: the code's ``decay`` takes the task size with a negative sign (L281, L291-296), shrinking
  the newest classes' means most: ``tuna_code`` | ``slca`` | ``none``.
- ``alignment.cosine_epochs``: the code's alignment cosine has T_max = 5 whatever ``crct_epochs`` (L278), so the lr
  returns to its start every 10 epochs: ``5`` | null (one cosine over the alignment).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from clbench.config import require, require_choice
from clbench.data import Benchmark, Split, Task
from clbench.methods.adapter_set_learner import AdapterSetLearner
from clbench.methods.base import Logs, Phase
from clbench.methods.first_session import vit_features
from clbench.methods.parts.adapter_sets import AdapterSets
from clbench.methods.parts.adaptformer import AdapterConfig
from clbench.methods.parts.cosine import cosine_logits
from clbench.methods.parts.gaussian_alignment import AlignmentConfig, GaussianAligner

UNIVERSAL = 0  # the universal adapter's set; task t's adapter is set t + 1


def emr_merge(tensors: list[torch.Tensor]) -> torch.Tensor:
    """EMR's unified tensor of same-shaped ``tensors`` (vit_tuna.py ``emr_merge`` L82-107): per entry the sign g of
    their mean (+1 if > 0, else -1) and the largest magnitude among the tensors whose entry has sign g (0 if none)."""
    stacked = torch.stack(tensors)
    sign = torch.where(stacked.mean(0) > 0, 1.0, -1.0).to(stacked.dtype)
    agreeing = (stacked * sign) > 0
    return sign * (stacked.abs() * agreeing).amax(0)


def cosface(cosines: torch.Tensor, y: torch.Tensor, scale: float, margin: float) -> torch.Tensor:
    """CosFace (``AngularPenaltySMLoss`` L37-53): cross-entropy of s (cos - m [k = y]) against local labels ``y``."""
    return F.cross_entropy(scale * (cosines - margin * F.one_hot(y, cosines.shape[1])), y)


def up_projection_overlap(current: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
    """|mean_{a,b} <u_a, v_b>| of the unit rows of two up-projection weights (d x r): one block's term of the
    orthogonality loss (``orth_loss`` L225-230). The mean of the d x d Gram is the inner product of the two mean rows,
    so the Gram the code forms is never built."""
    return (F.normalize(current, dim=1).mean(0) @ F.normalize(stored, dim=1).mean(0)).abs()


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """-sum p log(p + 1e-10) of softmax(logits) per row (``_eval_cnn`` L393-394)."""
    p = F.softmax(logits.float(), dim=1)
    return -(p * torch.log(p + 1e-10)).sum(1)


def route(per_adapter: list[torch.Tensor]) -> torch.Tensor:
    """Each row's logits from the adapter whose softmax has the least entropy (torch.argmin: ties to the first)."""
    stacked = torch.stack(per_adapter)
    chosen = torch.stack([entropy(logits) for logits in per_adapter]).argmin(0)
    return stacked[chosen, torch.arange(stacked.shape[1], device=stacked.device)]


@dataclass
class TUNAConfig(AdapterConfig):
    """The adapter (r 16, s 0.1, dropout 0.1: vit_tuna.py L347-351), the loss and the options of the code's quirks."""

    bottleneck: int = 16
    scale: float = 20.0  # s of CosFace, of the alignment's and the prediction's logits (scale)
    margin: float = 0.0  # CosFace's m (m; 0.3 for ImageNet-A)
    use_orth: bool = True  # the orthogonality term from the second task on (use_orth)
    reg: float = 1e-3  # its weight, times e^{-(t+1)} (reg)
    universal: str = "emr"  # emr: the merged adapter | last: the last task's (the code's universal pass)
    freeze_old_adapters: bool = True  # false: the stored sets' up-projections go on training (the code)
    decay_old_heads: bool = False  # true: the earlier heads sit in the optimizer with zero gradient (the code)
    adapter_init: str = "continue"  # continue: task t starts from A_{t-1} (the code) | fresh: W_up = 0
    alignment: AlignmentConfig = field(default_factory=AlignmentConfig)  # TUNA's values in conf/method/tuna.yaml

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.scale > 0, "method.scale", self.scale, "> 0")
        require(0 <= self.margin < 1, "method.margin", self.margin, "in [0, 1)")
        require(self.reg >= 0, "method.reg", self.reg, ">= 0")
        require_choice("method.universal", self.universal, ("emr", "last"))
        require_choice("method.adapter_init", self.adapter_init, ("continue", "fresh"))


class TUNA(AdapterSetLearner):
    """``heads[t]``: task t's bias-free cosine head; the adapter sets live in the backbone's blocks (set 0 the
    universal adapter, set t + 1 task t's); ``aligner`` the class Gaussians."""

    Config = TUNAConfig

    def __init__(self, backbone: VisionTransformer, benchmark: Benchmark, config: TUNAConfig) -> None:
        super().__init__(backbone, benchmark, config)
        self.sets.freeze(self.sets.add())  # the universal adapter's slot, merged after every task from the second
        self.aligner = GaussianAligner(config.alignment, backbone.num_features)
        self.stage = "train"

    @classmethod
    def scores_unseen_classes(cls) -> bool:
        """No: the score is a sum of softmaxes over the seen classes."""
        return False

    @staticmethod
    def unused_keys(config: TUNAConfig) -> dict[str, str]:
        why = "method.use_orth=false (no orthogonality term: no gradient reaches a stored set)"
        out = {} if config.use_orth else dict.fromkeys(("method.reg", "method.freeze_old_adapters"), why)
        if not config.alignment.epochs:
            keys = [k for k in vars(config.alignment) if k != "epochs"]
            out |= {f"method.alignment.{k}": "method.alignment.epochs=0" for k in keys}
        return out

    # ----------------------------------------------------------------------------- lifecycle
    def task_set(self, task_id: int) -> int:
        return task_id + 1

    def new_head(self, num_classes: int) -> nn.Linear:
        """A bias-free Linear(d, C_t), N(0, 0.02) truncated (``SimpleContinualLinear.update``, linears.py L45-47)."""
        head = nn.Linear(self.backbone.num_features, num_classes, bias=False, device=self.backbone.pos_embed.device)
        with torch.no_grad():
            nn.init.trunc_normal_(head.weight, std=0.02)
        return head

    def before_task(self, task: Task) -> None:
        """The task's head, Gaussians and adapter set: a copy of the previous task's (``adapter_init=continue``)."""
        super().before_task(task)
        self.aligner.add_task(self.heads[task.id])
        carried = task.id > 0 and self.config.adapter_init == "continue"
        self.sets.add(like=len(self.sets) - 1 if carried else None)

    def phases(self, task: Task, epochs: int) -> list[Phase]:
        return [Phase("train", epochs), Phase("statistics", 1, observe=True), *self.aligner.phases(task)]

    def before_phase(self, task: Task, phase: Phase) -> None:
        self.stage = phase.name
        self.sets.select(self.task_set(task.id))  # _init_train and _compute_mean: the ViT through cur_adapter
        if phase.name == "statistics":
            self.aligner.start()
        elif phase.name == "align":
            self.aligner.settle()

    @torch.no_grad()
    def after_task(self, task: Task) -> None:
        """The statistics settled (task 0 has no alignment to settle them before), the task's set frozen, and from the
        second task the universal adapter merged from every task's (``merge``)."""
        self.aligner.settle()
        self.sets.freeze(self.task_set(task.id))
        self.sets.select(None)
        self.stage = "train"
        if task.id:
            merge_sets(self.sets, [self.task_set(i) for i in range(task.id + 1)], UNIVERSAL)

    def stored_up_projections(self, task_id: int) -> list[list[nn.Parameter]]:
        """The up-projection weights of the sets of the tasks before ``task_id``, as ``[task][block]``."""
        return [[bank.sets[self.task_set(i)].up.weight for bank in self.sets.banks] for i in range(task_id)]

    def param_groups(self, task: Task, phase: Phase) -> list[dict[str, Any]]:
        """Train: the task's adapter set and head (and, with ``freeze_old_adapters=false``, the stored sets'
        up-projections, the only stored tensors the code's optimizer moves: the orthogonality term's gradient);
        align: every head."""
        self.requires_grad_(False)
        if phase.name == "align":
            return self.aligner.param_groups(self.heads)
        heads = self.heads[: task.id + 1] if self.config.decay_old_heads else [self.heads[task.id]]
        params = [*self.sets.parameters(self.task_set(task.id)), *(p for head in heads for p in head.parameters())]
        if not self.config.freeze_old_adapters and self.config.use_orth:
            params += [w for stored in self.stored_up_projections(task.id) for w in stored]
        for p in params:
            p.requires_grad_(True)
        return [{"params": params}]

    def no_weight_decay_ids(self) -> set[int]:
        """None: the code's SGD decays every trained tensor (the adapters' biases too)."""
        return set()

    # ----------------------------------------------------------------------------- training
    def training_loss(self, x: torch.Tensor, y: torch.Tensor, task: Task) -> tuple[torch.Tensor, Logs]:
        """Train: CosFace on the task's head + the orthogonality term. Align: ``x`` are drawn features; CE of s cos over
        every seen class."""
        c = self.config
        if self.stage == "align":
            sizes = [t.num_classes for t in self.tasks[: task.id + 1]]
            return self.aligner.loss(c.scale * self.seen_logits(x.float()), y, sizes), {}
        feats = vit_features(self.backbone, x)
        if c.decay_old_heads:  # the code's cosines over every head, the task's sliced out: the rest get zero gradients
            every = torch.cat([head.weight for head in self.heads[: task.id + 1]])
            cosines = cosine_logits(feats, every)[:, task.offset :]
        else:
            cosines = cosine_logits(feats, self.heads[task.id].weight)
        loss = cosface(cosines, y - task.offset, c.scale, c.margin)
        if not (c.use_orth and task.id):
            return loss, {}
        orth = self.orthogonality(task.id)
        return loss + c.reg * math.exp(-(task.id + 1)) * orth, {"orth": orth.detach()}

    def orthogonality(self, task_id: int) -> torch.Tensor:
        """sum over the earlier sets of the mean over blocks of the up-projections' overlap (detached from the stored
        sets with ``freeze_old_adapters``)."""
        current = [bank.sets[self.task_set(task_id)].up.weight for bank in self.sets.banks]
        total = current[0].new_zeros(())
        for stored in self.stored_up_projections(task_id):
            for w, v in zip(current, stored, strict=True):
                old = v.detach() if self.config.freeze_old_adapters else v
                total = total + up_projection_overlap(w, old) / len(current)
        return total

    def drawn_split(self, task: Task, phase: Phase, epoch: int) -> Split:
        return self.aligner.draw(self.tasks, task.id, epoch)

    @torch.no_grad()
    def observe(self, x: torch.Tensor, y: torch.Tensor, task: Task, rows: torch.Tensor) -> None:
        """phi_t of the task's training images, in fp32, into the class sums."""
        with torch.autocast(x.device.type, enabled=False):
            self.aligner.observe(vit_features(self.backbone, x.float()), y - task.offset)

    def observations(self) -> list[torch.Tensor]:
        return self.aligner.observations()

    # ----------------------------------------------------------------------------- inference
    def adapter_features(self, x: torch.Tensor, k: int) -> torch.Tensor:
        """phi through set ``k``: one ViT forward."""
        with self.sets.use(k):
            return vit_features(self.backbone, x)

    def features(self, x: torch.Tensor, task_id: int | None) -> torch.Tensor:
        """phi through task ``task_id``'s adapter (None: the newest task's)."""
        return self.adapter_features(x, self.task_set(self.num_seen - 1 if task_id is None else task_id))

    def head_logits(self, feats: torch.Tensor, task_id: int) -> torch.Tensor:
        """cos(x, w_c) over task ``task_id``'s classes (no scale: ``SimpleContinualLinear.forward``)."""
        return cosine_logits(feats, self.heads[task_id].weight)

    @torch.no_grad()
    def predict(self, x: torch.Tensor, task_id: int | None) -> torch.Tensor:
        """TIL: the task's adapter and head. CIL: after task 0 the cosines through A_0; later softmax(s cos) through
        the universal adapter + that through the least-entropy task adapter (``_eval_cnn``)."""
        if task_id is not None:
            return self.task_logits(x, task_id)
        t = self.num_seen - 1
        if t == 0:
            return self.seen_logits(self.features(x, 0))
        per_adapter = [self.config.scale * self.seen_logits(self.features(x, i)) for i in range(t + 1)]
        if self.config.universal == "last":
            universal = per_adapter[t]  # the code's adapter_id = t + 1 runs cur_adapter = A_t: the same features
        else:
            universal = self.config.scale * self.seen_logits(self.adapter_features(x, UNIVERSAL))
        return F.softmax(universal.float(), dim=1) + F.softmax(route(per_adapter), dim=1)

    # ----------------------------------------------------------------------------- bookkeeping
    def forwards_per_test_image(self) -> dict[str, int]:
        """TIL one; CIL one after task 0, then one per task adapter and one for the universal adapter (``last``
        reuses the last task's)."""
        t = self.num_seen - 1
        cil = 1 if t <= 0 else t + 1 + (self.config.universal == "emr")
        return {"til": 1, "cil": cil}

    def storage(self) -> dict[str, Any]:
        """Per task its adapter set, head and class Gaussians; shared, the universal adapter. Trainable: the newest
        task's set and head (and the stored up-projections the code's optimizer moves)."""
        per_task = []
        for task in self.tasks[: self.num_seen]:
            bits = {
                "adapter": 32 * self.sets.numel(self.task_set(task.id)),
                "head": 32 * self.heads[task.id].weight.numel(),
            }
            per_task.append(bits | self.aligner.storage_bits(task.id))
        out: dict[str, Any] = {"bits_per_task": per_task, "trainable_params": 0}
        if self.num_seen:
            t = self.num_seen - 1
            extra = 0
            if not self.config.freeze_old_adapters and self.config.use_orth:
                extra = sum(w.numel() for stored in self.stored_up_projections(t) for w in stored)
            out["trainable_params"] = self.sets.numel(self.task_set(t)) + self.heads[t].weight.numel() + extra
        if self.config.universal == "emr":
            out["shared_bits"] = {"universal_adapter": 32 * self.sets.numel(UNIVERSAL)}
        return out

    def extra_results(self) -> dict[str, Any]:
        c = self.config
        code = (c.universal == "last", not c.freeze_old_adapters, c.decay_old_heads, c.alignment.cosine_epochs == 5)
        path = "official code" if all(code) else "described method" if not any(code) else "mixed"
        return {
            "tuna": {
                "universal": c.universal,
                "freeze_old_adapters": c.freeze_old_adapters,
                "decay_old_heads": c.decay_old_heads,
                "mean_shrink": c.alignment.mean_shrink,
                "ca_tmax": "epochs" if c.alignment.cosine_epochs is None else c.alignment.cosine_epochs,
                "adapter_init": c.adapter_init,
                "path": path,
            }
        }


@torch.no_grad()
def merge_sets(sets: AdapterSets, sources: list[int], target: int) -> None:
    """Set ``target`` becomes the EMR merge of sets ``sources``, tensor by tensor in every block."""
    for bank in sets.banks:
        states = [bank.sets[k].state_dict() for k in sources]
        bank.sets[target].load_state_dict({name: emr_merge([s[name] for s in states]) for name in states[0]})
