"""SQuAD fine-tuning: a span-prediction head on a pretrained encoder (the phase-2 export or any HF directory).

Recipe of Google's/NVIDIA's run_squad.py: loss = mean of start and end cross-entropy, AdamW (no weight decay on
biases and LayerNorm), linear warmup then linear decay, gradient clipping (squad.max_grad_norm), bf16 autocast on GPUs.
The loop is the training engine's (workflow/train/engine.py: DDP, accumulation, elastic resume from `--run-dir`,
refusal of changed settings, SIGTERM/SIGUSR1 checkpoint and exit), driven by workflow/train/finetune.py; this module
supplies the task. The result is an
HF directory, HF's <Family>ForQuestionAnswering of the init's family (workflow/train/models/heads.py); the run
directory is removed once it is written (the model supersedes its checkpoints).

    python -m workflow.squad.finetune --config '{"seed": 12345, "squad": {...}}' --init results/pretrain/phase2/model \
        --features data/squad/train_features.npz --output results/squad/model --metrics ... --run-dir runs/squad
"""
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch.nn.functional as F

from workflow.cli import UserError, run
from workflow.train import finetune as finetuning
from workflow.train.finetune import FeatureTask, FinetuneJob, finetune_parser, load_head
from workflow.train.models.heads import QUESTION_ANSWERING, FamilyHead


@dataclass
class FinetuneSettings(finetuning.FinetuneSettings):
    """BERT fine-tuning's settings and defaults (Google's run_squad.py), from the config section squad."""

    @classmethod
    def from_config(cls, config: dict) -> "FinetuneSettings":
        """From the config sections seed and squad (as validated by the schema)."""
        return cls.from_section(config, "squad")


class ForQuestionAnswering(FamilyHead):
    """Start and end logits of every token: HF's <Family>ForQuestionAnswering on the directory's family's encoder,
    in the family's layout (workflow/train/models/heads.py)."""

    kind = QUESTION_ANSWERING

    def forward(self, input_ids, token_type_ids, attention_mask, mask_needed: bool | None = None, unpadded=None):
        logits = super().forward(input_ids, token_type_ids, attention_mask, mask_needed, unpadded)
        return logits[..., 0], logits[..., 1]


def qa_loss(start_logits, end_logits, start_positions, end_positions, reduction="mean"):
    """Mean (or sum) over sequences of the mean of start and end cross-entropies (positions outside the sequence
    clamped, as HF does)."""
    length = start_logits.shape[1]
    start = F.cross_entropy(start_logits.float(), start_positions.clamp(0, length - 1), reduction=reduction)
    end = F.cross_entropy(end_logits.float(), end_positions.clamp(0, length - 1), reduction=reduction)
    return (start + end) / 2


def load_qa_model(directory: str | Path, require_head: bool = False):
    """(model, config): a QA model from an HF directory of any family; the head is freshly initialised unless
    present (require_head: must be)."""
    return load_head(directory, ForQuestionAnswering, 2, require_head)


class SquadTask(FeatureTask):
    """Span prediction on the training features (the global order of FeatureTask: a permutation per epoch)."""

    def __init__(self, features: dict, batch_size: int, seed: int):
        super().__init__(features, ("input_ids", "token_type_ids", "attention_mask", "start_positions",
                                    "end_positions"), (), batch_size, seed)

    def loss(self, model, batch: dict, totals: dict) -> dict:
        start_logits, end_logits = model(*self.inputs(batch))
        share = qa_loss(start_logits, end_logits, batch["start_positions"], batch["end_positions"], "sum")
        return {"loss": share / totals["sequences"]}

    def metrics(self, sums: dict, steps: int, sequences: int, elapsed: float, step: int) -> dict:
        return {"epoch": step / self.steps_per_epoch, "loss": sums["loss"] / steps}


def _squad_task(features: dict, features_path: Path, s: FinetuneSettings) -> SquadTask:
    if "start_positions" not in features:
        raise UserError(f"{features_path}: no answer labels (not SQuAD features)")
    return SquadTask(features, s.batch_size, s.seed)


JOB = FinetuneJob(config_key="squad", section="squad", batch_key="squad", unit="features", make_task=_squad_task,
                  load_model=load_qa_model)


def finetune(init, features_path, output, run_dir, settings: FinetuneSettings | None = None, vocab=None,
             metrics_path=None, device: str = "auto", threads: int | None = None) -> int:
    """Fine-tune; write the HF directory `output` (rank 0). Returns 0, or 128+signal when stopped by a signal."""
    return finetuning.finetune(JOB, init, features_path, output, run_dir, settings or FinetuneSettings(), vocab,
                               metrics_path, device, threads)


def main(argv: Sequence[str] | None = None) -> None:
    args = finetune_parser(__doc__.split("\n\n")[0], "seed and squad", "squad_data --training",
                           "step, epoch, loss, lr, grad_norm, seq_per_s").parse_args(argv)
    code = finetune(args.init, args.features, args.output, args.run_dir, FinetuneSettings.from_config(args.config),
                    args.vocab, args.metrics, args.device, args.threads)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    run(main)
