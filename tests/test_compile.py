"""pretrain.compile on CPU, both families, packed rows through the varlen path (forced onto CPU: the attention's
custom ops run their exact CPU reference) and unpacked rows: a compiled step equals the eager one (losses and
gradients), micro-batches of different packings reuse one graph without a break, and the custom ops pass
torch.library.opcheck."""
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from workflow.train import engine
from workflow.train.models import kit, modernbert
from workflow.train.models.bert import BertConfig, BertForPreTraining
from workflow.train.models.flash_varlen import flash_varlen_backward, flash_varlen_forward
from workflow.train.models.modernbert import ModernBertConfig, ModernBertForMaskedLM
from workflow.train.pretrain import pretraining_forward

ROWS, LENGTH, SEQUENCES_PER_ROW, PREDICTIONS = 2, 16, 3, 4
BACKEND = "inductor"
FAMILIES = {
    "bert": (lambda: BertForPreTraining(BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=48,
        max_position_embeddings=LENGTH, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
        kit.host_indices),
    "modernbert": (lambda: ModernBertForMaskedLM(ModernBertConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
        global_attn_every_n_layers=2, local_attention=6, max_position_embeddings=LENGTH, pad_token_id=0,
        cls_token_id=2, sep_token_id=3, bos_token_id=2, eos_token_id=3)),
        modernbert.host_indices),
}


