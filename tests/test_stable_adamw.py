"""pretrain.optimizer: stable_adamw is torch-optimi's StableAdamW wired right: its own step on the same gradients, the
weight-decay groups, fully decoupled decay, its state carried into phase 2, its name in the fingerprint."""
import contextlib
import copy

import optimi
import pytest
import torch

from workflow.cli import UserError
from workflow.config import optimizer_config_error, validate_config
from workflow.train.models.bert import BertConfig, BertForPreTraining
from workflow.train.optim.optimizers import carry_optimizer_state, engine_clip, make_optimizer, state_to_carry

SMALL = BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                   max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def tiny_bert() -> BertForPreTraining:
    torch.manual_seed(0)
    return BertForPreTraining(SMALL)


def gradients(model, seed: int) -> None:
    """Gradients of a made-up loss of every parameter (the same for any copy of `model` given `seed`)."""
    generator = torch.Generator().manual_seed(seed)
    loss = sum((p * torch.randn(p.shape, generator=generator)).sum() + (p ** 2).sum() for p in model.parameters())
    loss.backward()


def reference_groups(model, weight_decay):
    """Decay on every matrix and embedding; none on biases and LayerNorm (by name, as NVIDIA splits BERT)."""
    exempt = [p for name, p in model.named_parameters() if name.endswith("bias") or "LayerNorm" in name]
    decayed = [p for name, p in model.named_parameters() if not (name.endswith("bias") or "LayerNorm" in name)]
    return [{"params": decayed, "weight_decay": weight_decay}, {"params": exempt, "weight_decay": 0.0}]


@pytest.mark.parametrize("fused", [True, False])
def test_the_step_is_torch_optimis_own_on_the_same_gradients_with_decay_on_the_right_groups_fully_decoupled(fused):
    ours_model, theirs_model = tiny_bert(), tiny_bert()
    ours, name = make_optimizer("stable_adamw", ours_model, lr=1e-2, weight_decay=0.3, max_grad_norm=None,
                                betas=(0.9, 0.98), eps=1e-6, fused=fused, decouple_lr=True)
    assert name == f"optimi.StableAdamW ({'foreach' if fused else 'for-loop'}, decouple_lr)"
    assert isinstance(ours, optimi.StableAdamW)
    theirs = optimi.StableAdamW(reference_groups(theirs_model, 0.3), lr=1e-2, betas=(0.9, 0.98), eps=1e-6,
                                weight_decay=0.3, decouple_lr=True, foreach=fused, triton=False)
    assert [len(g["params"]) for g in ours.param_groups] == [len(g["params"]) for g in theirs.param_groups]
    assert [g["weight_decay"] for g in ours.param_groups] == [0.3, 0.0]
    assert all(g["max_lr"] == 1e-2 and g["decouple_lr"] for g in ours.param_groups)
    decays = {name: p.detach().clone() for name, p in ours_model.named_parameters()}
    for step, lr in enumerate([1e-2, 5e-3, 2.5e-3]):  # a schedule below the peak: decay scales by lr / peak
        for model, optimizer in ((ours_model, ours), (theirs_model, theirs)):
            for group in optimizer.param_groups:
                group["lr"] = lr
            gradients(model, seed=step)
            optimizer.step()
            optimizer.zero_grad()
    for (name, got), expected in zip(ours_model.named_parameters(), theirs_model.parameters()):
        assert torch.equal(got, expected), name
        assert not torch.equal(got, decays[name]), name  # every parameter moved
    # Fully decoupled: the decay of one step is wd x lr / peak (not wd x lr), on the decayed group only.
    probe = tiny_bert()
    optimizer, _ = make_optimizer("stable_adamw", probe, lr=1e-2, weight_decay=0.3, fused=fused)
    before = {name: p.detach().clone() for name, p in probe.named_parameters()}
    for p in probe.parameters():
        p.grad = torch.zeros_like(p)  # no gradient: the step is the decay alone
    optimizer.step()
    for name, p in probe.named_parameters():
        factor = 1.0 if name.endswith("bias") or "LayerNorm" in name else 1 - 0.3
        torch.testing.assert_close(p.detach(), before[name] * factor, rtol=1e-6, atol=0), name


def test_no_clipping_unless_configured():
    assert engine_clip("stable_adamw", None) is None and engine_clip("stable_adamw", 0) is None
    assert engine_clip("stable_adamw", 1.0) == 1.0


