"""BERT's unpadded attention in 16-bit on CUDA (workflow.train.models.flash_varlen): on CPU, through the custom op's CPU
reference, the packed forward hands every layer's attention to it with the sequences' int32 offsets (padded to a
fixed count), the row length and the training dropout, and equals the rows with a block-diagonal mask; on a GPU
(skipped here), the real kernels against nested tensors' SDPA, forward and backward, and its dropout mask the same in
both."""
import pytest
import torch

from workflow.train.models.flash_varlen import flash_varlen
from workflow.train.models import kit
from workflow.train.models.bert import BertConfig, BertForPreTraining
from workflow.train.models.kit import host_indices
from workflow.train.precision import autocast
from workflow.train.pretrain import forward

CONFIG = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=48,
                    max_position_embeddings=32)
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="the flash kernels need a CUDA device")


def packed_rows() -> dict:
    """Two rows of 16 holding sequences of 5, 7 and 4 | 9 and 6 tokens, each with its [CLS] and a prediction."""
    lengths = [[5, 7, 4], [9, 6]]
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(5, 64, (2, 16), generator=generator)
    numbers, positions, cls = torch.zeros(2, 16, dtype=torch.long), torch.zeros(2, 16, dtype=torch.long), []
    for row, row_lengths in enumerate(lengths):
        start, slots = 0, []
        for number, length in enumerate(row_lengths, 1):
            numbers[row, start:start + length] = number
            positions[row, start:start + length] = torch.arange(length)
            slots.append(start)
            start += length
        cls.append(slots + [0] * (3 - len(slots)))
    input_ids[numbers == 0] = 0
    return dict(input_ids=input_ids, token_type_ids=torch.zeros_like(input_ids), attention_mask=numbers,
                position_ids=positions, cls_positions=torch.tensor(cls),
                masked_lm_positions=torch.tensor([[1, 6], [2, 10]]), masked_lm_labels=torch.tensor([[7, 8], [9, 10]]))


