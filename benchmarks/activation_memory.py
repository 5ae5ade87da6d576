"""The activation memory of a training forward, measured on CPU: the memory half of the GPU projections
(modernbert_projection.py, bert_projection.py).

API:
    saved_bytes(model, rows, length, masking) -> int   bytes autograd saves for the backward of one bf16-autocast
        training forward of a pretraining model (either family's forward signature) on `rows` full rows of `length`
        tokens, `masking` of them predicted: the MLM head and its fp32 cross-entropy at those slots included,
        parameters left out, each storage counted once
    activation_fit(model, lengths, rows, masking) -> (saved bytes at each of three lengths, (c, a, b))   the fit
        c + a * N + b * N * L of the saved bytes for N tokens in rows of L: c is autocast's bf16 copy of the weights
        (once per forward), b the dense CPU attention's probabilities, which a flash kernel does not keep (it
        recomputes them from its log-sum-exp, a few bytes a token): a GPU keeps a per token
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def saved_bytes(model, rows: int, length: int, masking: float) -> int:
    """See the module docstring."""
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    input_ids = torch.randint(5, vocab, (rows, length), generator=generator)
    predicted = torch.rand(rows, length, generator=generator) < masking
    positions = [row.nonzero().flatten() for row in predicted]
    width = max(len(p) for p in positions)
    masked_lm_positions = torch.zeros(rows, width, dtype=torch.long)
    valid = torch.zeros(rows, width, dtype=torch.bool)
    for row, p in enumerate(positions):
        masked_lm_positions[row, :len(p)], valid[row, :len(p)] = p, True
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), \
            torch.autocast("cpu", dtype=torch.bfloat16):
        logits, _ = model(input_ids, torch.zeros_like(input_ids), torch.ones_like(input_ids), masked_lm_positions,
                          masked_lm_valid=valid)
        loss = F.cross_entropy(logits.float(), input_ids.gather(1, masked_lm_positions)[valid])
    del loss, logits
    return sum(storages.values())


def activation_fit(model, lengths, rows: int, masking: float) -> tuple[list[int], tuple[float, ...]]:
    """See the module docstring."""
    measured = [saved_bytes(model, rows, length, masking) for length in lengths]
    design = torch.tensor([[1.0, rows * length, rows * length * length] for length in lengths], dtype=torch.float64)
    fit = torch.linalg.solve(design, torch.tensor(measured, dtype=torch.float64)).tolist()
    return measured, tuple(fit)
