"""SQuAD featurisation: answer spans round-trip through the windows; malformed SQuAD JSON fails naming the id."""
import copy
import json
import subprocess
import sys

import numpy as np
import pytest

from workflow.data import features as feature_files
from workflow.squad import data as squad_data
from workflow.cli import UserError
from workflow.squad.evaluate import normalize_answer

TRAIN = "squad/train-sample.json"
DEV = "squad/dev-sample.json"


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    """A real WordPiece vocab trained on the sample's text (small, so words split into pieces)."""
    from tokenizers import BertWordPieceTokenizer

    from tests.conftest import SAMPLE

    directory = tmp_path_factory.mktemp("vocab")
    texts = set()
    for name in (TRAIN, DEV):
        for example in squad_data.load_squad(SAMPLE / name, "1.1"):
            texts.update([example.context, example.question])
    corpus = directory / "corpus.txt"
    corpus.write_text("\n".join(sorted(texts)))
    trainer = BertWordPieceTokenizer(lowercase=True)
    trainer.train([str(corpus)], vocab_size=500, min_frequency=2, show_progress=False,
                  special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    trainer.save_model(str(directory))
    return directory / "vocab.txt"


def test_sample_is_a_valid_squad_set(sample_dir):
    train = squad_data.load_squad(sample_dir / TRAIN, "1.1")
    dev = squad_data.load_squad(sample_dir / DEV, "1.1")
    assert 100 <= len(train) <= 200 and 30 <= len(dev) <= 60
    assert all(len(e.answers) == 1 for e in train)
    assert np.mean([len(e.answers) for e in dev]) >= 2
    assert len({e.context for e in train}) >= 12


def test_doc_spans_slide_like_run_squad():
    assert squad_data.doc_spans(10, 4, 2) == [(0, 4), (2, 4), (4, 4), (6, 4)]
    assert squad_data.doc_spans(10, 4, 3) == [(0, 4), (3, 4), (6, 4)]
    assert squad_data.doc_spans(3, 4, 2) == [(0, 3)]
    assert squad_data.doc_spans(9, 4, 8) == [(0, 4), (4, 4), (8, 1)]  # stride capped at the window length


def test_max_context_prefers_the_window_where_a_token_is_most_central():
    spans = [(0, 4), (2, 4), (4, 4)]
    # token 3 sits in (0,4) with 0 right context, in (2,4) with 1 left/2 right -> (2,4) wins
    assert squad_data.max_context_flags(spans, 0).tolist() == [True, True, True, False]
    assert squad_data.max_context_flags(spans, 1).tolist() == [False, True, True, False]
    assert squad_data.max_context_flags(spans, 2).tolist() == [False, True, True, True]


@pytest.mark.parametrize("max_seq_length, doc_stride, max_query_length", [(384, 128, 64), (128, 64, 32), (48, 8, 12)])
def test_labelled_spans_decode_back_to_the_answer(sample_dir, vocab, max_seq_length, doc_stride, max_query_length):
    examples = squad_data.load_squad(sample_dir / TRAIN, "1.1")
    tokenizer = feature_files.load_tokenizer(vocab, lowercase=True)
    features = squad_data.featurize(examples, tokenizer, max_seq_length, doc_stride, max_query_length, training=False)
    ids, offsets = features["input_ids"], features["offsets"]
    assert ids.shape[1] == max_seq_length
    labelled = set()
    for f in range(len(ids)):
        example = examples[features["example_index"][f]]
        answer = example.answers[0]
        start, end = int(features["start_positions"][f]), int(features["end_positions"][f])
        context_chars = offsets[f][offsets[f][:, 0] >= 0]
        window_start, window_end = context_chars[0, 0], context_chars[-1, 1]
        inside = window_start <= answer["answer_start"] and answer["answer_start"] + len(answer["text"]) <= window_end
        assert (start > 0) == inside, example.qas_id  # outside the window -> (0, 0) = [CLS]
        if not inside:
            assert end == 0
            continue
        labelled.add(example.qas_id)
        assert ids[f, start] != tokenizer.token_to_id("[CLS]") and features["token_type_ids"][f, start] == 1
        span = example.context[offsets[f, start, 0]:offsets[f, end, 1]]
        assert normalize_answer(span) == normalize_answer(answer["text"]), example.qas_id
        decoded = tokenizer.decode(ids[f, start:end + 1].tolist())  # the WordPieces themselves, too
        assert normalize_answer(decoded).replace(" ", "") == normalize_answer(answer["text"]).replace(" ", "")
    # (each window was labelled iff it holds the whole answer, above); with the real window sizes every
    # answer of the sample fits one; tiny windows may be shorter than a long answer's WordPieces
    if max_seq_length >= 128:
        assert labelled == {e.qas_id for e in examples}
    else:
        assert len(labelled) >= 0.9 * len(examples)


def test_small_windows_leave_some_answers_outside(sample_dir, vocab):
    examples = squad_data.load_squad(sample_dir / TRAIN, "1.1")
    tokenizer = feature_files.load_tokenizer(vocab, lowercase=True)
    features = squad_data.featurize(examples, tokenizer, 48, 8, 12, training=True)
    unlabelled = features["start_positions"] == 0
    assert unlabelled.any() and (~unlabelled).any()
    assert (features["end_positions"][unlabelled] == 0).all()
    assert "offsets" not in features  # training features stay small


def test_featurize_cli_is_deterministic(sample_dir, vocab, tmp_path, repo_env):
    outputs = []
    for name in ("a.npz", "b.npz"):
        subprocess.run([sys.executable, "-m", "workflow.squad.data", "--input", str(sample_dir / DEV),
                        "--vocab", str(vocab), "--output", str(tmp_path / name), "--max-seq-length", "128",
                        "--doc-stride", "64", "--max-query-length", "32"], check=True, env=repo_env,
                       capture_output=True)
        outputs.append((tmp_path / name).read_bytes())
    assert outputs[0] == outputs[1]
    features = feature_files.load_features(tmp_path / "a.npz")
    assert list(features["example_ids"]) == [e.qas_id for e in squad_data.load_squad(sample_dir / DEV, "1.1")]


def _first_question(data):
    return data["data"][0]["paragraphs"][0]["qas"][0]


def _break(kind, data):
    qa = _first_question(data)
    if kind == "missing question":
        del qa["question"]
    elif kind == "missing answers":
        del qa["answers"]
    elif kind == "missing answer_start":
        del qa["answers"][0]["answer_start"]
    elif kind == "start outside context":
        qa["answers"][0]["answer_start"] = 10_000
    elif kind == "start not at answer":
        qa["answers"][0]["answer_start"] += 1
    return data


@pytest.mark.parametrize("kind, message", [
    ("missing question", "missing key 'question'"),
    ("missing answers", "missing key 'answers'"),
    ("missing answer_start", "missing key 'answer_start'"),
    ("start outside context", "outside the context"),
    ("start not at answer", "not the answer text"),
])
def test_malformed_squad_names_the_question_id(sample_dir, kind, message):
    data = _break(kind, json.loads((sample_dir / TRAIN).read_text()))
    qas_id = _first_question(data)["id"]
    with pytest.raises(UserError, match=message) as error:
        squad_data.parse_squad(data, "1.1", "train.json")
    assert f"question id {qas_id!r}" in str(error.value)


def test_wrong_version_and_missing_id_are_named(sample_dir):
    data = json.loads((sample_dir / TRAIN).read_text())
    with pytest.raises(UserError, match=r"version '1.1' in the file, but config squad.version is '2.0'"):
        squad_data.parse_squad(data, "2.0", "train.json")
    del _first_question(data)["id"]
    with pytest.raises(UserError, match=r"data\[0\].paragraphs\[0\].qas\[0\]: missing key 'id'"):
        squad_data.parse_squad(data, "1.1", "train.json")


def test_cli_rejects_malformed_input_without_promoting_output(sample_dir, vocab, tmp_path, repo_env):
    data = _break("start not at answer", json.loads((sample_dir / TRAIN).read_text()))
    bad = tmp_path / "train.json"
    bad.write_text(json.dumps(data))
    output = tmp_path / "features.npz"
    result = subprocess.run([sys.executable, "-m", "workflow.squad.data", "--input", str(bad), "--vocab", str(vocab),
                             "--output", str(output), "--split", "train"], env=repo_env, capture_output=True, text=True)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and f"question id '{_first_question(data)['id']}'" in last
    assert "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == [bad]  # no output, no leftover temporary


def test_squad2_impossible_questions_label_cls(vocab):
    data = {"version": "v2.0", "data": [{"title": "t", "paragraphs": [{
        "context": "The Danube flows to the Black Sea.",
        "qas": [{"id": "p", "question": "Where does the Danube flow?", "is_impossible": False,
                 "answers": [{"text": "the Black Sea", "answer_start": 20}]},
                {"id": "n", "question": "Where does the Volga flow?", "is_impossible": True, "answers": [],
                 "plausible_answers": [{"text": "the Black Sea", "answer_start": 20}]}]}]}]}
    examples = squad_data.parse_squad(copy.deepcopy(data), "2.0")
    assert [e.is_impossible for e in examples] == [False, True]
    tokenizer = feature_files.load_tokenizer(vocab, lowercase=True)
    features = squad_data.featurize(examples, tokenizer, 64, 16, 16, training=True)
    assert features["start_positions"][0] > 0 and features["start_positions"][1] == 0
    data["data"][0]["paragraphs"][0]["qas"][0]["answers"] = []
    with pytest.raises(UserError, match="question id 'p': no answers"):
        squad_data.parse_squad(data, "2.0")
