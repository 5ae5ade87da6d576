"""Each attention path names the torch and GPU it needs (workflow.train.models.kernels); below its floor a job trains
on the next path with one warning naming what to upgrade, never a crash at the first step. On CPU through stand-ins
that keep the real API at each boundary (a torch version below a path's floor, a GPU of compute capability 7.5, the
flash-attn package's flash_attn_varlen_func), the kernels themselves through flash_varlen's exact CPU reference."""
import importlib.machinery
import importlib.metadata
import logging
import subprocess
import sys
from pathlib import Path
import types

import pytest
import torch

from tests.test_flash_varlen import CONFIG as BERT_CONFIG, packed_rows
from tests.test_modernbert import packed_batch, small_config, training_batch
from tests.test_pretrain import packed_data, settings  # noqa: F401  (the packed_data fixture)
from workflow.train import accelerator
from workflow.train.models import kernels, kit, modernbert
from workflow.train.models.bert import BertForPreTraining
from workflow.train.models.flash_varlen import flash_varlen
from workflow.train.models.floors import head_floor_warning
from workflow.train.models.kernels import (FLASH_ATTN, FLASH_VARLEN, NESTED_SDPA, ROWS, WINDOWED_FLASH_VARLEN,
                                           attention_path, trained_path)
from workflow.train.models.modernbert import ModernBertForMaskedLM
from workflow.train.precision import autocast
from workflow.train.pretrain import forward

CPU = torch.device("cpu")
H100, T4 = (9, 0), (7, 5)

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("family, version, capability, flash_attn, expected", [
    ("modernbert", (2, 11), H100, False, WINDOWED_FLASH_VARLEN),
    ("modernbert", (2, 10), H100, False, ROWS),          # torch's varlen kernels without its window
    ("modernbert", (2, 10), H100, True, FLASH_ATTN),
    ("modernbert", (2, 8), H100, True, FLASH_ATTN),
    ("modernbert", (2, 13), T4, True, ROWS),             # no flash kernels below sm80, flash-attn 2's neither
    ("bert", (2, 7), H100, False, FLASH_VARLEN),
    ("bert", (2, 6), H100, False, NESTED_SDPA),          # its flash backward takes philox_seed, not rng_state
    ("bert", (2, 6), H100, True, FLASH_ATTN),
    ("bert", (2, 13), T4, True, NESTED_SDPA),
])
def test_each_path_trains_at_its_torch_and_gpu_floor_and_falls_back_below_it(family, version, capability,
                                                                             flash_attn, expected):
    assert attention_path(family, version, "cuda", capability, torch.bfloat16, flash_attn) == expected
    exact = {"bert": NESTED_SDPA, "modernbert": ROWS}[family]
    assert attention_path(family, version, "cuda", capability, torch.float32, flash_attn) == exact  # fp32
    assert attention_path(family, version, "cpu", None, torch.bfloat16, flash_attn) == exact


@pytest.fixture
def platform(monkeypatch):
    """This process as another: set(torch=..., capability=..., flash_attn=...); what kernels found is forgotten
    before and after."""
    kernels.forget()
    monkeypatch.setattr(kit, "VARLEN_DEVICE_TYPES", ("cuda", "cpu"))

    def set_(torch_version: str = torch.__version__, capability=H100, flash_attn=None):
        monkeypatch.setattr(torch, "__version__", torch_version)
        monkeypatch.setattr(accelerator, "compute_capability", lambda device: capability)
        if flash_attn is not None:
            package = types.ModuleType("flash_attn")
            package.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)  # as an imported package has
            package.flash_attn_varlen_func = flash_attn
            monkeypatch.setitem(sys.modules, "flash_attn", package)
        else:
            monkeypatch.setitem(sys.modules, "flash_attn", None)  # `import flash_attn` raises ImportError
        kernels.forget()

    yield set_
    kernels.forget()


