"""SQuAD prediction: run a fine-tuned QA model over the dev features, pick the best answer span per question.

Span selection follows Google's run_squad.py: the `n_best_size` best start and end logits of every window,
spans inside the context, end >= start, at most `max_answer_length` tokens, starting at a token whose window
gives it the most context; score = start + end logit. SQuAD 2.0: predict "" when the null score ([CLS] start +
end, minimum over windows) exceeds the best span's score by more than `null_score_diff_threshold`.

    python -m workflow.squad.predict --model results/squad/model --features data/squad/dev_features.npz \
        --dataset data/download/squad/dev.json --predictions results/squad/predictions.json \
        --nbest results/squad/nbest_predictions.json
"""
import argparse
import json
import logging
import math
from typing import Sequence

import numpy as np

from workflow.atomic import write_text
from workflow.cli import UserError, run
from workflow.train.precision import autocast, resolve_precision
from workflow.data.features import load_features
from workflow.squad.data import SquadExample, load_squad

log = logging.getLogger(__name__)


def _top_indices(logits: np.ndarray, n: int) -> np.ndarray:
    """Indices of the n largest values, best first (ties broken by position, so deterministic)."""
    return np.argsort(-logits, kind="stable")[:n]


def _softmax(scores: list[float]) -> list[float]:
    if not scores:
        return []
    top = max(scores)
    exps = [math.exp(s - top) for s in scores]
    total = sum(exps)
    return [e / total for e in exps]


def postprocess(
    examples: list[SquadExample],
    features: dict[str, np.ndarray],
    start_logits: np.ndarray,
    end_logits: np.ndarray,
    n_best_size: int = 20,
    max_answer_length: int = 30,
    version: str = "1.1",
    null_score_diff_threshold: float = 0.0,
) -> tuple[dict, dict, dict]:
    """(predictions, nbest, null_odds): question id -> answer text / n-best list / null score difference.

    `features` are evaluation features of `examples` (squad_data.featurize with training=False);
    `start_logits`, `end_logits` are [n_features, max_seq_length].
    """
    by_example: dict[int, list[int]] = {}
    for feature_index, example_index in enumerate(features["example_index"]):
        by_example.setdefault(int(example_index), []).append(feature_index)
    offsets, max_context = features["offsets"], features["token_is_max_context"]

    predictions, nbest_json, null_odds = {}, {}, {}
    for example_index, example in enumerate(examples):
        candidates = []  # (score, start_logit, end_logit, text)
        null = None  # (score, start_logit, end_logit) of the window with the smallest null score
        for f in by_example.get(example_index, []):
            s_logits, e_logits = start_logits[f], end_logits[f]
            if version == "2.0":
                score = float(s_logits[0] + e_logits[0])
                if null is None or score < null[0]:
                    null = (score, float(s_logits[0]), float(e_logits[0]))
            for s in _top_indices(s_logits, n_best_size):
                if offsets[f, s, 0] < 0 or not max_context[f, s]:
                    continue
                for e in _top_indices(e_logits, n_best_size):
                    if offsets[f, e, 0] < 0 or e < s or e - s + 1 > max_answer_length:
                        continue
                    text = example.context[offsets[f, s, 0] : offsets[f, e, 1]]
                    candidates.append((float(s_logits[s] + e_logits[e]), float(s_logits[s]), float(e_logits[e]), text))
        if null is not None:
            candidates.append((null[0], null[1], null[2], ""))
        candidates.sort(key=lambda c: -c[0])  # stable: equal scores keep window/position order

        nbest, seen = [], set()
        for candidate in candidates:
            if candidate[3] in seen:
                continue
            seen.add(candidate[3])
            nbest.append(candidate)
            if len(nbest) == n_best_size:
                break
        if null is not None and "" not in seen:
            nbest.append((null[0], null[1], null[2], ""))
        if not nbest or (version == "2.0" and all(c[3] == "" for c in nbest)):
            nbest.append((0.0, 0.0, 0.0, "empty"))  # Google's placeholder when no valid span exists
        probabilities = _softmax([c[0] for c in nbest])
        nbest_json[example.qas_id] = [
            {"text": c[3], "probability": p, "start_logit": c[1], "end_logit": c[2]}
            for c, p in zip(nbest, probabilities)
        ]
        best_span = next(c for c in nbest if c[3] != "")
        if version == "2.0":
            difference = null[0] - best_span[1] - best_span[2]
            null_odds[example.qas_id] = difference
            predictions[example.qas_id] = "" if difference > null_score_diff_threshold else best_span[3]
        else:
            predictions[example.qas_id] = best_span[3]
    return predictions, nbest_json, null_odds


def compute_logits(model, features: dict[str, np.ndarray], batch_size: int, device, precision: str):
    """(start_logits, end_logits) float32 arrays [n_features, max_seq_length] of `model` in eval mode."""
    import torch
    from tqdm import tqdm

    model.eval()
    starts, ends = [], []
    with torch.no_grad():
        for begin in tqdm(range(0, len(features["input_ids"]), batch_size), desc="predict", unit="batch", disable=None):
            batch = {
                k: torch.from_numpy(features[k][begin : begin + batch_size].astype(np.int64)).to(device)
                for k in ("input_ids", "token_type_ids", "attention_mask")
            }
            with autocast(device, precision):
                start, end = model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])
            starts.append(start.float().cpu().numpy())
            ends.append(end.float().cpu().numpy())
    return np.concatenate(starts), np.concatenate(ends)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="fine-tuned QA model directory")
    parser.add_argument("--features", required=True, help="dev features .npz (squad_data, evaluation mode)")
    parser.add_argument("--dataset", required=True, help="the SQuAD dev JSON the features came from")
    parser.add_argument("--predictions", required=True, help="predictions.json to write: question id -> answer")
    parser.add_argument("--nbest", required=True, help="nbest_predictions.json to write")
    parser.add_argument("--null-odds", default=None, help="SQuAD 2.0: null_odds.json to write (optional)")
    parser.add_argument("--version", default="1.1", choices=["1.1", "2.0"])
    parser.add_argument("--n-best-size", type=int, default=20)
    parser.add_argument("--max-answer-length", type=int, default=30)
    parser.add_argument("--null-score-diff-threshold", type=float, default=0.0)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--precision", choices=["auto", "bf16", "fp16", "fp32"], default="auto")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads of torch (the rule's threads)")
    args = parser.parse_args(argv)

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)

    from workflow.squad.finetune import load_qa_model

    examples = load_squad(args.dataset, args.version)
    features = load_features(args.features)
    if "offsets" not in features:
        raise UserError(f"{args.features}: training features; prediction needs evaluation features")
    if list(features["example_ids"]) != [e.qas_id for e in examples]:
        raise UserError(f"{args.features}: features were not made from {args.dataset} (question ids differ)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, _config = load_qa_model(args.model, require_head=True)
    model.to(device)
    precision = resolve_precision(args.precision, device, "squad.precision")
    start_logits, end_logits = compute_logits(model, features, args.batch_size, device, precision)
    predictions, nbest, null_odds = postprocess(
        examples, features, start_logits, end_logits, args.n_best_size, args.max_answer_length,
        args.version, args.null_score_diff_threshold,
    )
    write_text(args.nbest, json.dumps(nbest, indent=2, ensure_ascii=False) + "\n")
    if args.null_odds and args.version == "2.0":
        write_text(args.null_odds, json.dumps(null_odds, indent=2) + "\n")
    write_text(args.predictions, json.dumps(predictions, indent=2, ensure_ascii=False) + "\n")
    log.info("%d predictions -> %s", len(predictions), args.predictions)


if __name__ == "__main__":
    run(main)
