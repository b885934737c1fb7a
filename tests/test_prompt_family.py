"""DualPrompt and CODA-Prompt against independent transcriptions of their official code (tests/oracles/, written from
google-research/l2p, JH-LEE-KR/dualprompt-pytorch and GT-RIPL/CODA-Prompt without reading clbench's code): the
prompted attention, the selected prompts, the losses and their gradients on identical tensors; then what each keeps
frozen, its initialisation, and its config checks."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from clbench.config import validate
from clbench.errors import ConfigError
from clbench.loop.runtime import build_runtime
from clbench.loop.task import run_task
from clbench.methods.coda_prompt import CODAPrompt, gram_schmidt, ortho_penalty
from clbench.methods.dualprompt import DualPrompt
from clbench.methods.prompting import PrefixAttention
from conftest import TINY, compose_config, tiny_config
from oracles import coda_prompt_reference as coda_ref
from oracles import dualprompt_reference as dual_ref

# A CLS-pooled 3-block ViT (the official codes read the final-norm CLS token), 16 px, width 32, 2 heads.
SMALL = ("backbone.kwargs.depth=3", "backbone.kwargs.global_pool=token", "trainer.precision=fp32")


def started(method_name: str, *overrides: str, tasks: int = 2):
    """A method built on SMALL with its first ``tasks`` tasks started (all but the last finished untrained), random
    prompt values, and a batch of the last task."""
    method, rt = build_runtime(tiny_config(f"method={method_name}", *SMALL, *overrides))
    for task in rt.benchmark.tasks[:tasks]:
        if task.id:
            method.after_task(rt.benchmark.tasks[task.id - 1])
        method.before_task(task)
    gen = torch.Generator().manual_seed(3)
    prompts = method.prompt_parameters().values() if hasattr(method, "prompt_parameters") else []
    with torch.no_grad():
        for p in [*prompts, *(q for h in method.heads for q in h.parameters())]:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    task = rt.benchmark.tasks[tasks - 1]
    x_raw, y = rt.benchmark.train[task.id].batch(None, 0, 8)
    return method, rt, task, rt.test_tf(x_raw), y


def head(method) -> tuple[torch.Tensor, torch.Tensor]:
    """The concatenated per-task heads: the official code's one head over every seen class."""
    return torch.cat([h.weight for h in method.heads]), torch.cat([h.bias for h in method.heads])


def plain(method) -> torch.nn.Module:
    """The method's frozen backbone with timm's own attention back in every block (the oracles take a timm ViT)."""
    vit = copy.deepcopy(method.backbone)
    for block in vit.blocks:
        if isinstance(block.attn, PrefixAttention):
            block.attn = block.attn.attn
    return vit


def grads(*tensors: torch.Tensor) -> list[torch.Tensor]:
    out = [t.grad.clone() if t.grad is not None else torch.zeros_like(t) for t in tensors]
    for t in tensors:
        t.grad = None
    return out


@pytest.mark.parametrize("oracle", ["dualprompt", "coda_prompt"])
def test_prefix_attention_is_the_official_one(oracle: str) -> None:
    method, _, _, x, _ = started("finetune")
    attn = method.backbone.blocks[0].attn
    tokens = method.backbone.norm_pre(method.backbone._pos_embed(method.backbone.patch_embed(x)))
    prefix = torch.randn(len(x), 2, 3, attn.attn_dim)
    wrapped = PrefixAttention(attn)
    wrapped.prefix = prefix
    expected = (
        dual_ref.prefix_attention(attn, tokens, prefix)
        if oracle == "dualprompt"
        else coda_ref.prefix_attention(attn, tokens, prefix[:, 0], prefix[:, 1])
    )
    torch.testing.assert_close(wrapped(tokens), expected, rtol=1e-5, atol=1e-6)
    wrapped.prefix = None
    torch.testing.assert_close(wrapped(tokens), attn(tokens))


