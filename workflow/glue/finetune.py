"""GLUE fine-tuning: a GLUE preset through the shared classification fine-tuning (workflow.classify.model: the head,
the loss, the recipe of Google's run_classifier / HF's run_glue), with the glue section's settings and
glue.overrides.<task> applied. The result is an HF directory (the init's family's ...ForSequenceClassification:
BertForSequenceClassification from a BERT; STS-B a regression head).

    python -m workflow.glue.finetune --config '{"seed": 12345, "glue": {...}}' --task MRPC \
        --init results/pretrain/phase2/model --features data/glue/MRPC/train_features.npz \
        --output results/glue/MRPC/model --metrics results/glue/MRPC/finetune_metrics.jsonl --run-dir runs/glue/MRPC
"""
import sys
from typing import Sequence

from workflow.classify.model import ClassifierSettings, finetune
from workflow.cli import run
from workflow.glue.data import task_of
from workflow.train.finetune import finetune_parser


def settings_of(config: dict, task: str) -> ClassifierSettings:
    """From the config sections seed and glue (as validated by the schema), glue.overrides.<task> applied."""
    overrides = config.get("glue", {}).get("overrides", {}).get(task, {})
    return ClassifierSettings.from_section(config, "glue", overrides)


def main(argv: Sequence[str] | None = None) -> None:
    parser = finetune_parser(__doc__.split("\n\n")[0], "seed and glue", "workflow.glue.data",
                             "step, epoch, loss, accuracy, lr, grad_norm, seq_per_s")
    parser.add_argument("--task", required=True, help="GLUE task name (CoLA, SST-2, MRPC, STS-B, QQP, MNLI, ...)")
    args = parser.parse_args(argv)
    task = task_of(args.task)
    code = finetune(task, args.init, args.features, args.output, args.run_dir, settings_of(args.config, task.name),
                    args.vocab, args.metrics, args.device, args.threads)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    run(main)
