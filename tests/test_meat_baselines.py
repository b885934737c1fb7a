"""MEAT Table 1's baseline rows (BASELINES.md §11, §12, §14): Adapter (Houlsby), Individual, Classifier.

Oracles: the adapter against an independent transcription (tests/oracles/adapter_reference.py); W_up = 0 gives the
frozen backbone exactly; 2md + d + m parameters per adapter; exact zero task-incremental forgetting (old tasks' state
and TIL predictions bit-identical after later tasks); artifacts round trip; the FT-seq-frozen oracle of §12 (old heads
bit-identical with ``loss_scope=task``, moved with ``seen``); end-to-end runs and a resume."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from clbench.errors import ConfigError
from clbench.loop import train
from clbench.loop.optim import build_optimizer
from clbench.loop.runtime import build_runtime
from clbench.methods.adapter import AdaptedSublayer, Adapter, HoulsbyAdapter, TaskNorm
from clbench.methods.base import Method, Phase
from conftest import crash_and_resume, tiny_config
from oracles import adapter_reference as ref

CLASSIFIER = ("method=classifier",)
ADAPTER = ("method=adapter", "method.bottleneck=8")
INDIVIDUAL = ("method=individual",)
ROWS = {"adapter": ADAPTER, "individual": INDIVIDUAL, "classifier": CLASSIFIER}
LEARN = ("trainer.lr=0.01", "method.adapter_lr=0.05")  # large steps: every trained tensor visibly moves


def batch(task, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 16, 16, generator=g), task.offset + torch.randint(task.num_classes, (n,), generator=g)


def train_sequence(method: Method, cfg, steps: int = 3, after=None) -> None:
    """Each task: before_task, an optimizer over param_groups (the loop's builder: weight decay included), a few
    steps on random data, after_task; then ``after(task)``."""
    for task in method.tasks:
        method.before_task(task)
        phase = Phase("train", 1)
        method.before_phase(task, phase)
        optimizer = build_optimizer(method, task, phase, cfg.trainer)
        method.train()
        for s in range(steps):
            x, y = batch(task, 8, 100 * task.id + s)
            optimizer.zero_grad(set_to_none=True)
            method.training_loss(x, y, task)[0].backward()
            optimizer.step()
        method.after_task(task)
        method.eval()
        if after is not None:
            after(task)


def task_state(method: Method, t: int) -> dict[str, torch.Tensor]:
    """Everything task ``t`` owns: its head, and its adapters and norms or its backbone copy."""
    out = {f"head.{k}": v for k, v in method.heads[t].state_dict().items()}
    if isinstance(method, Adapter):
        adapters, norms = method.task_modules(t)
        out |= {f"a{i}.{k}": v for i, m in enumerate(adapters) for k, v in m.state_dict().items()}
        out |= {f"n{i}.{k}": v for i, m in enumerate(norms) for k, v in m.state_dict().items()}
    elif hasattr(method, "copies"):
        out |= {f"copy.{k}": v for k, v in method.copies[t].state_dict().items()}
    return {k: v.detach().clone() for k, v in out.items()}


def pretrained(method: Method) -> dict[str, torch.Tensor]:
    """The backbone's own (pretrained) weights, without per-task modules."""
    own = {k: v for k, v in method.backbone.state_dict().items() if ".adapters." not in k and ".norms." not in k}
    return {k: v.detach().clone() for k, v in own.items()}


# ----------------------------------------------------------------------------- the adapter against the oracle
def unwrapped(method: Adapter):
    """A copy of the backbone with every wrapper replaced by the module it wraps: the frozen pretrained ViT."""
    plain = copy.deepcopy(method.backbone)
    for module in list(plain.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, AdaptedSublayer):
                setattr(module, child_name, child.inner)
            elif isinstance(child, TaskNorm):
                setattr(module, child_name, child.pretrained)
    return plain


def test_with_zero_up_projections_the_adapted_model_is_the_frozen_backbone_exactly() -> None:
    method, _ = build_runtime(tiny_config(*ADAPTER, "backbone.kwargs.depth=2"))
    plain = unwrapped(method).eval()
    method.eval()
    task = method.tasks[0]
    method.before_task(task)
    with torch.no_grad():
        for sub in method.sublayers.values():
            sub.adapters[0].down.weight.normal_()  # a non-trivial bottleneck: only W_up = 0 makes it vanish
            sub.adapters[0].up.weight.zero_()
    x, _ = batch(task, 4, 0)
    with torch.no_grad():
        expected = plain.forward_head(plain.forward_features(x), pre_logits=True)
        assert torch.equal(method.features(x, 0), expected)


def test_parameter_count_is_2md_plus_d_plus_m_per_adapter_and_storage_counts_it() -> None:
    for per_block in (1, 2):
        method, _ = build_runtime(tiny_config(*ADAPTER, f"method.per_block={per_block}", "backbone.kwargs.depth=2"))
        method.before_task(method.tasks[0])
        d, m = method.backbone.num_features, 8
        adapters, _ = method.task_modules(0)
        assert len(adapters) == 2 * per_block
        assert all(sum(p.numel() for p in a.parameters()) == ref.adapter_params(d, m) for a in adapters)
        entry = method.storage()["bits_per_task"][0]
        assert entry["adapters"] == 32 * 2 * per_block * ref.adapter_params(d, m)
        # norm1, norm2 of two blocks and the final norm (fc_norm with average pooling): weight and bias of width d
        assert entry["norms"] == 32 * 5 * 2 * d
        assert entry["head"] == 32 * (d + 1) * method.tasks[0].num_classes


def test_adapter_and_adapted_block_equal_the_transcription() -> None:
    torch.manual_seed(0)
    unit = HoulsbyAdapter(12, 5, init_std=1e-3).double()
    assert unit.down.weight.abs().max() <= 2e-3 and unit.up.weight.abs().max() <= 2e-3  # truncated at 2 std
    assert not unit.down.bias.any() and not unit.up.bias.any()
    with torch.no_grad():
        for p in unit.parameters():
            p.normal_()
    h = torch.randn(3, 7, 12, dtype=torch.float64)
    params = (unit.down.weight, unit.down.bias, unit.up.weight, unit.up.bias)
    torch.testing.assert_close(unit(h), ref.adapter(h, *params), rtol=1e-12, atol=1e-12)

    method, _ = build_runtime(tiny_config(*ADAPTER))  # TINY's one block
    method.double().eval()
    method.before_task(method.tasks[0])
    method.before_task(method.tasks[1])  # task 1's modules are the second of each list
    with torch.no_grad():
        for p in method.parameters():
            p.add_(0.1 * torch.randn_like(p))
    block = method.backbone.blocks[0]
    x = torch.randn(2, 5, method.backbone.num_features, dtype=torch.float64)
    for switch in method._switches():
        switch.task = 1
    with torch.no_grad():
        got = block(x)
    for switch in method._switches():
        switch.task = None

    def ln(norm: TaskNorm) -> tuple:
        n = norm.norms[1]
        return n.weight, n.bias, n.eps

    def ad(sub: AdaptedSublayer) -> tuple:
        a = sub.adapters[1]
        return a.down.weight, a.down.bias, a.up.weight, a.up.bias

    with torch.no_grad():
        expected = ref.adapted_block(
            x,
            attn=block.attn.inner,
            mlp=block.mlp.inner,
            norm1=ln(block.norm1),
            norm2=ln(block.norm2),
            adapter1=ad(block.attn),
            adapter2=ad(block.mlp),
        )
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- exact zero forgetting
@pytest.mark.parametrize("row", list(ROWS))
def test_old_tasks_state_and_til_predictions_are_bit_identical_after_later_tasks(row: str) -> None:
    cfg = tiny_config(*ROWS[row], *(LEARN if row == "adapter" else ("trainer.lr=0.01",)), "trainer.weight_decay=0.05")
    method, _ = build_runtime(cfg)
    source = pretrained(method)
    probe = {t.id: batch(t, 6, 999 + t.id)[0] for t in method.tasks}
    states, logits = {}, {}

    def record(task) -> None:
        states[task.id] = task_state(method, task.id)
        logits[task.id] = method.predict(probe[task.id], task.id)
        if row == "adapter":  # the task's adapters trained: their weights left the init's 2-std truncation
            assert all(a.up.weight.abs().max() > 2e-3 for a in method.task_modules(task.id)[0])

    train_sequence(method, cfg, after=record)
    last = len(method.tasks) - 1
    for t in range(last):
        now = task_state(method, t)
        assert now.keys() == states[t].keys()
        assert all(torch.equal(now[k], states[t][k]) for k in now), f"task {t}'s state moved"
        assert torch.equal(method.predict(probe[t], t), logits[t]), f"task {t}'s TIL logits moved"
    assert all(torch.equal(v, source[k]) for k, v in pretrained(method).items())  # the pretrained ViT never moves
    if row == "individual":  # every copy was trained away from the pretrained weights
        assert all(not torch.equal(method.copies[t].cls_token, method.backbone.cls_token) for t in range(last + 1))
    cil = method.predict(probe[0], None)
    assert cil.shape == (6, sum(t.num_classes for t in method.tasks))


def test_adapter_optimises_only_the_current_task() -> None:
    cfg = tiny_config(*ADAPTER)
    method, _ = build_runtime(cfg)
    for task in method.tasks[:2]:
        method.before_task(task)
        optimizer = build_optimizer(method, task, Phase("train", 1), cfg.trainer)
        method.after_task(task)
    owned = {id(p) for p in method.heads[1].parameters()}
    adapters, norms = method.task_modules(1)
    owned |= {id(p) for m in (*adapters, *norms) for p in m.parameters()}
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == owned
    assert not any(p.requires_grad for p in method.parameters())  # after the task everything is frozen


@pytest.mark.parametrize(("scope", "kept"), [("task", True), ("seen", False)])
def test_ft_seq_frozen_keeps_old_heads_with_the_task_scope_only(scope: str, kept: bool) -> None:
    """BASELINES §12: FT-seq-frozen with the train mask (loss_scope=task) leaves old heads bit-identical, also under
    AdamW's decoupled weight decay; with ``seen`` they train on. Only the current head is optimised with ``task``."""
    cfg = tiny_config("method=finetune", "method.freeze_backbone=true", f"method.loss_scope={scope}",
                      "trainer.weight_decay=0.05", "trainer.lr=0.01")  # fmt: skip
    method, _ = build_runtime(cfg)
    heads: dict[int, dict[str, torch.Tensor]] = {}
    train_sequence(method, cfg, after=lambda task: heads.setdefault(task.id, task_state(method, 0)))
    same = all(torch.equal(heads[0][k], task_state(method, 0)[k]) for k in heads[0])
    assert same is kept
    task = method.tasks[-1]
    optimizer = build_optimizer(method, task, Phase("train", 1), cfg.trainer)
    optimised = {id(p) for g in optimizer.param_groups for p in g["params"]}
    current = {id(p) for p in method.heads[task.id].parameters()}
    assert optimised == (current if scope == "task" else {id(p) for h in method.heads for p in h.parameters()})


# ----------------------------------------------------------------------------- artifacts
@pytest.mark.parametrize("row", ["adapter", "individual"])
def test_artifacts_rebuild_the_same_predictions(row: str) -> None:
    cfg = tiny_config(*ROWS[row], "trainer.lr=0.01")
    method, _ = build_runtime(cfg)
    train_sequence(method, cfg, steps=2)
    saved = method.artifacts()
    if row == "individual":
        assert not any(k.startswith("backbone.") for k in saved)  # the copies carry it all
        assert {k.split(".")[1] for k in saved if k.startswith("copy.")} == {"0", "1", "2"}
    fresh, _ = build_runtime(cfg)
    fresh.load_artifacts(saved)
    fresh.eval()
    assert fresh.num_seen == method.num_seen
    assert fresh.storage() == method.storage()
    x, _ = batch(method.tasks[0], 6, 7)
    for t in range(method.num_seen):
        assert torch.equal(fresh.predict(x, t), method.predict(x, t))
    assert torch.equal(fresh.predict(x, None), method.predict(x, None))


# ----------------------------------------------------------------------------- end to end
def til(run_dir: Path) -> dict:
    return json.loads((run_dir / "results.json").read_text())["metrics"]["til"]


def zero_til_forgetting(res: dict) -> bool:
    """results.json's TIL forgetting is 0 and every task's accuracy stays what it was right after the task."""
    matrix = res["acc_matrix"]["til"]
    same = all(row_[j] == matrix[j][j] for row_ in matrix for j in range(len(matrix)) if row_[j] is not None)
    return same and res["metrics"]["til"]["forgetting"] == 0.0


def test_a_tiny_classifier_run_ends_with_exactly_zero_til_forgetting(tmp_path: Path) -> None:
    """Adapter's and Individual's whole runs are checked alike in the resume test below."""
    train(tiny_config(*CLASSIFIER), tmp_path)
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["status"] == "finished"
    assert zero_til_forgetting(res)
    assert res["storage"]["bits_per_task"] == [{"head": 32 * 33 * 2}] * 3  # a 32-wide head of 2 classes a task


@pytest.mark.slow  # 15 s; the every-method crash test covers them too in test-all
@pytest.mark.parametrize("row", ["adapter", "individual", "adapter_bert"])
def test_resume_after_a_crash_gives_the_uninterrupted_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, row: str
) -> None:
    """adapter_bert: adapter-bert's optimizer (its moments in the checkpoint) and head."""
    bert = (*ADAPTER, "trainer.optimizer=adamw_bert", "method.head_init=bert")
    overrides = (
        *(bert if row == "adapter_bert" else ROWS[row]),
        "data.num_tasks=2",
        "trainer.checkpoint_every=1",
        "trainer.epochs=2",
        "trainer.eval_random_init=false",
    )
    train(tiny_config(*overrides), tmp_path / "whole")
    whole = json.loads((tmp_path / "whole" / "results.json").read_text())
    assert whole["status"] == "finished" and zero_til_forgetting(whole)
    expected = whole["acc_matrix"]
    crash_and_resume(monkeypatch, overrides, tmp_path / "cut", 9)  # task 1, mid-task
    assert json.loads((tmp_path / "cut" / "results.json").read_text())["acc_matrix"] == expected


