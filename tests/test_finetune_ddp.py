"""Every fine-tuning head trains under DDP as a multi-GPU run does: two gloo ranks started by the launcher (as
`profiles/local` starts one rank per GPU through torchrun), DDP with find_unused_parameters=False, two micro-batches
per rank and step (no_sync on the first), three steps. A parameter that takes no part in the loss fails the second
step ("Expected to have finished reduction in the prior iteration"). A question-answering task of the config's tasks
section runs workflow.squad.finetune: the squad case. Each head of each model family: the init directory's model
type picks BERT's heads or ModernBERT's (HF's ModernBertFor* layout, no pooler)."""
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from workflow.data.features import save_features
from workflow.tasks.tokens import IGNORE
from workflow.train.finetune import FinetuneSettings
from workflow.train.models import family
from workflow.train.models.bert import BertConfig, BertForPreTraining, save_pretrained
from workflow.train.models.modernbert import ModernBertConfig, ModernBertForMaskedLM

ROWS, SEQ, VOCAB = 48, 16, 32  # 48 rows in batches of 16: 3 steps in one epoch
RECIPE = {**vars(FinetuneSettings()), "learning_rate": 1e-3, "epochs": 1.0, "batch_size": 16, "micro_batch_size": 4,
          "log_every": 1}
SEED = RECIPE.pop("seed")


def features(head: str, rows: int = ROWS, seq: int = SEQ, vocab: int = VOCAB, seed: int = 0) -> dict:
    """Random training features of the head: ids [5, vocab), rows half to fully real, 2 or 3 labels."""
    rng = np.random.default_rng(seed)
    out = {"input_ids": rng.integers(5, vocab, (rows, seq)).astype(np.int32),
           "token_type_ids": np.zeros((rows, seq), np.int8),
           "attention_mask": (np.arange(seq) < rng.integers(seq // 2, seq + 1, (rows, 1))).astype(np.int8)}
    if head == "squad":
        out["start_positions"] = rng.integers(1, seq - 4, rows)
        out["end_positions"] = out["start_positions"] + 2
    elif head == "classification":
        out["labels"] = rng.integers(0, 2, rows)
    elif head == "regression":
        out["labels"] = rng.uniform(0, 5, rows).astype(np.float32)
    else:
        out["labels"] = np.where(rng.random((rows, seq)) < 0.3, IGNORE, rng.integers(0, 3, (rows, seq)))
    return out


def command(head: str, root) -> list[str]:
    common = ["--init", str(root / "init"), "--features", str(root / "train.npz"), "--output", str(root / "model"),
              "--run-dir", str(root / "run"), "--device", "cpu", "--threads", "2"]
    if head == "squad":
        return ["workflow.squad.finetune", "--config", json.dumps({"seed": SEED, "squad": RECIPE}), *common]
    if head in ("classification", "regression"):
        glue = {**RECIPE, "max_seq_length": SEQ, "tasks": [], "overrides": {}}
        task = "SST-2" if head == "classification" else "STS-B"
        return ["workflow.glue.finetune", "--config", json.dumps({"seed": SEED, "glue": glue}), "--task", task,
                *common]
    (root / "labels.json").write_text(json.dumps({"labels": ["O", "B-PER", "I-PER"]}))
    config = {"seed": SEED, "glue": {**RECIPE, "max_seq_length": SEQ}, "squad": {},
              "tasks": {"ner": {"type": "token_classification", "train": "train.conll"}}}
    return ["workflow.tasks.run", "finetune", "--config", json.dumps(config), "--name", "ner", "--labels",
            str(root / "labels.json"), *common]


def prepare(head: str, root, model_family: str = "bert") -> None:
    """root/init: a tiny randomly initialised export of the family; root/train.npz: the head's training features."""
    torch.manual_seed(0)
    (root / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]",
                                               *(f"w{i}" for i in range(VOCAB - 5))]) + "\n")
    if model_family == "bert":
        config = BertConfig.preset("tiny", vocab_size=VOCAB, max_position_embeddings=SEQ)
        save_pretrained(BertForPreTraining(config), config, root / "vocab.txt", root / "init")
    else:  # a local window of 8: the 16-token rows cross it
        config = ModernBertConfig.preset("modernbert-tiny", vocab_size=VOCAB, max_position_embeddings=SEQ,
                                         local_attention=8, pad_token_id=0, cls_token_id=2, bos_token_id=2,
                                         sep_token_id=3, eos_token_id=3)
        family.save_pretrained(ModernBertForMaskedLM(config), config, root / "vocab.txt", root / "init")
    save_features(root / "train.npz", features(head))


HEADS = ["squad", "classification", "regression", "token_classification"]
FAMILIES = ["bert", "modernbert"]


@pytest.mark.parametrize("model_family", FAMILIES)
@pytest.mark.parametrize("head", HEADS)
def test_every_finetuning_head_trains_three_steps_on_two_ranks_under_ddp(head, model_family, tmp_path, repo_env):
    prepare(head, tmp_path, model_family)
    argv = [sys.executable, "-m", "workflow.slurm.launch", "--", sys.executable, "-m", *command(head, tmp_path),
            "--metrics", str(tmp_path / "metrics.jsonl")]
    result = subprocess.run(argv, env={**repo_env, "SNAKEBERT_LOCAL_RANKS": "2", "OMP_NUM_THREADS": "1"},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "4 micro x 2 accumulation x 2 ranks" in result.stderr
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    assert (tmp_path / "model" / "model.safetensors").is_file()
    exported = json.loads((tmp_path / "model" / "config.json").read_text())
    assert exported["model_type"] == model_family