def micro_batch(seed: int, packed: bool, sequences: int = SEQUENCES_PER_ROW) -> dict:
    """ROWS rows of LENGTH tokens as the loader hands them: packed (up to `sequences` of SEQUENCES_PER_ROW slots a
    row, each token's sequence number as its mask) or one sequence a row with padding; PREDICTIONS slots a row, some
    empty."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(5, 64, (ROWS, LENGTH), generator=generator)
    mask, positions = (torch.zeros(ROWS, LENGTH, dtype=torch.long) for _ in range(2))
    cls = torch.zeros(ROWS, SEQUENCES_PER_ROW, dtype=torch.long)
    nsp = torch.full((ROWS, SEQUENCES_PER_ROW if packed else 1), -1)
    for row in range(ROWS):
        start = 0
        for number in range(1, (sequences if packed else 1) + 1):
            size = int(torch.randint(2, 9, (), generator=generator))
            if start + size > LENGTH:
                break
            mask[row, start:start + size] = number if packed else 1
            positions[row, start:start + size] = torch.arange(size)
            cls[row, number - 1], nsp[row, number - 1] = start, int(torch.randint(0, 2, (), generator=generator))
            start += size
    input_ids[mask == 0] = 0
    slots = torch.stack([torch.randperm(int((mask[row] > 0).sum()), generator=generator)[:PREDICTIONS]
                         for row in range(ROWS)])
    labels = torch.gather(input_ids, 1, slots)
    labels[torch.rand(labels.shape, generator=generator) < 0.3] = -1
    labels[:, -1] = -1  # an empty slot in every row
    batch = dict(input_ids=input_ids, token_type_ids=torch.zeros_like(input_ids), attention_mask=mask,
                 masked_lm_positions=slots.masked_fill(labels < 0, 0), masked_lm_labels=labels)
    if packed:
        return {**batch, "position_ids": positions, "cls_positions": cls, "next_sentence_labels": nsp}
    return {**batch, "next_sentence_labels": nsp[:, 0]}


@pytest.fixture
def varlen_on_cpu(monkeypatch):
    """Packed rows (and every ModernBERT batch) take the unpadded CUDA path on CPU, in fp32."""
    monkeypatch.setattr(kit, "VARLEN_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(modernbert, "VARLEN_DTYPES", (torch.float16, torch.bfloat16, torch.float32))


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def step(model, batch) -> tuple[torch.Tensor, dict]:
    """(loss, gradients) of one training forward and backward."""
    loss = pretraining_forward(model, batch)["loss"]
    loss.backward()
    module = getattr(model, "_orig_mod", model)  # a compiled model's parameters are its module's
    gradients = {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}
    module.zero_grad(set_to_none=True)
    return loss.detach(), gradients


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
@pytest.mark.parametrize("name", FAMILIES)
def test_a_compiled_step_equals_the_eager_one(name, packed, request):
    if packed:
        request.getfixturevalue("varlen_on_cpu")
    build, host_indices = FAMILIES[name]
    torch.manual_seed(0)
    model = build().train()
    batch = host_indices(micro_batch(1, packed))
    eager_loss, eager_gradients = step(model, batch)
    compiled_loss, compiled_gradients = step(torch.compile(model, backend=BACKEND, dynamic=False), batch)
    assert torch.allclose(compiled_loss, eager_loss, rtol=1e-5, atol=1e-6)
    assert compiled_gradients.keys() == eager_gradients.keys()
    for key, gradient in eager_gradients.items():
        assert torch.allclose(compiled_gradients[key], gradient, rtol=1e-5, atol=1e-6), key


def seven_packings(host_indices) -> list:
    batches = [host_indices(micro_batch(seed, packed=True)) for seed in range(6)]
    return batches + [host_indices(micro_batch(6, packed=True, sequences=1))]


@pytest.mark.parametrize("name", FAMILIES)
def test_micro_batches_of_different_packings_reuse_one_graph_without_a_break(name, varlen_on_cpu):
    build, host_indices = FAMILIES[name]
    torch.manual_seed(0)
    model = build().train()
    batches = seven_packings(host_indices)
    assert len({tuple(b["cu_seqlens"].tolist()) for b in batches}) == 7  # seven packings
    assert len({len(b["cu_seqlens"]) for b in batches}) == 2  # kit.unpad: as many offsets as runs, to a power of 2
    # Before static shapes, the real tokens and the real prediction slots set the shapes: they vary here.
    assert len({int((b["attention_mask"] > 0).sum()) for b in batches}) > 1
    assert len({int((b["masked_lm_labels"] >= 0).sum()) for b in batches}) > 1
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, dynamic=False)
    for batch in batches:
        step(compiled, batch)
    assert counter.frame_count == 1
    assert dict(counters["graph_break"]) == {}


def test_berts_exact_path_compiles_to_one_graph_and_trains_as_its_eager_nested_sdpa(varlen_on_cpu, monkeypatch):
    """Below the flash floor (fp32 on CUDA, a GPU before Ampere, torch < 2.7 without flash-attn) packed rows train
    with nested SDPA in eager; compiled, where nested tensors would break the graph and recompile for every packing,
    with the same attention on rows."""
    monkeypatch.setattr(kit, "FLASH_VARLEN", False)
    build, host_indices = FAMILIES["bert"]
    torch.manual_seed(0)
    model = build().train()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, dynamic=False)
    for batch in seven_packings(host_indices):
        (eager_loss, eager_gradients), (compiled_loss, compiled_gradients) = step(model, batch), step(compiled, batch)
        assert torch.allclose(compiled_loss, eager_loss, rtol=1e-5, atol=1e-6)
        for key, gradient in eager_gradients.items():
            assert torch.allclose(compiled_gradients[key], gradient, rtol=1e-5, atol=1e-6), key
    assert counter.frame_count == 1
    assert dict(counters["graph_break"]) == {}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the flash kernels need a CUDA device")
@pytest.mark.parametrize("name", FAMILIES)
def test_on_cuda_in_bf16_one_inductor_graph_trains_as_eager_over_every_packing(name):
    from workflow.train.precision import autocast

    build, host_indices = FAMILIES[name]
    torch.manual_seed(0)
    model = build().cuda().train()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, dynamic=False)
    for seed in range(4):
        batch = {k: v.cuda() if isinstance(v, torch.Tensor) else v
                 for k, v in host_indices(micro_batch(seed, packed=True)).items()}
        with autocast(torch.device("cuda"), "bf16"):
            (eager_loss, _), (compiled_loss, _) = step(model, batch), step(compiled, batch)
        assert torch.allclose(compiled_loss.float(), eager_loss.float(), rtol=2e-2)
    assert counter.frame_count == 1 and dict(counters["graph_break"]) == {}


def test_the_varlen_custom_ops_pass_opcheck():
    generator = torch.Generator().manual_seed(0)
    offsets = torch.tensor([0, 5, 12, 16, 25, 31, 32, 32, 32], dtype=torch.int32)  # empty sequences at the end
    q, k, v, grad_out = (torch.randn(32, 2, 8, generator=generator) for _ in range(4))
    for window in (-1, 3):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        torch.library.opcheck(flash_varlen_forward, (*inputs, offsets, 16, 0.0, window, window))
        out, lse, rng_state = flash_varlen_forward(q, k, v, offsets, 16, 0.0, window, window)
        torch.library.opcheck(flash_varlen_backward,
                              (grad_out, q, k, v, out, lse, offsets, 16, 0.0, window, window, rng_state))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_pretrain_compile_mode_reaches_torch_compile_with_static_shapes(device, monkeypatch):
    import torch._inductor.config as inductor

    calls = []
    monkeypatch.setattr(torch, "compile", lambda model, **options: calls.append(options) or model)
    with inductor.patch(fallback_random=False):
        engine.compiled(torch.nn.Linear(1, 1), "max-autotune-no-cudagraphs", torch.device(device))
        # CPU: dropout through aten's generator (inductor's own made compiled CPU steps slower than eager); GPU: fused
        assert inductor.fallback_random is (device == "cpu")
    assert calls == [{"mode": "max-autotune-no-cudagraphs", "dynamic": False}]


def test_the_cpu_compile_benchmark_counts_one_graph_and_no_break_over_every_packing_of_both_paths():
    import subprocess
    import sys

    from tests.conftest import REPO

    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "compile_cpu.py"), "--families",
                             "bert,modernbert", "--batches", "3", "--rows", "4", "--backend", "aot_eager"],
                            capture_output=True, text=True, timeout=300, check=True)
    for name in ("bert", "modernbert"):
        for path in ("rows", "varlen"):
            assert f"{name}, {path}: 3 micro-batches of (4, 128) tokens, 3 packings" in result.stdout
            assert f"{name} {path}: 1 graph, 0 breaks over 3 micro-batches (goal 1 and 0): met" in result.stdout
    counts = [line.split("|")[5:7] for line in result.stdout.splitlines() if line.startswith(("| eager", "| compiled"))]
    assert counts == [[" 0 ", " 0 "], [" 1 ", " 0 "]] * 4  # graphs and breaks: eager's, compiled's, in each table


@pytest.mark.parametrize("size,family,layers,hidden,pad", [
    ("cpu", "bert", 2, 128, 0), ("cpu", "modernbert", 4, 128, 0), ("real", "bert", 24, 1024, 0),
    ("real", "modernbert", 22, 768, 50283), ("real", "roberta", 12, 768, 1)])
def test_the_cpu_compile_benchmark_builds_the_tiny_presets_or_those_a_gpu_trains(size, family, layers, hidden, pad):
    """--size real: the GPU presets at full depth and width, with the family's own special ids (ModernBERT's fit
    its vocabulary of 50,368; the tiny preset's are moved into a small one)."""
    from benchmarks.compile_cpu import build

    config, model = build(family, 50368, 128, size)
    assert (config.num_hidden_layers, config.hidden_size, config.pad_token_id, model.training) == (
        layers, hidden, pad, True)


