"""GLUE evaluation: predict a fine-tuned classifier on a task's dev set(s) and score it with the task's own metric
(workflow.classify.evaluate and .metrics, the GLUE benchmark's metrics). eval.json:
`{"task": "MNLI", "splits": {"dev_matched": {"accuracy": ..., "examples": ...}, "dev_mismatched": {...}}}`.

    python -m workflow.glue.evaluate --task MRPC --model results/glue/MRPC/model \
        --features dev=data/glue/MRPC/dev_features.npz --output results/glue/MRPC/eval.json
"""
import argparse
from typing import Sequence

from workflow.atomic import write_json
from workflow.classify.evaluate import evaluate
from workflow.cli import UserError, phase_directory, run
from workflow.glue.data import task_of


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", required=True, help="GLUE task name")
    parser.add_argument("--model", required=True, help="fine-tuned classifier directory")
    parser.add_argument("--features", action="append", type=phase_directory, required=True, metavar="SPLIT=NPZ",
                        help="dev features of one split (dev, or MNLI's dev_matched/dev_mismatched); repeatable")
    parser.add_argument("--output", required=True, help="eval.json")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp16", "fp32"])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    args = parser.parse_args(argv)
    task = task_of(args.task)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    missing = set(task.dev_splits) - {split for split, _ in args.features}
    if missing:
        raise UserError(f"{task.name}: no --features for the dev split(s) {', '.join(sorted(missing))}")
    write_json(args.output, evaluate(task, args.model, dict(args.features), args.batch_size, args.precision,
                                     args.device))


if __name__ == "__main__":
    run(main)