@pytest.mark.parametrize("top_k", [1, 2])
def test_dualprompt_forward_selection_loss_and_gradients_are_the_official_ones(top_k: int) -> None:
    """Block 1 carries both a G- and an E-prompt ([G, E], the JAX code); the second task trains its own slots (forced)
    against the oracle's CE - pull x mean cos, which differs from clbench's CE + pull x mean(1 - cos) by the constant
    pull x top_k: equal gradients for every prompt, key and head parameter; at test the selection and the logits."""
    prompts = ("method.g_layers=[0,1]", "method.e_layers=[1,2]", "method.g_length=2", "method.e_length=3")
    method, _, task, x, y = started("dualprompt", *prompts, f"method.top_k={top_k}")
    assert isinstance(method, DualPrompt)
    weight, bias = head(method)
    official = {
        "g_prompt": method.g_prompt,
        "g_layers": [0, 1],
        "e_prompt": method.e_prompt.transpose(
            1, 2
        ),  # clbench (layers, pool, 2, L, D); official (layers, 2, pool, L, D)
        "e_layers": [1, 2],
        "keys": method.keys,
        "head_weight": weight,
        "head_bias": bias,
        "top_k": top_k,
    }
    trained = [method.g_prompt, method.e_prompt, method.keys, *method.heads[task.id].parameters()]
    vit = plain(method)
    method.train()
    loss, _ = method.training_loss(x, y, task)
    loss.backward()
    ours = grads(*trained)
    classes = list(range(task.offset, task.offset + task.num_classes))
    out = dual_ref.forward(vit, x, **official, train=True, task_id=task.id, class_mask=classes)
    expected = dual_ref.loss(out, y, pull_coeff=1.0)
    torch.testing.assert_close(loss, expected + 1.0 * top_k, rtol=1e-5, atol=1e-5)
    expected.backward()
    for name, got, want in zip(("g", "e", "keys", "w", "b"), ours, grads(*trained), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=name)
    assert (out["idx"] == method.slots(task.id)).all()  # every training sample uses its task's slots
    method.eval()
    with torch.no_grad():
        test = dual_ref.forward(vit, x, **official, train=False, task_id=task.id)
        torch.testing.assert_close(method.predict(x, None), test["logits"], rtol=1e-5, atol=1e-5)
        chosen = dual_ref.select(method.query(x), method.keys, top_k=top_k)[0]
        counts = method.test_counts.clone()
        with method.evaluating(0):
            method.predict(x, None)
        histogram = torch.zeros_like(counts[0]).index_add_(0, chosen.flatten(), torch.ones_like(chosen.flatten()))
        assert torch.equal(method.test_counts[0] - counts[0], histogram)  # the same selection, counted


@pytest.mark.parametrize(("task_count", "ortho_mu"), [(0, 0.0), (1, 0.1), (2, 0.0)])
def test_coda_prompt_forward_loss_and_gradients_are_the_official_ones(task_count: int, ortho_mu: float) -> None:
    """3 tasks of 4 components (pool 12, length 4) in blocks 0 and 1: training on task t uses components 0..4t+3, the
    earlier ones detached (no gradient), the orthogonality loss where its weight is set; at test the seen ones."""
    overrides = ("method.pool_size=12", "method.length=4", "method.layers=[0,1]", f"method.ortho_mu={ortho_mu}")
    method, _, task, x, y = started("coda_prompt", "data.num_tasks=3", *overrides, tasks=task_count + 1)
    assert isinstance(method, CODAPrompt) and method.per_task == 4
    weight, bias = head(method)
    params = {layer: (method.components[i], method.keys[i], method.attention[i]) for i, layer in enumerate((0, 1))}
    seen = task.offset + task.num_classes
    common = {"layers": [0, 1], "params": params, "head_weight": weight, "head_bias": bias}
    common |= {"task_count": task_count, "n_tasks": 3, "ortho_mu": ortho_mu, "seen_classes": seen}
    trained = [*method.components, *method.keys, *method.attention, *method.heads[task.id].parameters()]
    vit = plain(method)
    method.train()
    loss, logs = method.training_loss(x, y, task)
    loss.backward()
    ours = grads(*trained)
    logits, prompt_loss = coda_ref.forward(vit, x, **common, train=True, task_classes=list(range(task.offset, seen)))
    expected = F.cross_entropy(logits, y) + prompt_loss
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logs["ortho"], prompt_loss.detach(), rtol=1e-5, atol=1e-9)
    expected.backward()
    for i, (got, want) in enumerate(zip(ours, grads(*trained), strict=True)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=str(i))
    start = task_count * 4
    assert all(not g[:start].any() and not g[start + 4 :].any() for g in ours[:6])  # only the task's own components
    method.eval()
    with torch.no_grad():
        test, _ = coda_ref.forward(vit, x, **common, train=False, task_classes=[])
        torch.testing.assert_close(method.predict(x, None), test, rtol=1e-5, atol=1e-5)


