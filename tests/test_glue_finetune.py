"""GLUE fine-tuning learns the bundled sentiment sample and a regression task far above chance on held-out rows,
exports a classifier transformers loads with equal logits, and resumes a killed run to the identical model."""
import json
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from workflow.cli import UserError
from workflow.classify import evaluate as classify_eval, model as classifier
from workflow.classify.metrics import score
from workflow.glue import data as glue_data, finetune as glue_finetune
from workflow.data.features import load_tokenizer, save_features
from workflow.train.models.bert import BertConfig, BertForPreTraining, save_pretrained

GOOD, BAD = "fine nice good fair".split(), "poor sad bad grim".split()


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def sts_rows(n: int, seed: int) -> list[str]:
    """STS-B layout; the score is how many of sentence 2's five adjectives are good ones (0..5)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        good = rng.randint(0, 5)
        words = rng.sample(GOOD * 2, good) + rng.sample(BAD * 2, 5 - good)
        rng.shuffle(words)
        rows.append(f"{i}\tmain\tsynthetic\t2026\t{i:04d}\tnone\tnone\tthe day was\tit was {' '.join(words)}\t{good}.0")
    return rows


@pytest.fixture(scope="module")
def tasks(tmp_path_factory, sample_dir):
    """Per task (SST-2 from sample/glue, a synthetic STS-B): train/dev features (seq 32) on a whole-word vocab, and
    one randomly initialised tiny BERT export."""
    root = tmp_path_factory.mktemp("glue")
    header = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore"
    (root / "STS-B").mkdir()
    for split, n, seed in (("train", 300, 1), ("dev", 100, 2)):
        (root / "STS-B" / f"{split}.tsv").write_text("\n".join([header, *sts_rows(n, seed)]) + "\n")
    files = {("SST-2", split): sample_dir / "glue" / "SST-2" / f"{split}.tsv" for split in ("train", "dev")}
    files.update({("STS-B", split): root / "STS-B" / f"{split}.tsv" for split in ("train", "dev")})
    read = {key: glue_data.read_tsv(path, glue_data.TASKS[key[0]]) for key, path in files.items()}
    words = sorted({w for pairs, _, _ in read.values() for pair in pairs for text in pair if text for w in text.split()})
    (root / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    tokenizer = load_tokenizer(root / "vocab.txt", lowercase=True)
    for (task, split), (pairs, labels, _) in read.items():
        save_features(root / f"{task}_{split}.npz", glue_data.featurize(pairs, labels, tokenizer, 32))
    torch.manual_seed(0)
    config = BertConfig.preset("tiny", vocab_size=len(words) + 5, max_position_embeddings=32)
    save_pretrained(BertForPreTraining(config), config, root / "vocab.txt", root / "init")
    return root


def dev_scores(task: str, model_dir, root, require_head=True) -> dict:
    if not require_head:  # the untrained baseline: a fresh head on the init (the same whatever ran before)
        torch.manual_seed(0)
        model, _ = classifier.load_classifier(model_dir, glue_data.TASKS[task].num_labels)
        features = dict(np.load(root / f"{task}_dev.npz"))
        logits = classify_eval.compute_logits(model, features, 64, torch.device("cpu"), "fp32")
        return score(glue_data.TASKS[task], logits, features["labels"])
    return classify_eval.evaluate(glue_data.TASKS[task], model_dir, {"dev": root / f"{task}_dev.npz"}, 64, "fp32",
                              "cpu")["splits"]["dev"]


def test_sentiment_finetuning_reaches_far_above_chance_on_held_out_rows(tasks, tmp_path):
    labels = np.load(tasks / "SST-2_dev.npz")["labels"]
    majority = max(labels.mean(), 1 - labels.mean())
    untrained = dev_scores("SST-2", tasks / "init", tasks, require_head=False)["accuracy"]
    settings = classifier.ClassifierSettings(learning_rate=1e-3, epochs=3, batch_size=16, micro_batch_size=16,
                                             log_every=5)
    assert classifier.finetune(glue_data.TASKS["SST-2"], tasks / "init", tasks / "SST-2_train.npz",
                               tmp_path / "model", tmp_path / "run", settings, metrics_path=tmp_path / "m.jsonl",
                               device="cpu") == 0
    trained = dev_scores("SST-2", tmp_path / "model", tasks)["accuracy"]
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    print(f"SST-2 dev accuracy: majority {majority:.3f}, untrained {untrained:.3f}, fine-tuned {trained:.3f}")
    # measured: 1.000 (majority 0.5625, untrained 0.44-0.56)
    assert trained >= 0.9 and trained >= majority + 0.3 and trained >= untrained + 0.3
    print([(r["step"], round(r["loss"], 3), round(r["accuracy"], 3)) for r in records])
    assert records[-1]["step"] == 45 and records[-1]["loss"] < records[0]["loss"] - 0.15
    assert records[-1]["accuracy"] >= 0.9 > records[0]["accuracy"]  # the training accuracy of the last 5 steps
    assert not (tmp_path / "run").exists()  # checkpoints are scratch, removed once the model is exported


def test_regression_head_learns_the_score_far_above_chance(tasks, tmp_path):
    untrained = dev_scores("STS-B", tasks / "init", tasks, require_head=False)
    settings = classifier.ClassifierSettings(learning_rate=1e-3, epochs=4, batch_size=16, micro_batch_size=16)
    classifier.finetune(glue_data.TASKS["STS-B"], tasks / "init", tasks / "STS-B_train.npz", tmp_path / "model",
                        tmp_path / "run", settings, device="cpu")
    trained = dev_scores("STS-B", tmp_path / "model", tasks)
    print(f"STS-B dev: untrained {untrained}, fine-tuned {trained}")
    # Chance (a prediction independent of the score) is 0. A fresh head is no such baseline: the random encoder's
    # features carry the score, and its random readout of them correlated from -0.80 to 0.94 over 30 seeds.
    assert trained["pearson"] >= 0.8 and trained["spearman"] >= 0.8


def test_exported_classifier_loads_in_transformers_with_equal_logits(tasks, tmp_path):
    transformers = pytest.importorskip("transformers")
    for task in ("SST-2", "STS-B"):
        classifier.finetune(glue_data.TASKS[task], tasks / "init", tasks / f"{task}_train.npz", tmp_path / task,
                            tmp_path / f"run-{task}", classifier.ClassifierSettings(
                                learning_rate=1e-3, epochs=0.2, batch_size=16, micro_batch_size=8), device="cpu")
        ours, _ = classifier.load_classifier(tmp_path / task, glue_data.TASKS[task].num_labels, require_head=True)
        theirs = transformers.BertForSequenceClassification.from_pretrained(str(tmp_path / task))
        ours.eval(), theirs.eval()
        features = np.load(tasks / f"{task}_dev.npz")
        batch = {k: torch.from_numpy(features[k][:6].astype(np.int64))
                 for k in ("input_ids", "token_type_ids", "attention_mask")}
        with torch.no_grad():
            mine = ours(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])
            reference = theirs(**batch).logits
        assert torch.allclose(mine, reference, atol=1e-4), task
        assert theirs.config.problem_type == ("regression" if task == "STS-B" else "single_label_classification")


def glue_config(**overrides) -> str:
    """The config sections fine-tuning reads (seed, glue), as the rule hands them over."""
    settings = {**vars(classifier.ClassifierSettings()), "tasks": ["SST-2"], "overrides": {}, **overrides}
    return json.dumps({"seed": settings.pop("seed"), "glue": settings})


def test_killed_finetuning_resumes_to_the_identical_model_with_the_tasks_override(tasks, tmp_path, repo_env):
    def command(name):
        config = glue_config(learning_rate=5e-5, epochs=1, batch_size=32, micro_batch_size=16, checkpoint_every=2,
                             precision="fp32", log_every=1, overrides={"SST-2": {"learning_rate": 1e-3}})
        return [sys.executable, "-m", "workflow.glue.finetune", "--config", config, "--task", "SST-2", "--init",
                str(tasks / "init"), "--features", str(tasks / "SST-2_train.npz"), "--output", str(tmp_path / name),
                "--run-dir", str(tmp_path / f"run-{name}"), "--threads", "1", "--metrics",
                str(tmp_path / f"{name}.jsonl")]

    subprocess.run(command("straight"), check=True, env=repo_env, capture_output=True)
    killed = subprocess.run(command("resumed"), env={**repo_env, "SNAKEBERT_FAIL_AT_STEP": "5"}, capture_output=True)
    assert killed.returncode == -9 and not (tmp_path / "resumed").exists()
    resumed = subprocess.run(command("resumed"), check=True, env=repo_env, capture_output=True, text=True)
    assert "resumed from" in resumed.stderr and "at step 4/8" in resumed.stderr
    assert (tmp_path / "resumed" / "model.safetensors").read_bytes() == \
        (tmp_path / "straight" / "model.safetensors").read_bytes()
    lrs = [json.loads(line)["lr"] for line in (tmp_path / "straight.jsonl").read_text().splitlines()]
    assert 5e-4 < max(lrs) <= 1e-3  # glue.overrides.SST-2.learning_rate (decaying), not glue.learning_rate 5e-5


def test_a_changed_override_refuses_to_resume_naming_the_key(tasks, tmp_path, repo_env):
    command = [sys.executable, "-m", "workflow.glue.finetune", "--config",
               glue_config(epochs=1, batch_size=32, micro_batch_size=16, checkpoint_every=2), "--task", "SST-2",
               "--init", str(tasks / "init"), "--features", str(tasks / "SST-2_train.npz"), "--output",
               str(tmp_path / "model"), "--run-dir", str(tmp_path / "run"), "--threads", "1"]
    assert subprocess.run(command, env={**repo_env, "SNAKEBERT_FAIL_AT_STEP": "3"}, capture_output=True).returncode == -9
    changed = glue_finetune.settings_of(json.loads(glue_config(
        epochs=1, batch_size=32, micro_batch_size=16, checkpoint_every=2, overrides={"SST-2": {"epochs": 2}})), "SST-2")
    with pytest.raises(UserError) as error:
        classifier.finetune(glue_data.TASKS["SST-2"], tasks / "init", tasks / "SST-2_train.npz",
                            tmp_path / "model", tmp_path / "run", changed, device="cpu")
    assert str(error.value) == (f"{tmp_path / 'run'}: its checkpoints belong to a run with other settings "
                                f"(glue.epochs 1 -> 2); to start over, move or delete {tmp_path / 'run'} "
                                "(nothing was deleted)")
    assert [p.name for p in (tmp_path / "run" / "checkpoints").glob("*.pt")] == ["step_00000002.pt"]


def test_features_of_another_task_are_refused(tasks, tmp_path):
    with pytest.raises(UserError, match="labels of another task than SST-2"):
        classifier.finetune(glue_data.TASKS["SST-2"], tasks / "init", tasks / "STS-B_train.npz",
                            tmp_path / "model", tmp_path / "run", device="cpu")


def test_two_ranks_through_the_launcher_end_like_one_process_with_the_same_global_batch(tasks, tmp_path, repo_env):
    config = BertConfig.from_json(tasks / "init" / "config.json")
    config.hidden_dropout_prob = config.attention_probs_dropout_prob = 0.0  # no per-rank dropout masks to differ
    torch.manual_seed(0)
    save_pretrained(BertForPreTraining(config), config, tasks / "vocab.txt", tmp_path / "init")

    def command(name):
        settings = glue_config(learning_rate=1e-3, epochs=1, batch_size=32, micro_batch_size=16, precision="fp32")
        return [sys.executable, "-m", "workflow.slurm.launch", "--", sys.executable, "-m",
                "workflow.glue.finetune", "--config", settings, "--task", "SST-2", "--init", str(tmp_path / "init"),
                "--features", str(tasks / "SST-2_train.npz"), "--output", str(tmp_path / name), "--run-dir",
                str(tmp_path / f"run-{name}"), "--device", "cpu", "--threads", "2"]

    two = subprocess.run(command("two"), env={**repo_env, "SNAKEBERT_LOCAL_RANKS": "2"}, capture_output=True,
                         text=True, timeout=300)
    assert two.returncode == 0 and "1 accumulation x 2 ranks" in two.stderr, two.stderr[-3000:]
    one = subprocess.run(command("one"), env=repo_env, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0 and "2 accumulation x 1 ranks" in one.stderr, one.stderr[-3000:]
    expected, _ = classifier.load_classifier(tmp_path / "one", 2, require_head=True)
    got, _ = classifier.load_classifier(tmp_path / "two", 2, require_head=True)
    for (name, want), have in zip(expected.state_dict().items(), got.state_dict().values()):
        assert torch.allclose(have, want, atol=1e-5, rtol=1e-4), name  # fp32 sums in another order only
