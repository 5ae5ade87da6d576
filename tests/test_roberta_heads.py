"""RoBERTa and XLM-R fine-tuning through the shared heads: every head (sequence classification, regression, token
classification, question answering) fine-tunes from a directory Hugging Face saved from a random small config and
exports HF's RobertaFor* / XLMRobertaFor* layout, whose Auto classes compute our logits and whose pipeline() predicts
what we do; features take the family's special tokens by role in its tokenizer's pair template (`<s> a </s></s> b
</s>`, token types 0); the rules fine-tune and score SQuAD and GLUE from a RoBERTa directory. The ModernBERT heads'
test module (tests/test_modernbert_heads.py) supplies the jobs, features and the rules' run.
"""
import json

import numpy as np
import pytest
import torch

from tests.test_modernbert_heads import (HEADS, assert_pipelines_predict_our_logits, features, finetuned,
                                        logit_difference_to_hf, squad_and_glue_through_the_rules)
from tests.test_roberta import roberta_bpe, xlmr_unigram
from workflow.classify.model import load_classifier
from workflow.squad.finetune import load_qa_model

transformers = pytest.importorskip("transformers")

SEQ = 64
HF_CLASSES = {"roberta": ("RobertaConfig", "RobertaForMaskedLM", "Roberta"),
              "xlm-roberta": ("XLMRobertaConfig", "XLMRobertaForMaskedLM", "XLMRoberta")}
KINDS = {"classification": "SequenceClassification", "regression": "SequenceClassification",
         "token_classification": "TokenClassification", "squad": "QuestionAnswering"}
TOKENIZERS = {"roberta": roberta_bpe, "xlm-roberta": xlmr_unigram}


@pytest.fixture(scope="module", params=list(HF_CLASSES))
def init(request, tmp_path_factory):
    """(model_type, an HF directory transformers itself saved from a random small config of that type (512 positions
    past the padding index) with its tokenizer.json, its Vocabulary)."""
    from workflow.data.tokenizer import Vocabulary, save_tokenizer

    model_type = request.param
    root = tmp_path_factory.mktemp(model_type)
    tokenizer = TOKENIZERS[model_type](root / "tokenizer.json")
    vocab = Vocabulary.load(tokenizer)
    config_class, model_class = (getattr(transformers, name) for name in HF_CLASSES[model_type][:2])
    torch.manual_seed(0)
    config = config_class(vocab_size=(vocab.size + 7) // 8 * 8, hidden_size=32, intermediate_size=64,
                          num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=512 + vocab.pad + 1,
                          pad_token_id=vocab.pad, bos_token_id=vocab.cls, eos_token_id=vocab.sep)
    model_class(config).save_pretrained(root / "model")
    save_tokenizer(tokenizer, root / "model", None, 512)
    return model_type, root / "model", vocab


@pytest.fixture(scope="module")
def exports(init, tmp_path_factory):
    """exports(head): the fine-tuned model directory (made once per model type)."""
    made = {}

    def export(head: str):
        if head not in made:
            made[head] = finetuned(head, init[1], init[2], tmp_path_factory.mktemp(f"{init[0]}_{head}"), SEQ)
        return made[head]

    return export


@pytest.mark.parametrize("head", HEADS)
def test_a_finetuned_head_exports_hfs_layout_and_hf_computes_our_logits(init, exports, head):
    model_type, _, vocab = init
    model_dir = exports(head)
    architecture = f"{HF_CLASSES[model_type][2]}For{KINDS[head]}"
    config = json.loads((model_dir / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == (model_type, [architecture])
    assert (model_dir / "tokenizer.json").is_file()

    ours, _ = HEADS[head][1](model_dir)
    dev = {k: torch.from_numpy(v.astype(np.int64)) for k, v in features(head, vocab, 4, seed=1, seq=SEQ).items()}
    assert logit_difference_to_hf(ours, model_dir, HEADS[head][2], architecture, dev, f"{model_type} {head}") < 1e-5


def test_pipelines_predict_what_our_logits_say(exports):
    classifier_dir, tagger_dir = exports("classification"), exports("token_classification")
    text = "The river flows north through the valley. In winter the river freezes."
    encoded = transformers.AutoTokenizer.from_pretrained(classifier_dir)(text, return_tensors="pt")
    assert_pipelines_predict_our_logits(classifier_dir, tagger_dir, text, encoded)


def test_another_tasks_classifier_is_dropped_and_a_masked_lm_directory_has_no_head(init, exports):
    from workflow.cli import UserError

    model_type = init[0]
    with pytest.raises(UserError, match=rf"no classifier\.out_proj\.\* weights: not a fine-tuned "
                                        rf"{HF_CLASSES[model_type][2]}ForSequenceClassification"):
        load_classifier(init[1], 3, require_head=True)
    with pytest.raises(UserError, match=r"no qa_outputs\.\* weights"):
        load_qa_model(init[1], require_head=True)
    other_task = exports("classification")
    with pytest.raises(UserError, match="its classifier.out_proj has 3 outputs, the task 1"):
        load_classifier(other_task, 1, require_head=True)
    model, _ = load_classifier(other_task, 1)  # its out_proj dropped, its dense kept
    kept, _ = load_classifier(other_task, 3, require_head=True)
    assert torch.equal(model.classifier.dense.weight, kept.classifier.dense.weight)
    assert model.classifier.out_proj.out_features == 1


def test_features_follow_the_tokenizers_own_pair_template_and_token_types(init):
    """GLUE's pair rows and SQuAD's question-context windows as the family's tokenizer.json encodes a pair (RoBERTa:
    `<s> a </s></s> b </s>`, XLM-R alike, every token type 0), its padding id after them."""
    from tokenizers import Tokenizer

    from workflow.classify.features import featurize
    from workflow.squad.data import SquadExample, featurize as squad_featurize

    _, directory, vocab = init
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    a, b = "The river flows north.", "Its water feeds the old mill."
    for first, second in ((a, b), (a, None)):
        row = featurize([(first, second)], np.array([0]), tokenizer, max_seq_length=48)
        reference = tokenizer.encode(first, second)
        length = len(reference.ids)
        assert row["input_ids"][0, :length].tolist() == reference.ids
        assert row["token_type_ids"][0, :length].tolist() == reference.type_ids == [0] * length
        assert set(row["input_ids"][0, length:].tolist()) == {vocab.pad}
    assert tokenizer.encode(a, b).ids.count(vocab.sep) == 3  # </s></s> between the texts, </s> after

    question, context = "Where does the river flow?", "The river flows north through the valley."
    example = SquadExample(qas_id="q", question=question, context=context, answers=[
        {"text": "north", "answer_start": context.index("north")}])
    window = squad_featurize([example], tokenizer, max_seq_length=96, max_query_length=40, training=True)
    reference = tokenizer.encode(question, context)
    assert window["input_ids"][0, :len(reference.ids)].tolist() == reference.ids
    assert window["token_type_ids"][0].tolist() == [0] * 96
    start = int(window["start_positions"][0])
    assert tokenizer.decode(reference.ids[start:int(window["end_positions"][0]) + 1]).strip() == "north"


def test_squad_and_glue_run_through_the_rules_from_a_roberta_directory(init, workflow_copy):
    """RoBERTa's and XLM-R's heads fine-tuned and scored by the rules themselves, as ModernBERT's are."""
    model_type, directory, _ = init
    squad_and_glue_through_the_rules(directory, workflow_copy, model_type)
