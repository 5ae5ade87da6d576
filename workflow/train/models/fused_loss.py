"""The masked-LM loss straight from the head's hidden states, without the [N, V] logits on CUDA.

API:
    mlm_loss(hidden [N, H], decoder_weight [V, H], decoder_bias [V] | None, labels [N]) -> (loss, correct)
    summed_mlm_loss(..., fused=True) -> (summed loss, correct)   the loss summed over the labelled rows (training's
        PretrainingTask divides it by the step's global count); fused=False: the reference path
        loss: the mean cross-entropy over the labelled rows (label -1 = ignored; 0, not NaN, when none is labelled);
        correct: how many labelled rows the argmax predicts, a long tensor (no gradient).
    reference_mlm_loss(...)  the same from materialised logits (F.linear, then fp32 cross-entropy)
    fused_mlm_loss_reason(device) -> str | None   None where the fused path runs, else why the reference runs

On CUDA with liger-kernel importable, `mlm_loss` runs liger's fused linear cross-entropy: the decoder matmul and the
loss go chunk by chunk over the rows, so at most a chunk of logits exists at a time, and the gradients of hidden,
weight and bias are computed in the forward (fp32 accumulation). The argmax comes from the same kernel
(`return_predicted_tokens`), so the accuracy needs no logits either. Liger counts the labelled rows on the host: one
sync per call. Elsewhere (CPU, liger absent) the reference path runs; it has the semantics of `pretraining_loss` in
workflow/train/models/kit.py (matmul in the ambient autocast dtype, cross-entropy in fp32, ignore_index=-1).

Training (workflow.train.pretrain.PretrainingTask, config pretrain.fused_loss) calls summed_mlm_loss on the head's
hidden states at the prediction slots (the pretraining models' forward with return_hidden=True) and the model's tied
decoder (`mlm_decoder()`: the word embeddings and the head's bias), so the logits never exist in a training step.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORED = -1  # the label of an empty prediction slot


def fused_mlm_loss_reason(device: torch.device) -> str | None:
    """None where `mlm_loss` runs liger's fused kernel on `device`, else why it runs the reference path."""
    if device.type != "cuda":
        return f"liger-kernel's fused linear cross-entropy runs on CUDA only (the model is on {device.type})"
    try:
        import liger_kernel.transformers.functional  # noqa: F401
    except ImportError as error:
        return f"liger-kernel is not importable ({error}): pip install liger-kernel==0.8.5"
    return None


def mlm_loss(hidden: torch.Tensor, decoder_weight: torch.Tensor, decoder_bias: torch.Tensor | None,
             labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean cross-entropy over the rows whose label is not -1, number of them the argmax predicts); see the module
    doc for which path runs. An all-ignored batch gives a zero loss whose gradients are zero."""
    summed, correct = summed_mlm_loss(hidden, decoder_weight, decoder_bias, labels)
    return summed / (labels != IGNORED).sum().clamp(min=1), correct


def summed_mlm_loss(hidden: torch.Tensor, decoder_weight: torch.Tensor, decoder_bias: torch.Tensor | None,
                    labels: torch.Tensor, fused: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy summed over the labelled rows, number of them the argmax predicts): what a training step
    divides by its global count of predictions. Liger's kernel where `fused` and it runs here, else the reference."""
    if fused and fused_mlm_loss_reason(hidden.device) is None:
        return _liger_summed_loss(hidden, decoder_weight, decoder_bias, labels)
    return _reference_summed_loss(hidden, decoder_weight, decoder_bias, labels)


def reference_mlm_loss(hidden, decoder_weight, decoder_bias, labels) -> tuple[torch.Tensor, torch.Tensor]:
    """`mlm_loss` through materialised [N, V] logits on any device: the reference the fused path is tested against."""
    summed, correct = _reference_summed_loss(hidden, decoder_weight, decoder_bias, labels)
    return summed / (labels != IGNORED).sum().clamp(min=1), correct


def _reference_summed_loss(hidden, decoder_weight, decoder_bias, labels):
    logits = F.linear(hidden, decoder_weight, decoder_bias).float()
    # Summed, then divided by the clamped count: F.cross_entropy's mean is NaN when every label is ignored.
    summed = F.cross_entropy(logits, labels, ignore_index=IGNORED, reduction="sum")
    with torch.no_grad():
        correct = ((logits.argmax(-1) == labels) & (labels != IGNORED)).sum()
    return summed, correct


def _liger_summed_loss(hidden, decoder_weight, decoder_bias, labels):
    try:  # optional (requirements-gpu.txt): callers ask fused_mlm_loss_reason first
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except ImportError as error:
        raise RuntimeError(f"liger-kernel's fused loss asked for where it does not import: {error}") from None

    output = liger_fused_linear_cross_entropy(hidden, decoder_weight, labels, bias=decoder_bias,
                                              ignore_index=IGNORED, reduction="sum", accum_dtype=torch.float32,
                                              return_predicted_tokens=True)
    with torch.no_grad():
        correct = ((output.predicted_tokens == labels) & (labels != IGNORED)).sum()
    return output.loss, correct