@pytest.mark.parametrize("model_family", ["bert", "modernbert"])
def test_a_compiled_fine_tuning_run_trains_as_the_eager_one(model_family, tmp_path, monkeypatch):
    import json

    from tests.test_finetune_ddp import RECIPE, prepare
    from workflow.classify.model import job_of
    from workflow.glue.data import TASKS
    from workflow.train import finetune as finetuning

    prepare("classification", tmp_path, model_family)
    counter = CompileCounterWithBackend("aot_eager")  # inductor's CPU compile is the slow part; the graphs are the same
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **options: real_compile(model, **options, backend=counter))
    losses = {}
    for compiled in (False, True):
        s = finetuning.FinetuneSettings(**{**RECIPE, "log_every": 1, "compile": compiled})
        run = tmp_path / f"compiled_{compiled}"
        assert finetuning.finetune(job_of(TASKS["SST-2"]), tmp_path / "init", tmp_path / "train.npz", run / "model",
                                   run / "run", s, metrics_path=run / "metrics.jsonl", device="cpu", threads=1) == 0
        losses[compiled] = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(losses[True]) == 3 and losses[True] == pytest.approx(losses[False], rel=1e-5)
    assert 1 <= counter.frame_count <= 2  # rows with and without padding: their masks differ (mask_needed)
    assert dict(counters["graph_break"]) == {}