def flash_attn_standin(calls: list):
    """flash-attn 2's flash_attn_varlen_func (flash_attn/flash_attn_interface.py): its signature and limits (16-bit,
    int32 offsets, window_size (left, right), -1 unbounded) on CPU, each call recorded."""

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                               alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None):
        assert q.dtype in (torch.float16, torch.bfloat16) and not causal and not return_attn_probs
        calls.append((tuple(window_size), dropout_p))
        window = None if tuple(window_size) == (-1, -1) else window_size[0]
        assert window_size[0] == window_size[1] and torch.equal(cu_seqlens_q, cu_seqlens_k)
        return flash_varlen(q, k, v, cu_seqlens_q, max_seqlen_q, dropout_p, window)

    return flash_attn_varlen_func


def recording_flash_varlen(calls: list):
    """flash_varlen itself, each call's window and dropout recorded."""

    def recording(q, k, v, offsets, max_seqlen, dropout_p=0.0, window=None):
        calls.append((window, dropout_p))
        return flash_varlen(q, k, v, offsets, max_seqlen, dropout_p, window)

    return recording


def modernbert_logits(model, batch):
    with torch.no_grad(), autocast(CPU, "bf16"):
        logits, _ = model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"],
                          batch["masked_lm_positions"], batch.get("position_ids"), batch.get("cls_positions"),
                          masked_lm_index=batch["masked_lm_index"], unpadded=kit.unpadded_of(batch),
                          mask_needed=batch["mask_needed"])
    return logits.float()


def floor_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == kernels.__name__ and r.levelno == logging.WARNING]


@pytest.fixture
def modernbert_rows(monkeypatch):
    """A tiny ModernBERT, a packed training batch, and its logits as rows with dense masks (bf16)."""
    torch.manual_seed(0)
    model = ModernBertForMaskedLM(small_config()).eval()
    batch = training_batch(*packed_batch())
    with monkeypatch.context() as rows_only:
        rows_only.setattr(kit, "VARLEN_DEVICE_TYPES", ())
        return model, batch, modernbert_logits(model, batch)


@pytest.mark.parametrize("version", ["2.10.0+cu128", "2.8.0"])
def test_modernbert_below_torch_2_11_trains_as_rows_with_one_warning_naming_the_upgrade(
        platform, modernbert_rows, monkeypatch, caplog, version):
    model, batch, rows = modernbert_rows
    calls = []
    platform(torch_version=version)
    monkeypatch.setattr(modernbert, "flash_varlen", recording_flash_varlen(calls))
    for _ in range(2):
        assert torch.equal(modernbert_logits(model, batch), rows)
    assert calls == []
    assert floor_warnings(caplog) == [
        f"ModernBERT's windowed varlen flash attention needs torch >= 2.11 and compute "
        f"capability >= 8.0; torch {version} lacks it: training with rows with masks (exact, slower) instead; "
        f"upgrade torch to >= 2.11 (or pip install flash-attn)"]
    assert trained_path("modernbert", torch.device("cuda"), torch.bfloat16) == ROWS
    assert accelerator.attention_kernel(torch.device("cuda"), torch.bfloat16, 64, family="modernbert") == ROWS


def test_modernbert_below_torch_2_11_trains_with_flash_attns_windowed_kernel_where_installed(
        platform, modernbert_rows, monkeypatch, caplog):
    model, batch, rows = modernbert_rows
    calls = []
    platform(torch_version="2.10.0", flash_attn=flash_attn_standin(calls))
    monkeypatch.setattr(modernbert, "flash_varlen", recording_flash_varlen([]))
    unpadded = modernbert_logits(model, batch)
    window = model.config.sliding_window
    assert calls == [((-1, -1) if kind == "full_attention" else (window, window), 0.0)
                     for kind in model.config.layer_types]
    assert (unpadded - rows).abs().max() <= 0.03 * rows.abs().max()  # bf16 rounding of another summation order
    assert [m.split("; ")[1:] for m in floor_warnings(caplog)] == [[
        "torch 2.10.0 lacks it: training with flash-attn's flash_attn_varlen_func instead",
        "upgrade torch to >= 2.11"]]
    assert accelerator.attention_kernel(torch.device("cuda"), torch.bfloat16, 64, family="modernbert") == FLASH_ATTN