def test_gram_schmidt_is_the_official_one_and_gives_orthonormal_new_components() -> None:
    """On trained (non-orthogonal) earlier rows and on orthonormal ones, with the same fresh draws: the official
    result; new rows unit-norm and, against orthonormal earlier rows, orthogonal to them; later rows zero."""
    gen = torch.Generator().manual_seed(5)
    for shape in ((12, 16), (12, 2, 8)):
        rows = torch.randn(shape, generator=gen)
        fresh = torch.randn(4, rows[0].numel(), generator=gen)
        got = gram_schmidt(rows, 4, 8, fresh)
        torch.testing.assert_close(got, coda_ref.gram_schmidt(rows, 4, 8, fresh).view(shape), rtol=1e-5, atol=1e-6)
        assert torch.equal(got[:4], rows[:4]) and not got[8:].any()
    basis = gram_schmidt(torch.zeros(12, 16), 0, 8, torch.randn(8, 16, generator=gen))
    new = gram_schmidt(basis, 8, 12, torch.randn(4, 16, generator=gen))
    torch.testing.assert_close(new @ new.T, torch.eye(12), atol=1e-5, rtol=0)
    t = torch.randn(5, 7, generator=gen)
    torch.testing.assert_close(ortho_penalty(t), coda_ref.ortho_penalty(t))


def test_coda_prompt_starts_each_task_orthogonal_to_the_earlier_components_and_keeps_them() -> None:
    """Each task's components start unit-norm, orthogonal to the earlier ones as they were made (trained ones only
    approximately: Gram-Schmidt projects on them one at a time, as the official code); training a task leaves every
    earlier task's components bit-identical."""
    method, rt = build_runtime(tiny_config("method=coda_prompt", "method.pool_size=12", "trainer.epochs=1"))
    for task in rt.benchmark.tasks:
        method.before_task(task)
        start, end = method.span(task.id)
        for p in method.pools():
            rows = p.detach().flatten(1)
            torch.testing.assert_close(rows[start:end].norm(dim=1), torch.ones(end - start))
            if task.id == 0:
                torch.testing.assert_close(rows[:end] @ rows[:end].T, torch.eye(end), atol=1e-5, rtol=0)
            assert not rows[end:].any()
        saved = [p[:start].clone() for p in method.pools()]
        run_task(method, task, rt, epochs=1)
        method.after_task(task)
        assert all(torch.equal(p[:start], s) for p, s in zip(method.pools(), saved, strict=True))


def test_dualprompt_trains_its_task_slot_copies_the_previous_one_and_keeps_old_slots() -> None:
    method, rt = build_runtime(tiny_config("method=dualprompt", "trainer.epochs=1", *SMALL))
    assert isinstance(method, DualPrompt)
    for task in rt.benchmark.tasks:
        method.before_task(task)
        if task.id:
            torch.testing.assert_close(method.e_prompt[:, task.id], method.e_prompt[:, task.id - 1], rtol=0, atol=0)
        before = method.e_prompt.detach().clone()
        run_task(method, task, rt, epochs=1)
        method.after_task(task)
        moved = (method.e_prompt.detach() != before).flatten(2).any(2)  # (layers, slots)
        assert moved[:, task.id].all() and not moved[:, : task.id].any() and not moved[:, task.id + 1 :].any()
        counts = method.train_counts[task.id]
        assert counts[task.id] > 0 and counts.sum() == counts[task.id]  # every training sample used its task's slot


