"""LAMB equals the published update formula; poly-warmup schedule; NVIDIA's weight-decay split."""
import copy
import math

import pytest
import torch

from workflow.train.optim.lamb import Lamb, PolyWarmup, make_scheduler, param_groups
from workflow.train.models.bert import BertConfig, BertForPreTraining


def reference_lamb(params, grads_per_step, lr, weight_decays, beta1=0.9, beta2=0.999, eps=1e-6, max_grad_norm=1.0,
                   dtype=torch.float64):
    """LAMB (You et al. 2019) as apex FusedLAMB computes it, written out tensor by tensor (a loop over the
    parameters, in `dtype`): the reference of Lamb's multi-tensor step."""
    params = [p.clone().to(dtype) for p in params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for t, grads in enumerate(grads_per_step, start=1):
        grads = [g.to(dtype) for g in grads]
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


def tiny_bert():
    return BertForPreTraining(BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=32))


def random_grads(parameters, steps, seed=1):
    """Per step, a gradient for each parameter; the first step's global norm above 1 (clipped), the others below."""
    generator = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=generator) * scale for p in parameters]
            for scale in (1.0, 0.01, 0.02, 0.005, 0.01)[:steps]]


def step_with(optimizer, parameters, grads_per_step):
    for grads in grads_per_step:
        for p, g in zip(parameters, grads):
            p.grad = g.clone()
        optimizer.step()


def test_the_multi_tensor_step_equals_the_per_parameter_loop_in_fp32_on_a_model_with_both_groups():
    torch.manual_seed(0)
    model = tiny_bert()
    groups = param_groups(model, 0.01)
    parameters = [p for group in groups for p in group["params"]]
    decays = [group["weight_decay"] for group in groups for _ in group["params"]]
    initial = [p.detach().clone() for p in parameters]
    grads_per_step = random_grads(parameters, steps=5)
    assert math.sqrt(sum(float(g.pow(2).sum()) for g in grads_per_step[0])) > 1.0  # step 1 is clipped

    step_with(Lamb(groups, lr=0.01), parameters, grads_per_step)
    expected = reference_lamb(initial, grads_per_step, lr=0.01, weight_decays=decays, dtype=torch.float32)
    for got, want in zip(parameters, expected):
        torch.testing.assert_close(got.detach(), want, rtol=1e-7, atol=1e-7)


def test_a_resumed_lamb_steps_exactly_as_one_never_stopped_with_apex_fusedlamb_state_layout():
    torch.manual_seed(0)
    model = tiny_bert()
    parameters = list(model.parameters())
    grads_per_step = random_grads(parameters, steps=4)
    straight = Lamb(param_groups(model, 0.01), lr=0.01)
    initial = [p.detach().clone() for p in parameters]
    step_with(straight, parameters, grads_per_step)
    finished = [p.detach().clone() for p in parameters]

    with torch.no_grad():
        for p, value in zip(parameters, initial):
            p.copy_(value)
    first = Lamb(param_groups(model, 0.01), lr=0.01)
    step_with(first, parameters, grads_per_step[:2])
    saved = copy.deepcopy(first.state_dict())
    assert all(set(state) == {"exp_avg", "exp_avg_sq"} for state in saved["state"].values())  # apex's keys
    assert [group["step"] for group in saved["param_groups"]] == [2, 2]  # the count lives in the groups, as apex's
    resumed = Lamb(param_groups(model, 0.01), lr=0.01)
    resumed.load_state_dict(saved)
    step_with(resumed, parameters, grads_per_step[2:])
    for got, want in zip(parameters, finished):
        assert torch.equal(got.detach(), want)


def test_no_weight_decay_on_biases_and_layernorm():
    model = tiny_bert()
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


def test_adamw_step_is_decoupled_decay_with_bias_correction_and_no_decay_on_biases_and_layernorm():
    from workflow.train.optim.optimizers import engine_clip, make_optimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("dense", torch.nn.Linear(4, 3))
    model.add_module("LayerNorm", torch.nn.LayerNorm(3))  # BERT's name, which param_groups exempts
    model.LayerNorm.weight.data.uniform_(0.5, 1.5)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer, name = make_optimizer("adamw", model, lr=0.1, weight_decay=0.5, betas=(0.9, 0.99), eps=1e-6)
    assert name == "torch.AdamW" and engine_clip("adamw", 1.0) == 1.0 and engine_clip("lamb", 1.0) is None
    model(torch.randn(5, 4)).pow(2).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    optimizer.step()
    for key, p in model.named_parameters():
        g, wd = grads[key], (0.5 if key == "dense.weight" else 0.0)  # decay on the Linear's weight only
        m, v = 0.1 * g / (1 - 0.9), 0.01 * g * g / (1 - 0.99)
        expected = before[key] * (1 - 0.1 * wd) - 0.1 * m / (v.sqrt() + 1e-6)
        torch.testing.assert_close(p.detach(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("first, then", [("adamw", "lamb"), ("lamb", "adamw"), ("adamw", "adamw")])
def test_moments_carry_from_either_optimizer_into_either_with_the_step_count_reset(tmp_path, first, then):
    from workflow.train.optim.optimizers import carry_optimizer_state, make_optimizer

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer, _ = make_optimizer(first, model, lr=0.01)
    for _ in range(3):
        model(torch.randn(5, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    path = tmp_path / "optimizer_state.pt"
    torch.save({"state": optimizer.state_dict()["state"], "shapes": [list(p.shape) for p in model.parameters()]},
               path)
    fresh, _ = make_optimizer(then, model, lr=0.01)
    carry_optimizer_state(fresh, str(path))
    for index, p in enumerate(model.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(fresh.state[p][key], optimizer.state[p][key])
        assert float(fresh.state[p].get("step", 0)) == 0.0
    assert all(group.get("step", 0) == 0 for group in fresh.param_groups)
    model(torch.randn(5, 4)).sum().backward()
    fresh.step()  # the carried state steps


def test_an_optimizer_state_key_neither_optimizer_has_is_one_error_naming_it(tmp_path):
    from workflow.cli import UserError
    from workflow.train.optim.optimizers import carry_optimizer_state, make_optimizer

    model = torch.nn.Linear(2, 2)
    amsgrad = torch.optim.AdamW(model.parameters(), lr=0.01, amsgrad=True)
    model(torch.randn(3, 2)).sum().backward()
    amsgrad.step()
    path = tmp_path / "optimizer_state.pt"
    torch.save({"state": amsgrad.state_dict()["state"], "shapes": [list(p.shape) for p in model.parameters()]}, path)
    with pytest.raises(UserError, match=r"^.*optimizer_state\.pt: optimizer state key 'max_exp_avg_sq' is not one of "
                                        r"LAMB's and AdamW's \(exp_avg, exp_avg_sq\)"):
        carry_optimizer_state(make_optimizer("lamb", model, lr=0.01)[0], str(path))