def test_modernbert_at_torch_2_11_calls_torchs_varlen_flash_kernels_with_its_window(platform, modernbert_rows,
                                                                                     monkeypatch, caplog):
    model, batch, _ = modernbert_rows
    calls, flash_attn_calls = [], []
    platform(torch_version="2.11.0", flash_attn=flash_attn_standin(flash_attn_calls))
    monkeypatch.setattr(modernbert, "flash_varlen", recording_flash_varlen(calls))
    modernbert_logits(model, batch)
    window = model.config.sliding_window
    assert calls == [(None if kind == "full_attention" else window, 0.0) for kind in model.config.layer_types]
    assert flash_attn_calls == [] and floor_warnings(caplog) == []
    kernel = accelerator.attention_kernel(torch.device("cuda"), torch.bfloat16, 64, family="modernbert")
    assert kernel == WINDOWED_FLASH_VARLEN


def test_modernbert_on_a_gpu_below_sm80_trains_as_rows(platform, modernbert_rows, monkeypatch, caplog):
    model, batch, rows = modernbert_rows
    calls = []
    platform(capability=T4, flash_attn=flash_attn_standin(calls))
    monkeypatch.setattr(modernbert, "flash_varlen", recording_flash_varlen(calls))
    assert torch.equal(modernbert_logits(model, batch), rows)
    assert floor_warnings(caplog)[0].endswith(
        "this GPU (compute capability 7.5) has no flash kernels: training with rows with masks (exact, slower) "
        "instead; a GPU of compute capability >= 8.0 (A100, L4, H100 or newer) runs it")


def bert_loss(model, batch):
    with autocast(CPU, "bf16"):
        return forward(model, batch)[0].float().sum()


@pytest.fixture
def bert_flash_on_cpu(monkeypatch):
    """BERT's 16-bit packed path on CPU: flash_varlen (its CPU reference), recording its calls' dropout."""
    calls = []

    def recording(q, k, v, offsets, max_seqlen, dropout_p=0.0):
        calls.append(dropout_p)
        return flash_varlen(q, k, v, offsets, max_seqlen, dropout_p)

    monkeypatch.setattr(kit, "flash_varlen", recording)
    monkeypatch.setattr(kit, "runs_flash_varlen", lambda q: q.dtype == torch.bfloat16)
    return calls


@pytest.mark.parametrize("version, capability, why", [
    ("2.13.0", T4, "this GPU (compute capability 7.5) has no flash kernels"),
    ("2.6.0", H100, "torch 2.6.0 lacks it")])
def test_bert_below_its_flash_floor_trains_with_nested_sdpa_and_one_warning(platform, bert_flash_on_cpu, caplog,
                                                                           version, capability, why):
    platform(torch_version=version, capability=capability)
    torch.manual_seed(0)
    model = BertForPreTraining(BERT_CONFIG).eval()
    batch = kit.host_indices(packed_rows())
    with torch.no_grad():
        bert_loss(model, batch)
        bert_loss(model, batch)
    assert bert_flash_on_cpu == []
    [warning] = floor_warnings(caplog)
    assert warning.startswith("BERT's varlen flash attention with dropout needs torch >= 2.7 and compute capability "
                              f">= 8.0; {why}: training with nested SDPA (exact, ~4x slower) instead")


