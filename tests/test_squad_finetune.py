"""SQuAD fine-tuning learns on a synthetic QA set, exports an HF-loadable QA model, and resumes exactly."""
import json
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from workflow.data import features as feature_files
from workflow.squad import data as squad_data, evaluate as squad_eval, finetune as squad_finetune, predict as squad_predict
from workflow.train.models.bert import BertConfig, BertForPreTraining, save_pretrained
from workflow.data.vocab import Normalization

FILLER = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
          "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()
VALUES = "red green blue amber paris london rome oslo lion tiger bear wolf".split()


def synthetic_squad(n: int, seed: int, prefix: str) -> dict:
    """'what is the code ?' about filler text holding 'the code is X .'; value words also occur as distractors."""
    rng = random.Random(seed)
    paragraphs = []
    for i in range(n):
        chunks = [rng.choice(VALUES if rng.random() < 0.15 else FILLER) for _ in range(rng.randint(6, 12))]
        value = rng.choice(VALUES)
        chunks.insert(rng.randint(0, len(chunks)), f"the code is {value} .")
        context = " ".join(chunks)
        start = context.index("the code is ") + len("the code is ")
        paragraphs.append({"context": context, "qas": [{"id": f"{prefix}{i}", "question": "what is the code ?",
                                                        "answers": [{"text": value, "answer_start": start}]}]})
    return {"version": "1.1", "data": [{"title": "synthetic", "paragraphs": paragraphs}]}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    return make_synthetic(tmp_path_factory.mktemp("synthetic"))


def make_synthetic(root):
    """Train/dev JSON, a whole-word vocab, features (seq 32) and a randomly initialised tiny BERT export."""
    (root / "train.json").write_text(json.dumps(synthetic_squad(200, 1, "t")))
    (root / "dev.json").write_text(json.dumps(synthetic_squad(60, 2, "d")))
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", "?", "the", "is", "what", "code", *FILLER, *VALUES]
    (root / "vocab.txt").write_text("\n".join(words) + "\n")
    tokenizer = feature_files.load_tokenizer(root / "vocab.txt", lowercase=True)
    train = squad_data.featurize(squad_data.load_squad(root / "train.json", "1.1"), tokenizer, 32, 16, 8, True)
    feature_files.save_features(root / "train.npz", train)
    torch.manual_seed(0)
    config = BertConfig.preset("tiny", vocab_size=len(words), max_position_embeddings=32,
                               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    save_pretrained(BertForPreTraining(config), config, root / "vocab.txt", root / "init", normalization=Normalization())
    dev_examples = squad_data.load_squad(root / "dev.json", "1.1")
    dev = squad_data.featurize(dev_examples, tokenizer, 32, 16, 8, False)
    return root, dev_examples, dev


def dev_f1(model_dir, dev_examples, dev, dataset_path, require_head=True) -> float:
    model, _ = squad_finetune.load_qa_model(model_dir, require_head=require_head)
    start, end = squad_predict.compute_logits(model, dev, 64, torch.device("cpu"), "fp32")
    predictions, _, _ = squad_predict.postprocess(dev_examples, dev, start, end, 20, 30)
    return squad_eval.evaluate(json.loads(dataset_path.read_text()), predictions)["f1"]


def test_finetuning_learns_far_above_trivial_baselines(synthetic, tmp_path):
    root, dev_examples, dev = synthetic
    untrained = dev_f1(root / "init", dev_examples, dev, root / "dev.json", require_head=False)
    # "predict the first context word" baseline
    first_words = {e.qas_id: e.context.split()[0] for e in dev_examples}
    first_word = squad_eval.evaluate(json.loads((root / "dev.json").read_text()), first_words)["f1"]
    # "predict the first value word" baseline: beats it only by reading the context ("the code is ...")
    first_values = {e.qas_id: next(w for w in e.context.split() if w in VALUES) for e in dev_examples}
    first_value = squad_eval.evaluate(json.loads((root / "dev.json").read_text()), first_values)["f1"]

    code = squad_finetune.finetune(root / "init", root / "train.npz", tmp_path / "model", tmp_path / "run",
                                   squad_finetune.FinetuneSettings(learning_rate=1e-3, epochs=25, batch_size=8,
                                                                   micro_batch_size=8, warmup_proportion=0.1,
                                                                   log_every=25),
                                   metrics_path=tmp_path / "metrics.jsonl", device="cpu")
    assert code == 0
    trained = dev_f1(tmp_path / "model", dev_examples, dev, root / "dev.json")
    losses = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    print(f"dev F1: untrained {untrained:.1f}, first word {first_word:.1f}, first value {first_value:.1f}, "
          f"fine-tuned {trained:.1f}; "
          f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    # measured: 95.0 here (75-95 over other seeds/thread counts) vs. 10.9 / 0.0 / 53.3 for the baselines
    assert trained >= 70 and trained >= max(untrained, first_word) + 55 and trained >= first_value + 15
    assert losses[-1] < losses[0] / 3
    assert not (tmp_path / "run").exists()  # checkpoints are scratch, removed once the model is exported


def test_exported_model_loads_in_transformers_with_equal_logits(synthetic, tmp_path):
    transformers = pytest.importorskip("transformers")
    root, _, dev = synthetic
    squad_finetune.finetune(root / "init", root / "train.npz", tmp_path / "model", tmp_path / "run",
                            squad_finetune.FinetuneSettings(learning_rate=1e-3, epochs=0.1, batch_size=16,
                                                            micro_batch_size=8), device="cpu")
    ours, _ = squad_finetune.load_qa_model(tmp_path / "model", require_head=True)
    ours.eval()
    theirs = transformers.BertForQuestionAnswering.from_pretrained(str(tmp_path / "model"))
    theirs.eval()
    batch = {k: torch.from_numpy(dev[k][:4].astype(np.int64)) for k in ("input_ids", "token_type_ids",
                                                                         "attention_mask")}
    with torch.no_grad():
        start, end = ours(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])
        reference = theirs(**batch)
    assert torch.allclose(start, reference.start_logits, atol=1e-4)
    assert torch.allclose(end, reference.end_logits, atol=1e-4)
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config["architectures"] == ["BertForQuestionAnswering"]
    # Its tokenizer lower-cases, as the pretrained model's it started from.
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "model")
    assert tokenizer("What IS the code?")["input_ids"] == [2, 9, 8, 7, 10, 6, 3]


