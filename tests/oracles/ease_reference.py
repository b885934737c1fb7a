"""An independent, plain-PyTorch reference ("oracle") of EASE's classifier, transcribed from the official code
sun-hailong/CVPR24-Ease@6d67508: ``backbone/linears.py`` (``CosineLinear.forward`` L33-43, ``forward_reweight``
L45-93), ``utils/inc_net.py`` (``EaseNet.update_fc`` L142-159, ``forward`` L168-180) and ``models/ease.py``
(``Learner.__init__`` L39-42, ``get_cls_range`` L49-57, ``replace_fc`` L60-130, ``solve_similarity`` L151-174,
``solve_sim_reset`` L176-226), loops and all. No clbench code. ``fc`` is the classifier's weight (classes x blocks of
``out_dim``), as the code keeps it in ``self._network.fc.weight``; the features are the concatenated blocks
``[phi_PTM (use_init_ptm); phi_0; ...; phi_t]`` of ``forward_test``.

Per task t (``incremental_train``)::

    fc = update_fc(fc)                  (one more block of columns; old rows copied, new rows 0)
    train adapter t with the proxy head
    replace_fc: for every block index (-1 = the PTM with use_init_ptm) up to t, the new classes' rows of that block
                = the mean of that block's features over the class's training images
    solve_sim_reset (recalc_sim) or solve_similarity: old classes' rows in later blocks, from the similarities
    logits = forward_reweight(features, fc) (use_reweight, not moni_adam) or CosineLinear(features, fc)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def get_cls_range(task_id: int, init_cls: int, inc: int) -> tuple[int, int]:
    """models/ease.py L49-57."""
    if task_id == 0:
        return 0, init_cls
    start_cls = init_cls + (task_id - 1) * inc
    return start_cls, start_cls + inc


def update_fc(fc: torch.Tensor | None, nb_classes: int, feature_dim: int, out_dim: int) -> torch.Tensor:
    """EaseNet.update_fc L150-159: a zero CosineLinear of the new width; the old rows copied into all but the last
    block."""
    new = torch.zeros(nb_classes, feature_dim, dtype=fc.dtype if fc is not None else torch.float32)
    if fc is not None:
        new[: fc.shape[0], :-out_dim] = fc
    return new


def replace_fc(
    fc: torch.Tensor,
    embeddings: dict[int, torch.Tensor],
    labels: torch.Tensor,
    *,
    cur_task: int,
    out_dim: int,
    use_init_ptm: bool,
    moni_adam: bool = False,
    adapter_num: int = -1,
) -> torch.Tensor:
    """replace_fc L64-99 (use_diagonal and use_old_data False): ``embeddings[index]`` holds forward_proto's
    features of the task's training images for block index ``index`` (-1: the PTM)."""
    fc = fc.clone()
    start_idx = -1 if use_init_ptm else 0
    for index in range(start_idx, cur_task + 1):
        if moni_adam and index > adapter_num - 1:
            break
        embedding_list = embeddings[index]
        for class_index in torch.unique(labels).tolist():
            data_index = (labels == class_index).nonzero().squeeze(-1)
            proto = embedding_list[data_index].mean(0)
            block = index + 1 if use_init_ptm else index
            fc[class_index, block * out_dim : (block + 1) * out_dim] = proto
    return fc