def test_bert_below_torch_2_7_trains_with_flash_attns_kernel_and_its_dropout_where_installed(platform,
                                                                                           bert_flash_on_cpu):
    calls = []
    platform(torch_version="2.6.0", flash_attn=flash_attn_standin(calls))
    torch.manual_seed(0)
    model = BertForPreTraining(BERT_CONFIG).train()
    bert_loss(model, kit.host_indices(packed_rows())).backward()
    assert calls == [((-1, -1), BERT_CONFIG.attention_probs_dropout_prob)] * BERT_CONFIG.num_hidden_layers
    assert bert_flash_on_cpu == []
    platform(torch_version="2.7.0", flash_attn=flash_attn_standin(calls))  # at the floor: torch's own kernels
    bert_loss(model, kit.host_indices(packed_rows()))
    assert bert_flash_on_cpu == [BERT_CONFIG.attention_probs_dropout_prob] * BERT_CONFIG.num_hidden_layers


def test_the_reported_bert_kernel_is_the_one_that_trains(platform):
    platform(capability=T4)
    assert trained_path("bert", torch.device("cuda"), torch.float16) == NESTED_SDPA
    platform(capability=H100)
    assert trained_path("bert", torch.device("cuda"), torch.bfloat16) == FLASH_VARLEN
    assert trained_path("bert", torch.device("cuda"), torch.float32) == NESTED_SDPA
    assert accelerator.attention_kernel(CPU, torch.bfloat16, 64, "bert") == "math"  # nested SDPA off CUDA


def test_roberta_trains_berts_encoder_and_its_kernel(platform):
    platform(capability=H100)
    assert trained_path("roberta", torch.device("cuda"), torch.bfloat16) == FLASH_VARLEN
    platform(torch_version="2.6.0")
    assert trained_path("roberta", torch.device("cuda"), torch.bfloat16) == NESTED_SDPA


BERT_FLOOR = "BERT's varlen flash attention with dropout needs torch >= 2.7 and compute capability >= 8.0; "
MODERNBERT_FLOOR = "ModernBERT's windowed varlen flash attention needs torch >= 2.11 and compute capability >= 8.0; "


@pytest.mark.parametrize("family, precision, packed, version, flash_attn, expected", [
    ("bert", "auto", True, "2.6.0", False, BERT_FLOOR + "torch 2.6.0 lacks it (the jobs' torch: {here}): training "
     "with nested SDPA (exact, ~4x slower) instead; upgrade torch to >= 2.7 (or pip install flash-attn)"),
    ("bert", "bf16", True, "2.6.0", True, BERT_FLOOR + "torch 2.6.0 lacks it (the jobs' torch: {here}): training "
     "with flash-attn's flash_attn_varlen_func instead; upgrade torch to >= 2.7"),
    ("modernbert", "fp16", False, "2.10.0+cu128", False, MODERNBERT_FLOOR + "torch 2.10.0+cu128 lacks it (the jobs' "
     "torch: {here}): training with rows with masks (exact, slower) instead; upgrade torch to >= 2.11 (or pip "
     "install flash-attn)"),  # every ModernBERT batch trains unpadded in 16-bit
    ("bert", "auto", True, "2.7.0", False, None),
    ("modernbert", "auto", True, "2.11.0", False, None),
    ("bert", "bf16", False, "2.6.0", False, None),      # unpacked BERT: padded rows, no varlen kernel
    ("bert", "fp32", True, "2.6.0", False, None),       # fp32: the exact path whatever the torch
    ("modernbert", "fp32", True, "2.6.0", False, None),
    ("bert", "fp32", False, "2.3.1", False, "torch 2.3.1: snakebert trains with torch >= 2.4 (its attention kernels are "
     "torch.library custom ops, new in 2.4); upgrade torch (NGC's PyTorch containers have 2.4 from 24.07) (the jobs' "
     "torch: {here}); the data stages run, each training job stops at its start"),  # below the floor: any precision
])
def test_the_head_warns_as_the_job_will_when_the_jobs_torch_is_its_own(platform, family, precision, packed, version,
                                                                       flash_attn, expected):
    platform(torch_version=version, flash_attn=flash_attn_standin([]) if flash_attn else None)
    expected = expected and expected.format(here=f"this interpreter's, {sys.executable}")
    assert head_floor_warning(family, precision, packed, None) == expected