def squad_config(**overrides) -> str:
    """The config sections fine-tuning reads (seed, squad), as the rule hands them over."""
    settings = {**vars(squad_finetune.FinetuneSettings()), **overrides}
    return json.dumps({"seed": settings.pop("seed"), "squad": settings})


def test_killed_finetuning_resumes_to_the_identical_model(synthetic, tmp_path, repo_env):
    root, _, _ = synthetic

    def command(name):
        config = squad_config(learning_rate=1e-3, epochs=1, batch_size=32, micro_batch_size=16, checkpoint_every=2,
                              precision="fp32", log_every=1)
        return [sys.executable, "-m", "workflow.squad.finetune", "--config", config, "--init", str(root / "init"),
                "--features", str(root / "train.npz"), "--output", str(tmp_path / name), "--run-dir",
                str(tmp_path / f"run-{name}"), "--threads", "1", "--metrics", str(tmp_path / f"{name}.jsonl")]

    subprocess.run(command("straight"), check=True, env=repo_env, capture_output=True)
    killed = subprocess.run(command("resumed"), env={**repo_env, "SNAKEBERT_FAIL_AT_STEP": "5"},
                            capture_output=True, text=True)
    assert killed.returncode == -9 and not (tmp_path / "resumed").exists()
    resumed = subprocess.run(command("resumed"), check=True, env=repo_env, capture_output=True, text=True)
    assert "resumed from" in resumed.stderr and "at step 4/7" in resumed.stderr
    straight = (tmp_path / "straight" / "model.safetensors").read_bytes()
    assert (tmp_path / "resumed" / "model.safetensors").read_bytes() == straight

    def losses(name):  # steps 5 logged before the kill are dropped and logged again after the resume
        return [(r["step"], r["loss"]) for r in map(json.loads, (tmp_path / f"{name}.jsonl").read_text().splitlines())]

    assert losses("resumed") == losses("straight") and [s for s, _ in losses("straight")] == list(range(1, 8))


def test_sigterm_checkpoints_and_exits_then_a_rerun_finishes(synthetic, tmp_path, repo_env):
    root, _, _ = synthetic
    config = squad_config(epochs=20, batch_size=8, micro_batch_size=8, checkpoint_every=10000, log_every=1)
    command = [sys.executable, "-m", "workflow.squad.finetune", "--config", config, "--init", str(root / "init"),
               "--features", str(root / "train.npz"), "--output", str(tmp_path / "model"), "--run-dir",
               str(tmp_path / "run"), "--metrics", str(tmp_path / "metrics.jsonl"), "--threads", "1"]
    process = subprocess.Popen(command, env=repo_env, stderr=subprocess.PIPE, text=True)
    partial = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 120
    while not (partial.exists() and partial.read_text().count("\n") >= 3) and time.time() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, stderr[-2000:]
    saved = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*.pt"))
    assert len(saved) == 1 and not (tmp_path / "model").exists()  # a checkpoint at the stop, no model
    stopped_at = int(saved[0][len("step_"):-len(".pt")])
    assert 3 <= stopped_at < 500

    rerun = subprocess.run(command, env=repo_env, capture_output=True, text=True, check=True)
    assert f"at step {stopped_at}/500" in rerun.stderr
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 501))