def test_dualprompt_prompt_tuning_inserts_tokens_and_drops_them_before_the_pooling() -> None:
    """prefix=false: without prompts the pass is the plain backbone's; with them the pooled feature changes and keeps
    its shape (the inserted tokens are gone before the pooling)."""
    method, rt = build_runtime(tiny_config("method=dualprompt", "method.prefix=false", *SMALL))
    x = rt.test_tf(rt.benchmark.test[0].x[:4])
    chosen = torch.zeros(4, 1, dtype=torch.long)
    with torch.no_grad():
        plain = method.backbone.forward_head(method.backbone.forward_features(x), pre_logits=True)
        assert method.prompt_tuned_features(x, {}).allclose(plain, atol=1e-6)
        prompted = method.prompted_features(x, chosen)
    assert prompted.shape == plain.shape and not prompted.allclose(plain)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("method=dualprompt", "method.pool_size=2"), r"pool_size.*>= tasks x top_k = 3"),
        (("method=dualprompt", "method.e_layers=[7]"), r"e_layers.*below the backbone's depth 1"),
        (("method=coda_prompt", "method.length=5"), r"method.length.*an even integer"),
        (("method=coda_prompt", "method.pool_size=2"), r"pool_size.*at least one component per task"),
        (
            ("method=dualprompt", "method.g_layers=[]", "method.e_layers=[0]", "backbone.refiner=true"),
            r"timm's Attention",
        ),
    ],
)
def test_prompt_configs_that_cannot_work_are_refused(overrides: tuple[str, ...], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_runtime(tiny_config(*overrides))


def test_the_embedded_micro_vit_keeps_the_blocks_and_orthogonal_keys_it_has(caplog: pytest.LogCaptureFixture) -> None:
    """The official layers (DualPrompt's E-prompts in blocks 2-4, CODA-Prompt's 0-4) on a 4-block backbone: the blocks
    it has, said in the log; CODA-Prompt's 100 components on a width of 64: the most that can be orthogonal."""
    micro = [o for o in TINY if not o.startswith("backbone.kwargs")]
    dual, _ = build_runtime(validate(compose_config("method=dualprompt", *micro)))
    coda, _ = build_runtime(validate(compose_config("method=coda_prompt", *micro)))
    assert dual.e_layers == [2, 3] and coda.layers == [0, 1, 2, 3] and coda.per_task * 3 == 63
    assert "prompting blocks [2, 3]" in caplog.text and "at most 64 orthogonal keys" in caplog.text


@pytest.mark.parametrize("method_name", ["l2p", "dualprompt", "coda_prompt"])
def test_the_official_head_initialisations(method_name: str) -> None:
    """JAX (google-research/l2p models/vit.py: ``nn.Dense(..., kernel_init=zeros)``): weight and bias 0; the PyTorch
    ports (timm's init_weights_vit_timm): weight N(0, 0.02) truncated at +-2, bias 0; default: nn.Linear's
    U(+-1/sqrt(D)) weight and bias (CODA-Prompt's ``nn.Linear(768, num_classes)``). The untrained classes that CIL
    over all classes scores get heads drawn the same way, the same ones at every evaluation."""
    bound = 32**-0.5  # TINY's embed_dim 32
    std = {"zeros": 0.0, "trunc_normal": 0.02, "default": bound / 3**0.5}  # U(-b, b) has std b / sqrt(3)
    for kind, expected in std.items():
        method, rt = build_runtime(tiny_config(f"method={method_name}", *SMALL, f"method.head_init={kind}"))
        method.before_task(rt.benchmark.tasks[0])
        fresh = method.new_head(500)  # 16,000 weights: their std within 3% of the distribution's
        for weight, bias in [head(method), (fresh.weight, fresh.bias)]:
            assert bias.any() == (kind == "default") and bias.abs().max() <= bound
            assert weight.abs().max() <= (2.0 if kind == "trunc_normal" else bound)
        assert fresh.weight.std().item() == pytest.approx(expected, rel=0.03)
        x = rt.test_tf(rt.benchmark.test[0].x[:8], slice(None))
        untrained = method.untrained_logits(method.features(x, None))
        assert untrained.shape == (8, sum(t.num_classes for t in rt.benchmark.tasks[1:]))
        assert untrained.any() == (kind != "zeros")
        assert torch.equal(untrained, method.untrained_logits(method.features(x, None)))