@pytest.mark.parametrize("pins, expected", [
    (["torch==2.10.0"], MODERNBERT_FLOOR + "torch 2.10.0 lacks it (the jobs' torch: {env}'s pin): training with rows "
     "with masks (exact, slower) instead; pin torch >= 2.11 in {env} (or add flash-attn to it)"),
    (["torch==2.10.0", "flash_attn==2.7.4"], MODERNBERT_FLOOR + "torch 2.10.0 lacks it (the jobs' torch: {env}'s "
     "pin): training with flash-attn's flash_attn_varlen_func instead; pin torch >= 2.11 in {env}"),
    (["torch==2.13.0"], None),
    (["torch>=2.5"], None),  # no exact pin: what conda resolves is not known at the head
    (["torch==2.3.1"], "torch 2.3.1: snakebert trains with torch >= 2.4 (its attention kernels are torch.library "
     "custom ops, new in 2.4); upgrade torch (NGC's PyTorch containers have 2.4 from 24.07) (the jobs' torch: {env}'s "
     "pin); the data stages run, each training job stops at its start"),
])
def test_under_conda_the_head_compares_the_envs_torch_pin_not_its_own(platform, tmp_path, pins, expected):
    platform(torch_version="2.13.0")  # the head's own torch has no say
    env = tmp_path / "train.yaml"
    env.write_text("channels: [conda-forge]\ndependencies:\n  - python=3.11\n  - pip\n  - pip:\n"
                   "      - --extra-index-url https://download.pytorch.org/whl/cu128\n"
                   + "".join(f"      - {pin}  # why\n" for pin in pins))
    assert head_floor_warning("modernbert", "auto", True, str(env)) == (expected and expected.format(env=env))


def start_job(s, device: torch.device, monkeypatch) -> None:
    """pretrain.train_phase on `device` until its model is built: stopped before any data is read or step taken."""
    from workflow.train import pretrain
    from workflow.train.distributed import DistEnv

    def stop(*args):
        raise SystemExit("stopped before training")

    monkeypatch.setattr(pretrain, "check_token_ids", stop)
    with pytest.raises(SystemExit):
        pretrain.train_phase(s, DistEnv(rank=0, world_size=1, local_rank=0, device=device, backend=None))


def test_a_job_below_its_floor_warns_where_it_starts_before_the_first_step(
        platform, packed_data, tmp_path, monkeypatch, caplog):  # noqa: F811
    platform(capability=T4)
    start_job(settings(packed_data, tmp_path / "out", precision="bf16"), CPU, monkeypatch)
    [warning] = floor_warnings(caplog)
    assert warning.startswith("BERT's varlen flash attention with dropout needs torch >= 2.7")


@pytest.mark.parametrize("precision, warned", [("fp32", True), ("bf16", False)])
def test_bert_training_packed_rows_on_cuda_in_fp32_warns_where_it_starts_naming_the_precision_key(
        platform, packed_data, tmp_path, monkeypatch, caplog, precision, warned):  # noqa: F811
    """fp32 has no flash kernel: packed BERT takes nested SDPA, ~4x slower than bf16's flash_varlen. The job starts
    on a stand-in CUDA device (its compute capability an H100's); it is stopped before the model moves there."""
    from workflow.train import pretrain

    platform(capability=H100)
    caplog.set_level(logging.WARNING)
    start_job(settings(packed_data, tmp_path / "out", precision=precision), torch.device("cuda"), monkeypatch)
    slower = [r.getMessage() for r in caplog.records if r.name == pretrain.log.name and "fp32" in r.getMessage()]
    assert slower == (["pretrain.precision fp32: packed rows train with nested SDPA (exact, ~4x slower) on CUDA, not "
                       "the flash kernels of bf16 and fp16; set pretrain.precision: bf16 to train faster"]
                      if warned else [])
    assert floor_warnings(caplog) == []  # at its floors: the fast path trains in 16-bit


