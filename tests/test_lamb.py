"""LAMB equals the published update formula; poly-warmup schedule; NVIDIA's weight-decay split."""
import math

import torch

from workflow.train.lamb import Lamb, PolyWarmup, make_scheduler, param_groups
from workflow.train.model import BertConfig, BertForPreTraining


def reference_lamb(params, grads_per_step, lr, weight_decays, beta1=0.9, beta2=0.999, eps=1e-6, max_grad_norm=1.0):
    """LAMB (You et al. 2019) as apex FusedLAMB computes it, written out tensor by tensor."""
    params = [p.clone().double() for p in params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for t, grads in enumerate(grads_per_step, start=1):
        grads = [g.double() for g in grads]
        global_norm = math.sqrt(sum(float((g * g).sum()) for g in grads))
        divisor = max(1.0, global_norm / max_grad_norm)
        for i, (p, g, wd) in enumerate(zip(params, grads, weight_decays)):
            g = g / divisor
            m[i] = beta1 * m[i] + (1 - beta1) * g
            v[i] = beta2 * v[i] + (1 - beta2) * g * g
            m_hat = m[i] / (1 - beta1 ** t)
            v_hat = v[i] / (1 - beta2 ** t)
            update = m_hat / (v_hat.sqrt() + eps) + wd * p
            ratio = 1.0
            if wd != 0:
                p_norm, u_norm = float(p.norm()), float(update.norm())
                ratio = p_norm / u_norm if p_norm > 0 and u_norm > 0 else 1.0
            params[i] = p - lr * ratio * update
    return params


def test_lamb_step_equals_the_formula_with_clipping_decay_and_trust_ratio():
    generator = torch.Generator().manual_seed(0)
    shapes = [(4, 3), (3,), (5,), (2, 2)]
    decays = [0.01, 0.0, 0.0, 0.01]
    initial = [torch.randn(s, generator=generator) for s in shapes]
    initial[3] = torch.zeros(2, 2)  # zero weight: trust ratio falls back to 1
    # Large gradients on step 1 (global norm > 1: pre-normalised), small ones on steps 2-3 (not clipped).
    steps = [[torch.randn(s, generator=generator) * scale for s in shapes] for scale in (5.0, 0.1, 0.2)]

    params = [torch.nn.Parameter(p.clone()) for p in initial]
    optimizer = Lamb([{"params": [params[0], params[3]], "weight_decay": 0.01},
                      {"params": [params[1], params[2]], "weight_decay": 0.0}], lr=0.05)
    for grads in steps:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        optimizer.step()
    expected = reference_lamb(initial, steps, lr=0.05, weight_decays=decays)
    for got, want in zip(params, expected):
        assert torch.allclose(got.double(), want, atol=1e-6, rtol=1e-5), (got, want)
    assert abs(float(optimizer.last_grad_norm) - math.sqrt(sum(float((g * g).sum()) for g in steps[-1]))) < 1e-5


def test_no_weight_decay_on_biases_and_layernorm():
    model = BertForPreTraining(BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                          intermediate_size=32))
    decay, no_decay = param_groups(model, 0.01)
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0
    assert all("bias" in names[id(p)] or "LayerNorm" in names[id(p)] for p in no_decay["params"])
    assert all(names[id(p)].endswith("weight") and "LayerNorm" not in names[id(p)] for p in decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_poly_warmup_schedule_matches_nvidia():
    schedule = PolyWarmup(total_steps=100, warmup_proportion=0.1)
    assert math.isclose(schedule(0), 0.1)  # step 1 of 100: 0.01 / 0.1
    assert math.isclose(schedule(8), 0.9)  # linear warmup
    assert math.isclose(schedule(9), 0.9 ** 0.5)  # warmup over: (1 - progress) ** 0.5
    assert math.isclose(schedule(49), 0.5 ** 0.5)
    assert schedule(99) == 0.0
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = Lamb([parameter], lr=6e-3)
    scheduler = make_scheduler(optimizer, 100, 0.1)
    assert math.isclose(optimizer.param_groups[0]["lr"], 6e-4)
    optimizer.step()
    for _ in range(49):
        scheduler.step()
    assert math.isclose(optimizer.param_groups[0]["lr"], 6e-3 * 0.5 ** 0.5)