def solve_sim_reset(
    fc: torch.Tensor,
    *,
    cur_task: int,
    init_cls: int,
    inc: int,
    total_classes: int,
    out_dim: int,
    use_init_ptm: bool,
    moni_adam: bool = False,
    adapter_num: int = -1,
) -> torch.Tensor:
    """solve_sim_reset L176-226, as written: for each old task and each later block, the old classes' rows of that
    block from the softmax of their cosines (in their own block) to the classes learned from that block on."""
    fc = fc.clone()
    for task_id in range(cur_task):
        if moni_adam and task_id > adapter_num - 2:
            break
        range_dim = range(task_id + 2, cur_task + 2) if use_init_ptm else range(task_id + 1, cur_task + 1)
        for dim_id in range_dim:
            if moni_adam and dim_id > adapter_num:
                break
            start_cls, end_cls = get_cls_range(task_id, init_cls, inc)
            start_dim, end_dim = dim_id * out_dim, (dim_id + 1) * out_dim
            if use_init_ptm:
                start_cls_old = init_cls + (dim_id - 2) * inc
                start_dim_old, end_dim_old = (task_id + 1) * out_dim, (task_id + 2) * out_dim
            else:
                start_cls_old = init_cls + (dim_id - 1) * inc
                start_dim_old, end_dim_old = task_id * out_dim, (task_id + 1) * out_dim
            end_cls_old = total_classes
            a = fc[start_cls_old:end_cls_old, start_dim_old:end_dim_old]
            b = fc[start_cls_old:end_cls_old, start_dim:end_dim]
            a_hat = fc[start_cls:end_cls, start_dim_old:end_dim_old]
            similarity = torch.zeros(len(a_hat), len(a), dtype=fc.dtype)
            for i in range(len(a_hat)):
                for j in range(len(a)):
                    similarity[i][j] = torch.cosine_similarity(a_hat[i], a[j], dim=0)
            similarity = F.softmax(similarity, dim=1)
            b_hat = torch.zeros(a_hat.shape[0], b.shape[1], dtype=fc.dtype)
            for i in range(len(a_hat)):
                for j in range(len(a)):
                    b_hat[i] += similarity[i][j] * b[j]
            fc[start_cls:end_cls, start_dim:end_dim] = b_hat
    return fc


def solve_similarity(
    fc: torch.Tensor, *, cur_task: int, known_classes: int, init_cls: int, inc: int, out_dim: int, use_init_ptm: bool
) -> torch.Tensor:
    """solve_similarity L151-174 (recalc_sim False): only the newest block of each old task's rows, from the
    similarities to the new task's classes (``known_classes``: the classes before the new task)."""
    fc = fc.clone()
    for task_id in range(cur_task):
        start_cls, end_cls = get_cls_range(task_id, init_cls, inc)
        block = task_id + 1 if use_init_ptm else task_id
        start_dim, end_dim = block * out_dim, (block + 1) * out_dim
        a = fc[known_classes:, start_dim:end_dim]
        b = fc[known_classes:, -out_dim:]
        a_hat = fc[start_cls:end_cls, start_dim:end_dim]
        similarity = torch.zeros(len(a_hat), len(a), dtype=fc.dtype)
        for i in range(len(a_hat)):
            for j in range(len(a)):
                similarity[i][j] = torch.cosine_similarity(a_hat[i], a[j], dim=0)
        similarity = F.softmax(similarity, dim=1)
        b_hat = torch.zeros(a_hat.shape[0], b.shape[1], dtype=fc.dtype)
        for i in range(len(a_hat)):
            for j in range(len(a)):
                b_hat[i] += similarity[i][j] * b[j]
        fc[start_cls:end_cls, -out_dim:] = b_hat
    return fc


def cosine_linear(x: torch.Tensor, fc: torch.Tensor, sigma: float = 1.0) -> torch.Tensor:
    """CosineLinear.forward L33-43 (EaseNet's fc: sigma stays at its initial 1, never trained)."""
    return sigma * F.linear(F.normalize(x, p=2, dim=1), F.normalize(fc, p=2, dim=1))