def test_learning_rate_never_exceeds_the_peak_with_a_fractional_warmup():
    from workflow.train.finetune import linear_warmup_decay

    total = 25  # warmup 0.1 x 25 = 2.5 steps: step 2 would give 3 / 2.5 = 1.2 unclamped
    multipliers = [linear_warmup_decay(step, total, 0.1) for step in range(total)]
    assert max(multipliers) == 1.0 and multipliers[0] < multipliers[1] < multipliers[2]
    assert multipliers[-1] > 0 and linear_warmup_decay(total, total, 0.1) == 0.0


def test_batch_size_must_split_into_micro_batches(synthetic, tmp_path):
    root, _, _ = synthetic
    with pytest.raises(squad_finetune.UserError, match=r"config squad\.batch_size \(24\) is not divisible by "
                                                        r"squad\.micro_batch_size \(16\)"):
        squad_finetune.finetune(root / "init", root / "train.npz", tmp_path / "model", tmp_path / "run",
                                squad_finetune.FinetuneSettings(batch_size=24, micro_batch_size=16), device="cpu")


def test_a_changed_learning_rate_refuses_to_resume_and_keeps_the_checkpoints(synthetic, tmp_path, repo_env, capsys):
    root, _, _ = synthetic
    config = squad_config(epochs=1, batch_size=32, micro_batch_size=16, checkpoint_every=2, learning_rate=1e-3)
    command = [sys.executable, "-m", "workflow.squad.finetune", "--config", config, "--init", str(root / "init"),
               "--features", str(root / "train.npz"), "--output", str(tmp_path / "model"), "--run-dir",
               str(tmp_path / "run"), "--threads", "1"]
    killed = subprocess.run(command, env={**repo_env, "SNAKEBERT_FAIL_AT_STEP": "3"}, capture_output=True)
    assert killed.returncode == -9
    changed = squad_finetune.FinetuneSettings(epochs=1, batch_size=32, micro_batch_size=8, checkpoint_every=2,
                                              learning_rate=2e-3)
    with pytest.raises(squad_finetune.UserError) as error:
        squad_finetune.finetune(root / "init", root / "train.npz", tmp_path / "model", tmp_path / "run", changed,
                                device="cpu")
    assert str(error.value) == (f"{tmp_path / 'run'}: its checkpoints belong to a run with other settings "
                                f"(squad.learning_rate 0.001 -> 0.002); to start over, move or delete "
                                f"{tmp_path / 'run'} (nothing was deleted)")
    assert [p.name for p in (tmp_path / "run" / "checkpoints").glob("*.pt")] == ["step_00000002.pt"]


def test_a_killed_run_resumed_with_another_micro_batch_size_ends_like_an_uninterrupted_one(synthetic, tmp_path,
                                                                                            repo_env):
    root, _, _ = synthetic
    recipe = dict(epochs=1, batch_size=32, checkpoint_every=2, learning_rate=1e-3, precision="fp32", log_every=1)
    squad_finetune.finetune(root / "init", root / "train.npz", tmp_path / "straight", tmp_path / "run-straight",
                            squad_finetune.FinetuneSettings(micro_batch_size=16, **recipe), device="cpu")
    command = [sys.executable, "-m", "workflow.squad.finetune", "--config", squad_config(micro_batch_size=16, **recipe),
               "--init", str(root / "init"), "--features", str(root / "train.npz"), "--output", str(tmp_path / "model"),
               "--run-dir", str(tmp_path / "run"), "--threads", "1"]
    assert subprocess.run(command, env={**repo_env, "SNAKEBERT_FAIL_AT_STEP": "5"}, capture_output=True).returncode == -9
    squad_finetune.finetune(root / "init", root / "train.npz", tmp_path / "model", tmp_path / "run",
                            squad_finetune.FinetuneSettings(micro_batch_size=8, **recipe), device="cpu")
    expected, _ = squad_finetune.load_qa_model(tmp_path / "straight", require_head=True)
    got, _ = squad_finetune.load_qa_model(tmp_path / "model", require_head=True)
    for (name, want), have in zip(expected.state_dict().items(), got.state_dict().values()):
        assert torch.allclose(have, want, atol=1e-5, rtol=1e-4), name  # fp32 sums in another order only