def test_a_packed_16_bit_forward_hands_each_layer_to_flash_varlen_and_equals_the_masked_rows(monkeypatch):
    calls = []

    def recording(q, k, v, offsets, max_seqlen, dropout_p=0.0):
        calls.append((offsets.tolist(), max_seqlen, dropout_p))
        return flash_varlen(q, k, v, offsets, max_seqlen, dropout_p)

    torch.manual_seed(0)
    model = BertForPreTraining(CONFIG).eval()
    indices = host_indices(packed_rows())
    with torch.no_grad(), autocast(torch.device("cpu"), "bf16"):
        expected, _, _ = forward(model, indices)  # rows with a block-diagonal mask (CPU is not a varlen device)
    monkeypatch.setattr(kit, "VARLEN_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(kit, "flash_varlen", recording)
    monkeypatch.setattr(kit, "runs_flash_varlen", lambda q: q.dtype == torch.bfloat16)
    with torch.no_grad(), autocast(torch.device("cpu"), "bf16"):
        got, _, _ = forward(model, indices)
    # Row 2's padding token is a sequence of its own; empty sequences fill the 6 runs' offsets up to 8 (a power of 2).
    offsets = [0, 5, 12, 16, 25, 31, 32, 32, 32]
    assert calls == [(offsets, 16, 0.0)] * CONFIG.num_hidden_layers
    assert (got.float() - expected.float()).abs().max() <= 0.02 * expected.float().abs().max()
    model.train()
    calls.clear()
    with autocast(torch.device("cpu"), "bf16"):
        forward(model, indices)[0].float().sum().backward()
    assert calls == [(offsets, 16, CONFIG.attention_probs_dropout_prob)] * CONFIG.num_hidden_layers
    calls.clear()
    with torch.no_grad():  # fp32: flash_varlen takes 16-bit only; nested SDPA runs it
        forward(model.eval(), indices)
    assert calls == []


@CUDA
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_varlen_equals_nested_sdpa_forward_and_backward_without_dropout(dtype):
    from workflow.train.models.kit import VarlenAttention

    offsets = torch.tensor([0, 100, 228, 300, 811, 1000], device="cuda")
    torch.manual_seed(0)
    q, k, v = (torch.randn(1000, 16, 64, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(1000, 16, 64, device="cuda", dtype=dtype)
    results = []
    for flash in (True, False):
        kit.FLASH_VARLEN = flash
        try:
            out = VarlenAttention(offsets, 72, 511)(q, k, v, 0.0)
        finally:
            kit.FLASH_VARLEN = True
        results.append([out, *torch.autograd.grad(out, (q, k, v), grad)])
    for ours, nested in zip(*results):
        assert (ours.float() - nested.float()).abs().max() <= 1e-2 * nested.float().abs().max()
    direct = flash_varlen(q, k, v, offsets.int(), 511)
    assert torch.equal(direct, results[0][0])


@CUDA
def test_flash_varlens_backward_applies_the_forwards_dropout_mask():
    """out = A_dropped v is linear in v, so <dv, v> = <g, out> for the loss <g, out> exactly when the backward drops
    the forward's entries; and the mean attention weight kept matches 1 - p."""
    offsets = torch.tensor([0, 300, 812, 1000], device="cuda", dtype=torch.int32)
    torch.manual_seed(0)
    q, k = (torch.randn(1000, 8, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(1000, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(1000, 8, 64, device="cuda", dtype=torch.bfloat16)
    out = flash_varlen(q, k, v, offsets, 512, 0.1)
    (dv,) = torch.autograd.grad(out, v, g)
    forward_side, backward_side = (g.double() * out.double()).sum(), (dv.double() * v.double()).sum()
    assert abs(forward_side - backward_side) <= 2e-2 * (g.double() * out.double()).abs().sum() / 1000
    ones = torch.ones_like(v)  # out = rows of A_dropped summed: 1/(1-p) x kept fraction, mean 1
    kept = flash_varlen(q, k, ones, offsets, 512, 0.1).float().mean()
    assert abs(float(kept) - 1.0) < 0.01
    assert not torch.equal(flash_varlen(q, k, v, offsets, 512, 0.1), flash_varlen(q, k, v, offsets, 512, 0.1))


@CUDA
@pytest.mark.parametrize("window", [None, 64])
def test_empty_sequences_and_a_padding_run_leave_the_real_tokens_outputs_and_gradients_as_they_were(window):
    """The static-shape layout (kit.unpad): a padding run as a sequence of its own, empty sequences up to a power
    of two, max_seqlen the row length; the real tokens' results equal those of their own offsets alone."""
    from workflow.train.models.flash_varlen import flash_varlen

    real = [0, 100, 228, 300, 811, 1000]
    padded = torch.tensor(real + [1024] * 6, device="cuda", dtype=torch.int32)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1024, 16, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn(1024, 16, 64, device="cuda", dtype=torch.bfloat16)
    out = flash_varlen(q, k, v, padded, 1024, 0.0, window)
    alone = flash_varlen(q[:1000], k[:1000], v[:1000], torch.tensor(real, device="cuda", dtype=torch.int32), 511, 0.0,
                         window)
    assert torch.isfinite(out).all() and torch.equal(out[:1000], alone)
    for ours, reference in zip(torch.autograd.grad(out, (q, k, v), grad),
                               torch.autograd.grad(alone, (q, k, v), grad[:1000])):
        assert torch.equal(ours[:1000], reference[:1000])


def aten_flash_standins(windowed: bool, calls: list):
    """aten._flash_attention_forward / _backward with the keyword arguments of torch 2.7-2.10 (windowed=False: no
    window_size_left/right, so passing them raises TypeError as the real op does) or of 2.11 on; CPU outputs."""

    def check(window: dict) -> None:
        unknown = set(window) - ({"window_size_left", "window_size_right"} if windowed else set())
        if unknown:
            raise TypeError(f"_flash_attention_forward() got an unexpected keyword argument {sorted(unknown)[0]!r}")

    def forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *,
                scale=None, **window):
        check(window)
        calls.append(("forward", window))
        heads, tokens = query.shape[1], query.shape[0]
        return (torch.zeros_like(query), torch.zeros(heads, tokens), torch.zeros(2, dtype=torch.uint64),
                torch.empty(0), torch.empty(0))

    def backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                 is_causal, rng_state, unused, *, scale=None, **window):
        check(window)
        calls.append(("backward", window))
        return torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)

    return forward, backward


@pytest.mark.parametrize("windowed_torch", [False, True], ids=["torch-2.10", "torch-2.11"])
def test_the_cuda_kernels_pass_a_window_only_where_one_is_set(windowed_torch, monkeypatch):
    """BERT's unwindowed call is the one torch 2.7-2.10's flash kernels take (no window keywords: its floor, 2.7);
    ModernBERT's windowed call needs 2.11's (kernels.py's floor for it), where it hands the window over."""
    from workflow.train.models import flash_varlen as ops

    calls = []
    forward, backward = aten_flash_standins(windowed_torch, calls)
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", forward)
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_backward", backward)
    q = torch.randn(6, 2, 8, dtype=torch.bfloat16)
    offsets = torch.tensor([0, 4, 6, 6], dtype=torch.int32)
    out, lse, rng_state = ops._forward_cuda(q, q, q, offsets, 6, 0.1, -1, -1)
    ops._backward_cuda(out, q, q, q, out, lse, offsets, 6, 0.1, -1, -1, rng_state)
    assert calls == [("forward", {}), ("backward", {})]
    if not windowed_torch:
        with pytest.raises(TypeError, match="window_size_left"):
            ops._forward_cuda(q, q, q, offsets, 6, 0.0, 3, 3)
        return
    calls.clear()
    ops._forward_cuda(q, q, q, offsets, 6, 0.0, 3, 3)
    ops._backward_cuda(out, q, q, q, out, lse, offsets, 6, 0.0, 3, 3, rng_state)
    window = {"window_size_left": 3, "window_size_right": 3}
    assert calls == [("forward", window), ("backward", window)]