def test_its_state_carries_into_phase_2_and_the_next_step_continues_phase_1s(tmp_path):
    model = tiny_bert()
    phase1, _ = make_optimizer("stable_adamw", model, lr=1e-2, weight_decay=1e-5)
    for step in range(3):
        gradients(model, seed=step)
        phase1.step()
        phase1.zero_grad()
    path = tmp_path / "optimizer_state.pt"
    torch.save(state_to_carry(phase1), path)
    phase2_model = copy.deepcopy(model)
    phase2, _ = make_optimizer("stable_adamw", phase2_model, lr=1e-2, weight_decay=1e-5)
    carry_optimizer_state(phase2, str(path))
    for p, q in zip(model.parameters(), phase2_model.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "eps_sq"):
            assert torch.equal(phase2.state[q][key], phase1.state[p][key]), key
    assert [int(g["step"]) for g in phase2.param_groups] == [3, 3]
    # One more step of each on the same gradients: phase 2 goes on where phase 1 was (the same weights after).
    for m, optimizer in ((model, phase1), (phase2_model, phase2)):
        gradients(m, seed=9)
        optimizer.step()
    for p, q in zip(model.parameters(), phase2_model.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("first", ["lamb", "adamw"])
def test_lamb_or_adamw_moments_carry_into_stable_adamw_and_its_moments_into_them(tmp_path, first):
    model = tiny_bert()
    other, _ = make_optimizer(first, model, lr=1e-3)
    gradients(model, seed=0)
    other.step()
    torch.save(state_to_carry(other), tmp_path / "other.pt")
    stable, _ = make_optimizer("stable_adamw", model, lr=1e-3)
    carry_optimizer_state(stable, str(tmp_path / "other.pt"))
    for p in model.parameters():
        assert torch.equal(stable.state[p]["exp_avg"], other.state[p]["exp_avg"])
    stable.zero_grad()
    gradients(model, seed=1)
    stable.step()  # the carried state steps
    torch.save(state_to_carry(stable), tmp_path / "stable.pt")
    back, _ = make_optimizer(first, model, lr=1e-3)
    carry_optimizer_state(back, str(tmp_path / "stable.pt"))
    for p in model.parameters():
        assert torch.equal(back.state[p]["exp_avg_sq"], stable.state[p]["exp_avg_sq"])


def test_a_stable_adamw_key_set_under_another_optimizer_is_one_error_naming_it():
    config = validate_config({"pretrain": {"optimizer": "adamw", "stable_adamw": {"decouple_lr": False}}})
    assert optimizer_config_error(config["pretrain"]) == (
        "config pretrain.stable_adamw.decouple_lr: False is set, but pretrain.optimizer is adamw, which reads "
        "pretrain.adamw; adamw has no decouple_lr, or pretrain.optimizer: stable_adamw")
    config = validate_config({"pretrain": {"optimizer": "stable_adamw", "adamw": {"eps": 1e-8}}})
    assert optimizer_config_error(config["pretrain"]).startswith("config pretrain.adamw.eps: 1e-08 is set, but "
                                                                 "pretrain.optimizer is stable_adamw")
    config = validate_config({"pretrain": {"optimizer": "stable_adamw", "stable_adamw": {"beta2": 0.95}}})
    assert optimizer_config_error(config["pretrain"]) is None
    assert config["pretrain"]["stable_adamw"] == {"weight_decay": 1e-5, "beta1": 0.9, "beta2": 0.95, "eps": 1e-6,
                                                  "max_grad_norm": None, "decouple_lr": True, "fused": True}


def test_the_fingerprint_names_stable_adamw_and_its_settings_and_a_lamb_runs_keeps_its_keys():
    from workflow.train.pretrain import TrainSettings, _fingerprint

    def fingerprint(optimizer):
        config = validate_config({"model": {"bert_config": None}, "pretrain": {"optimizer": optimizer}})
        s = TrainSettings.from_config(config, "phase1", data_dir="d", vocab="", run_dir="r", out_model="m",
                                      out_metrics="x", out_summary="s")
        name = make_optimizer(optimizer, tiny_bert(), 1e-3, fused=False)[1]
        return _fingerprint(s, SMALL, {}, name)

    stable = fingerprint("stable_adamw")
    assert stable["optimizer"] == "optimi.StableAdamW (for-loop, decouple_lr)"
    assert {k: v for k, v in stable.items() if k.startswith("pretrain.stable_adamw")} == {
        "pretrain.stable_adamw.decouple_lr": True, "pretrain.stable_adamw.weight_decay": 1e-5,
        "pretrain.stable_adamw.beta1": 0.9, "pretrain.stable_adamw.beta2": 0.98, "pretrain.stable_adamw.eps": 1e-6,
        "pretrain.stable_adamw.max_grad_norm": None}
    lamb = fingerprint("lamb")
    assert not [k for k in lamb if "stable_adamw" in k or "schedule" in k or "batch_size_warmup" in k]


def test_without_torch_optimi_stable_adamw_is_one_error_naming_the_package(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "optimi", None)
    with pytest.raises(UserError, match=r"stable_adamw needs torch-optimi \(pip install torch-optimi==0\.3\.3\)"):
        make_optimizer("stable_adamw", tiny_bert(), 1e-3)


def test_a_modernbert_trains_with_no_decay_on_its_norms_and_biases():
    from workflow.train.models.modernbert import ModernBertConfig, ModernBertForMaskedLM

    model = ModernBertForMaskedLM(ModernBertConfig(vocab_size=97, hidden_size=32, intermediate_size=48,
                                                   num_hidden_layers=3, num_attention_heads=2, local_attention=8,
                                                   max_position_embeddings=64, norm_bias=True, pad_token_id=0,
                                                   eos_token_id=2, bos_token_id=1, cls_token_id=1, sep_token_id=2))
    optimizer, _ = make_optimizer("stable_adamw", model, lr=8e-4, weight_decay=1e-5)
    names = {id(p): name for name, p in model.named_parameters()}
    decayed, exempt = ({names[id(p)] for p in group["params"]} for group in optimizer.param_groups)
    assert exempt == {n for n in names.values() if "norm" in n or n.endswith("bias")} and exempt
    assert "model.embeddings.tok_embeddings.weight" in decayed
    assert [g["weight_decay"] for g in optimizer.param_groups] == [1e-5, 0.0]


# ---------------------------------------------------------------- the Triton path, on CPU through a stand-in


def triton_on_cpu(monkeypatch, compiles: bool) -> list:
    """torch-optimi's StableAdamW with a triton=True path that runs on CPU (its foreach arithmetic), or, when the
    kernel does not compile, raises at its first step what Triton raises without a C compiler; the Triton
    optimizers made, in a list."""
    import optimi.utils

    made = []

    class TritonOnCpu(optimi.StableAdamW):
        def __init__(self, params, *, triton=None, foreach=None, **kwargs):
            super().__init__(params, triton=False, foreach=bool(triton or foreach), **kwargs)
            self.triton = triton
            if triton:
                made.append(self)

        def step(self, closure=None):
            if self.triton and not compiles:
                raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable.")
            return super().step(closure)

    monkeypatch.setattr(optimi.utils, "HAS_TRITON", True)
    monkeypatch.setattr(optimi, "StableAdamW", TritonOnCpu)
    monkeypatch.setattr("workflow.train.optim.optimizers.TRITON_DEVICE_TYPES", ("cuda", "cpu"))
    return made


@contextlib.contextmanager
def deterministic(enabled: bool):
    """torch.use_deterministic_algorithms(enabled) within the block (another test may have left it on)."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(enabled)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


@deterministic(False)
def test_a_triton_kernel_that_cannot_compile_is_one_error_line_naming_the_key(monkeypatch):
    triton_on_cpu(monkeypatch, compiles=False)
    with pytest.raises(UserError, match=r"^config pretrain.stable_adamw.fused: torch-optimi's Triton kernel does not "
                                        r"compile or run here \(Failed to find C compiler. Please specify via CC "
                                        r"environment variable.\); give the job a C compiler \(CC\) and libcuda, or "
                                        r"set pretrain.stable_adamw.fused: false$"):
        make_optimizer("stable_adamw", tiny_bert(), lr=1e-3, fused=True)
    _, name = make_optimizer("stable_adamw", tiny_bert(), lr=1e-3, fused=False)  # the way out: its for-loop
    assert name == "optimi.StableAdamW (for-loop, decouple_lr)"


def test_the_triton_path_is_tried_once_before_training_and_deterministic_runs_take_foreach(monkeypatch):
    made = triton_on_cpu(monkeypatch, compiles=True)
    with deterministic(False):
        optimizer, name = make_optimizer("stable_adamw", tiny_bert(), lr=1e-3, fused=True)
    assert name == "optimi.StableAdamW (triton, decouple_lr)" and optimizer.triton
    assert len(made) == 2 and made[0].param_groups[0]["params"][0].shape == (16,)  # the throwaway step, then ours
    made.clear()
    with deterministic(True):  # --deterministic: the kernel's atomic adds sum in any order
        optimizer, name = make_optimizer("stable_adamw", tiny_bert(), lr=1e-3, fused=True)
    assert name == "optimi.StableAdamW (foreach, decouple_lr)" and not optimizer.triton and made == []