def test_a_compiled_forward_takes_the_kernel_choice_as_a_constant(platform):
    platform(torch_version="2.10.0", flash_attn=flash_attn_standin([]))  # an import inside would break the graph

    def attention(x):
        kernel = kernels.windowed_varlen_kernel(x.device, None)
        return x * 2 if kernel is None else x * 3

    torch._dynamo.reset()
    assert torch.equal(torch.compile(attention, fullgraph=True, backend="eager")(torch.ones(3)), torch.full((3,), 3.0))


def test_the_heads_check_reads_the_installed_torch_without_importing_it():
    """A parse (`snakemake -n`) pays no torch import for the floor: the version comes from the distribution."""
    code = ("import sys; from workflow.train.models.floors import head_floor_warning, installed_torch; "
            "head_floor_warning('modernbert', 'auto', True, None); print('torch' in sys.modules, installed_torch())")
    shown = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                           check=True).stdout.split()
    assert shown == ["False", importlib.metadata.version("torch")]


# ---------------------------------------------------------------- torch 2.4 (NGC 24.07-24.09), seen on a real 2.4.1


def test_flash_varlens_custom_ops_carry_annotations_as_types_as_torch_2_4_reads_them():
    """Its custom_op infers the schema from the annotations and took a string ('torch.Tensor', which `from __future__
    import annotations` makes) for an unsupported type: importing the trainer failed there."""
    from workflow.train.models import flash_varlen as module

    assert module.runs_flash_varlen.__annotations__["q"] is torch.Tensor


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_the_exact_path_runs_on_torch_2_4s_nested_tensors_which_take_no_extremes(monkeypatch):
    """Its nested_tensor_from_jagged has no min_seqlen / max_seqlen (2.5 added them): nested SDPA, the path below the
    flash floor, stopped with a TypeError at the first step. Each sequence still attends to itself alone."""
    import inspect

    real = torch.nested.nested_tensor_from_jagged

    def torch_2_4(values, offsets, lengths=None, jagged_dim=None):
        return real(values, offsets, lengths, jagged_dim)

    monkeypatch.setattr(torch.nested, "nested_tensor_from_jagged", torch_2_4)
    takes = "max_seqlen" in inspect.signature(torch_2_4).parameters
    monkeypatch.setattr(accelerator, "jagged_takes_extremes", lambda: takes)
    monkeypatch.setattr(kernels, "bert_flash_kernel", lambda device, kernel: None)  # below the flash floor
    torch.manual_seed(0)
    offsets = torch.tensor([0, 3, 10, 12])
    q, k, v = torch.randn(3, 12, 2, 8).unbind()
    out = kit.VarlenAttention(offsets, 2, 7)(q, k, v, dropout_p=0.0)
    for start, end in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
        alone = torch.nn.functional.scaled_dot_product_attention(*(x[start:end].transpose(0, 1) for x in (q, k, v)))
        assert torch.allclose(out[start:end], alone.transpose(0, 1), atol=1e-6)


def test_a_trainer_on_torch_below_2_4_stops_with_one_error_line_naming_the_floor(repo_env):
    """torch 2.3 (NGC 24.04-24.06; a real 2.3.1 tried) has no nested_tensor_from_jagged, nn.RMSNorm or
    torch.library.custom_op: every trainer's import crashed with a traceback. accelerator, which they all import
    first, stops them in one line (on the real 2.3.1: pretrain, SQuAD, GLUE, tasks, cluster_check, scaling)."""
    code = "import torch; torch.__version__ = '2.3.1+cu121'; import workflow.train.pretrain"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=repo_env)
    assert result.returncode == 1
    assert [line for line in result.stderr.splitlines() if "error" in line.lower()] == [
        "error: torch 2.3.1+cu121: snakebert trains with torch >= 2.4 (its attention kernels are torch.library custom "
        "ops, new in 2.4); upgrade torch (NGC's PyTorch containers have 2.4 from 24.07)"]
