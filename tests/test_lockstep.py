"""What an independent lock-step check against the official codes found (issue 25, item 6), each a stated choice
with the other way an option, checked here against the official rule: HAT's annealing by sample index, MEAT's
attention that keeps a masked token attending to itself and its drop-control sum, L2P's task slots without key
copies and its batch vote's ties, SupSup's Erdos-Renyi density for a convolution and its weight decay on the
scores."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from clbench.loop.runtime import build_runtime
from clbench.loop.task import run_task
from clbench.methods.hat import HAT
from clbench.methods.meat import drop_control_loss
from clbench.methods.prompting import top_k_by_key
from clbench.methods.supsup import SupSup
from clbench.methods.token_masking import policy_attention
from conftest import tiny_config
from oracles import dualprompt_reference as dual_ref


def test_hats_code_annealing_counts_samples_as_the_official_train_epoch(monkeypatch: pytest.MonkeyPatch) -> None:
    """joansj/hat approaches/hat.py: for i in range(0, len(r), sbatch): s = (smax - 1/smax) * i / len(r) + 1/smax.
    The loop hands each epoch's sample count and batch size to the method (before_epoch)."""
    method, rt = build_runtime(tiny_config("method=hat", "method.anneal=code", "trainer.batch_size=7"))
    assert isinstance(method, HAT)
    task = rt.benchmark.tasks[0]
    method.before_task(task)
    seen: list[float] = []
    real = HAT.before_step
    monkeypatch.setattr(HAT, "before_step", lambda self, *a: real(self, *a) or seen.append(float(self.s)))
    run_task(method, task, rt, epochs=1)
    n, smax = len(rt.benchmark.train[0]), 400.0
    expected = [(smax - 1 / smax) * i / n + 1 / smax for i in range(0, n, 7)]
    assert seen == pytest.approx(expected, rel=1e-6) and max(seen) < smax


def official_softmax_with_policy(q, k, v, policy):
    """zju-vipa/MEAT-TIL models.py AttentionAll.softmax_with_policy as METHODS.md §2.2 transcribes it: policy (B, N)
    with CLS included; attn_policy = policy + (1 - policy) * eye; exp(attn - max) * attn_policy; (attn + eps/N) /
    (sum + eps), eps 1e-6, in fp32."""
    b, n = policy.shape
    attn = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    attn_policy = policy.reshape(b, 1, 1, n)
    eye = torch.eye(n).view(1, 1, n, n)
    attn_policy = attn_policy + (1.0 - attn_policy) * eye
    attn = (attn - attn.max(dim=-1, keepdim=True)[0]).to(torch.float32).exp_() * attn_policy
    attn = (attn + 1e-6 / n) / (attn.sum(dim=-1, keepdim=True) + 1e-6)
    return attn @ v


def test_meats_code_attention_is_the_official_policy_softmax() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 9, 8, generator=gen) for _ in range(3))
    keep = torch.rand(2, 9, generator=gen) > 0.4
    keep[:, 0] = True  # CLS
    got = policy_attention(q, k, v, keep)
    torch.testing.assert_close(got, official_softmax_with_policy(q, k, v, keep.float()), rtol=1e-5, atol=1e-6)
    everything = torch.ones(2, 9, dtype=torch.bool)  # nothing masked: softmax attention up to eps
    plain = F.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(policy_attention(q, k, v, everything), plain, rtol=1e-4, atol=1e-5)


def test_meat_runs_with_the_official_attention_and_drop_control() -> None:
    method, rt = build_runtime(tiny_config("method=meat", "method.token_attention=code", "method.drop_control=sum"))
    task = rt.benchmark.tasks[0]
    method.before_task(task)
    x, y = rt.benchmark.train[0].batch(None, 0, 8)
    method.train()
    loss, _ = method.training_loss(rt.train_tf(x), y, task)
    assert torch.isfinite(loss) and method.attentions[0].self_kept
    masks = [torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0.0, 0.0, 1.0])]
    torch.testing.assert_close(drop_control_loss(masks, 0.9, "sum"), 2 * drop_control_loss(masks, 0.9))


def test_l2p_task_slots_copy_prompts_but_not_keys_unless_asked() -> None:
    """google-research/l2p five-datasets config: shared_prompt_pool=True, shared_prompt_key=False."""
    for share_keys in (False, True):
        overrides = ("method=l2p", "method.diversify=task_slots", "method.pool_size=15", "method.top_n=5")
        method, rt = build_runtime(tiny_config(*overrides, f"method.shared_prompt_key={str(share_keys).lower()}"))
        method.before_task(rt.benchmark.tasks[0])
        method.after_task(rt.benchmark.tasks[0])
        method.before_task(rt.benchmark.tasks[1])
        assert torch.equal(method.prompts[5:10], method.prompts[0:5])
        assert torch.equal(method.keys[5:10], method.keys[0:5]) == share_keys


def test_the_batch_vote_breaks_ties_to_the_smaller_prompt_as_the_jax_code() -> None:
    """Two samples choosing disjoint prompts: every prompt has one vote; the JAX code's sorted unique + top_k keeps
    the smallest indices."""
    sim = torch.tensor([[0.9, 0.1, 0.8, 0.0, 0.0], [0.0, 0.0, 0.1, 0.9, 0.8]])
    chosen = top_k_by_key(sim, 2, batchwise=True)
    assert chosen.tolist() == [[0, 2], [0, 2]]
    keys = torch.eye(5)
    official = dual_ref.select(sim, keys, top_k=2, batchwise=True)[0]
    assert torch.equal(chosen, official)


def test_supsups_er_density_of_a_convolution_is_the_official_one_and_scores_take_weight_decay() -> None:
    """RAIVNLab/supsup er_sparsity: min(0.5, s (c_out + c_in) / (c_out c_in kh kw)); the patch embedding's kernel area
    counts in the denominator only."""
    overrides = ("method=supsup", "method.er_scale=8", "method.score_decay=1e-4")
    method, _ = build_runtime(tiny_config(*overrides, "method.layers=[patch_embed.proj,mlp.fc1]"))
    assert isinstance(method, SupSup)
    conv, fc = method.layers["patch_embed.proj"], method.layers["blocks.0.mlp.fc1"]
    c_out, c_in, kh, kw = conv.weight.shape
    assert method.density(conv) == pytest.approx(min(0.5, 8 * (c_out + c_in) / (c_out * c_in * kh * kw)))
    out_f, in_f = fc.weight.shape
    assert method.density(fc) == pytest.approx(min(0.5, 8 * (out_f + in_f) / (out_f * in_f)))
    task = method.tasks[0]
    method.before_task(task)
    groups = method.param_groups(task, method.phases(task, 1)[0])
    assert groups[-1]["weight_decay"] == 1e-4 and groups[-1]["params"] == list(method.scores.values())