def forward_reweight(
    x: torch.Tensor,
    fc: torch.Tensor,
    *,
    cur_task: int,
    alpha: float,
    beta: float,
    init_cls: int,
    inc: int,
    out_dim: int,
    use_init_ptm: bool,
    sigma: float = 1.0,
) -> torch.Tensor:
    """CosineLinear.forward_reweight L45-93, loops as written."""
    in_features = fc.shape[1]
    out_all = None
    for i in range(cur_task + 1):
        start_cls, end_cls = get_cls_range(i, init_cls, inc)
        out = 0.0
        for j in range(in_features // out_dim):
            if use_init_ptm and j == 0:
                input_ptm = F.normalize(x[:, 0:out_dim], p=2, dim=1)
                weight_ptm = F.normalize(fc[start_cls:end_cls, 0:out_dim], p=2, dim=1)
                out = out + beta * F.linear(input_ptm, weight_ptm)
                continue
            input1 = F.normalize(x[:, j * out_dim : (j + 1) * out_dim], p=2, dim=1)
            weight1 = F.normalize(fc[start_cls:end_cls, j * out_dim : (j + 1) * out_dim], p=2, dim=1)
            own = j == i + 1 if use_init_ptm else j == i
            out1 = F.linear(input1, weight1) if own else alpha * F.linear(input1, weight1) / cur_task
            out = out + out1
        out_all = out if i == 0 else torch.cat((out_all, out), dim=1)
    return sigma * out_all


def ease_logits(
    x: torch.Tensor,
    fc: torch.Tensor,
    *,
    cur_task: int,
    alpha: float,
    beta: float,
    init_cls: int,
    inc: int,
    out_dim: int,
    use_init_ptm: bool,
    use_reweight: bool = True,
    moni_adam: bool = False,
) -> torch.Tensor:
    """EaseNet.forward(test=True) L173-177: the plain cosine in APER mode (moni_adam) or without use_reweight, else
    forward_reweight (whose alpha and beta are the config's: Learner's moni_adam overrides never reach the net)."""
    if moni_adam or not use_reweight:
        return cosine_linear(x, fc)
    return forward_reweight(
        x, fc, cur_task=cur_task, alpha=alpha, beta=beta, init_cls=init_cls, inc=inc, out_dim=out_dim,
        use_init_ptm=use_init_ptm,
    )  # fmt: skip


def run_tasks(
    features: list[dict[int, torch.Tensor]],
    labels: list[torch.Tensor],
    *,
    init_cls: int,
    inc: int,
    out_dim: int,
    use_init_ptm: bool,
    recalc_sim: bool = True,
    moni_adam: bool = False,
    adapter_num: int = -1,
) -> list[torch.Tensor]:
    """The classifier after each task: ``features[t][index]`` are task t's training images' features in block index
    ``index`` (the adapters existing at task t, -1 the PTM), ``labels[t]`` their global labels. Returns fc after
    every task (incremental_train's update_fc, replace_fc and the complement)."""
    if moni_adam:  # Learner.__init__ L39-42
        use_init_ptm = True
    fc, known, history = None, 0, []
    for cur_task, (embeddings, y) in enumerate(zip(features, labels, strict=True)):
        total = known + (init_cls if cur_task == 0 else inc)
        feature_dim = out_dim * (cur_task + 2 if use_init_ptm else cur_task + 1)  # EaseNet.feature_dim L134-139
        fc = update_fc(fc, total, feature_dim, out_dim)
        fc = replace_fc(
            fc, embeddings, y, cur_task=cur_task, out_dim=out_dim, use_init_ptm=use_init_ptm, moni_adam=moni_adam,
            adapter_num=adapter_num,
        )  # fmt: skip
        if recalc_sim:
            fc = solve_sim_reset(
                fc, cur_task=cur_task, init_cls=init_cls, inc=inc, total_classes=total, out_dim=out_dim,
                use_init_ptm=use_init_ptm, moni_adam=moni_adam, adapter_num=adapter_num,
            )  # fmt: skip
        else:
            fc = solve_similarity(
                fc, cur_task=cur_task, known_classes=known, init_cls=init_cls, inc=inc, out_dim=out_dim,
                use_init_ptm=use_init_ptm,
            )  # fmt: skip
        history.append(fc)
        known = total
    return history