@pytest.mark.parametrize(
    "override", ["method.bottleneck=0", "method.per_block=3", "method.init_std=nan", "method.adapter_lr=-1"]
)
def test_bad_adapter_settings_are_rejected(override: str) -> None:
    with pytest.raises(ConfigError, match=override.partition("=")[0]):
        tiny_config("method=adapter", override)


def test_adapter_berts_optimizer_is_adam_without_bias_correction() -> None:
    """trainer.optimizer=adamw_bert against the transcription of AdamWeightDecayOptimizer: three steps on fixed
    gradients with weight decay; its first step is lr x g / (|g| + 1e-6) x 0.1 / sqrt(0.001), 3.16x torch AdamW's."""
    from clbench.loop.optim import AdamWBert

    theta = [0.5, -1.0, 2.0]
    grads = [[0.1, -0.2, 0.3], [0.05, 0.4, -0.1], [-0.3, 0.0, 0.2]]
    p = torch.tensor(theta, dtype=torch.float64, requires_grad=True)
    opt = AdamWBert([{"params": [p], "weight_decay": 0.01}], lr=0.1)
    for g in grads:
        p.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
    expected = ref.bert_adam_steps(theta, grads, lr=0.1, weight_decay=0.01)
    assert p.detach().tolist() == pytest.approx(expected, rel=1e-12)
    q = torch.tensor([0.0], requires_grad=True)
    bert, torch_adamw = AdamWBert([{"params": [q]}], lr=1.0), torch.optim.AdamW([q.detach().clone().requires_grad_()])
    q.grad = torch.tensor([1.0])
    bert.step()
    assert -q.item() == pytest.approx(0.1 / (0.001**0.5 + 1e-6), rel=1e-5)  # 3.16 where torch's AdamW steps 1.0
    assert torch_adamw.defaults["eps"] == 1e-8


def test_adapter_berts_head_is_a_truncated_normal_at_two_standard_deviations() -> None:
    """method.head_init=bert: TensorFlow's truncated_normal_initializer(stddev=0.02) (re-drawn beyond 2 std) and a
    zero bias, run_classifier.py L546-552."""
    method, rt = build_runtime(tiny_config("method=adapter", "method.head_init=bert", "backbone.kwargs.embed_dim=256"))
    method.before_task(rt.benchmark.tasks[0])
    head = method.heads[0]
    w = head.weight.detach().flatten()
    assert w.abs().max() <= 0.04 and torch.count_nonzero(head.bias) == 0
    truncated_std = 0.02 * 0.8796  # std of a standard normal cut at +-2
    assert abs(float(w.std()) - truncated_std) < 0.1 * truncated_std
