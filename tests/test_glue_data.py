"""GLUE TSV files are read with their real layouts and quirks; features are BERT's [CLS] a [SEP] b [SEP] rows."""
import subprocess
import sys

import numpy as np
import pytest

from workflow.cli import UserError
from workflow.classify.features import featurize
from workflow.glue import data as glue_data
from workflow.data.features import load_features, load_tokenizer

# One line per file in each task's own layout (header rows, column counts and label spellings of the GLUE release).
LAYOUTS = {
    "CoLA": ("", ["gj04\t1\t\tOur friends won't buy this analysis, let alone the next one we propose.",
                  "gj04\t0\t*\tThey drank the pub."]),
    "SST-2": ("sentence\tlabel", ["it 's a charming and often affecting journey . \t1", "unflinchingly bleak \t0"]),
    "MRPC": ("Quality\t#1 ID\t#2 ID\t#1 String\t#2 String",
             ["1\t702876\t702977\tAmrozi accused his brother .\tReferring to him , Amrozi accused his brother .",
              "0\t2108705\t2108831\tYucaipa owned Dominick 's .\tYucaipa bought Dominick 's in 1995 ."]),
    "STS-B": ("index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore",
              ["0\tmain-captions\tMSRvid\t2012test\t0001\tnone\tnone\tA plane is taking off.\tAn air plane is "
               "taking off.\t5.000", "1\tmain-captions\tMSRvid\t2012test\t0004\tnone\tnone\tA man is playing a "
               "flute.\tA man is playing a \"bamboo\" flute.\t3.800"]),
    "QQP": ("id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate",
            ["133273\t213221\t213222\tHow is the life of a math student?\tWhich level of math is good?\t0",
             "363362\t711435\t711436\tHow do I learn \"Python\"?",  # a truncated row of the real train.tsv kind
             "402555\t536040\t536041\tWhat is a VPN?\tWhat does a VPN do?\t1"]),
    "MNLI": ("index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\tsentence1_parse\t"
             "sentence2_parse\tsentence1\tsentence2\tlabel1\tlabel2\tlabel3\tlabel4\tlabel5\tgold_label",
             ["0\t63735\t63735n\tslate\t( x )\t( y )\t(ROOT x)\t(ROOT y)\tThe new rights are nice enough\t"
              "Everyone really likes the newest benefits\tneutral\tentailment\tneutral\tneutral\tneutral\tneutral",
              "1\t91383\t91383c\tgovernment\t( x )\t( y )\t(ROOT x)\t(ROOT y)\tThis site includes a list.\t"
              "The site does not have a list.\tcontradiction\tcontradiction\tcontradiction\tcontradiction\t"
              "contradiction\tcontradiction"]),
    "QNLI": ("index\tquestion\tsentence\tlabel",
             ["0\tWhat came into force?\tThe law came into force in 1992.\tentailment",
              "1\tWhat is a cow?\tThe sky is blue.\tnot_entailment"]),
    "RTE": ("index\tsentence1\tsentence2\tlabel",
            ["0\tDana Reeve died at 44.\tChristopher Reeve had an accident.\tnot_entailment",
             "1\tYet, we now are discovering.\tBacteria is winning.\tentailment"]),
    "WNLI": ("index\tsentence1\tsentence2\tlabel", ["0\tI stuck a pin through a carrot.\tThe carrot had a hole.\t1"]),
}
EXPECTED = {
    "CoLA": ([("Our friends won't buy this analysis, let alone the next one we propose.", None),
              ("They drank the pub.", None)], [1, 0]),
    "SST-2": ([("it 's a charming and often affecting journey . ", None), ("unflinchingly bleak ", None)], [1, 0]),
    "MRPC": ([("Amrozi accused his brother .", "Referring to him , Amrozi accused his brother ."),
              ("Yucaipa owned Dominick 's .", "Yucaipa bought Dominick 's in 1995 .")], [1, 0]),
    "STS-B": ([("A plane is taking off.", "An air plane is taking off."),
               ("A man is playing a flute.", "A man is playing a \"bamboo\" flute.")], [5.0, 3.8]),
    "QQP": ([("How is the life of a math student?", "Which level of math is good?"),
             ("What is a VPN?", "What does a VPN do?")], [0, 1]),
    "MNLI": ([("The new rights are nice enough", "Everyone really likes the newest benefits"),
              ("This site includes a list.", "The site does not have a list.")], [2, 0]),
    "QNLI": ([("What came into force?", "The law came into force in 1992."), ("What is a cow?", "The sky is blue.")],
             [0, 1]),
    "RTE": ([("Dana Reeve died at 44.", "Christopher Reeve had an accident."),
             ("Yet, we now are discovering.", "Bacteria is winning.")], [1, 0]),
    "WNLI": ([("I stuck a pin through a carrot.", "The carrot had a hole.")], [1]),
}


def write_tsv(path, task, rows=None, header=None):
    header = LAYOUTS[task][0] if header is None else header
    lines = ([header] if glue_data.TASKS[task].header else []) + (LAYOUTS[task][1] if rows is None else rows)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.mark.parametrize("task", list(LAYOUTS))
def test_each_task_reads_its_texts_and_labels_from_its_own_columns(task, tmp_path):
    pairs, labels, skipped = glue_data.read_tsv(write_tsv(tmp_path / "dev.tsv", task), glue_data.TASKS[task])
    expected_pairs, expected_labels = EXPECTED[task]
    assert pairs == expected_pairs
    assert labels.tolist() == pytest.approx(expected_labels)
    assert labels.dtype == (np.float32 if task == "STS-B" else np.int64)
    assert skipped == (1 if task == "QQP" else 0)  # QQP's rows with missing fields are dropped and counted


def test_the_mnli_train_layout_takes_its_label_from_the_last_column(tmp_path):
    header = "\t".join(LAYOUTS["MNLI"][0].split("\t")[:10] + ["label1", "gold_label"])
    row = "\t".join(LAYOUTS["MNLI"][1][0].split("\t")[:10] + ["neutral", "entailment"])
    pairs, labels, _ = glue_data.read_tsv(write_tsv(tmp_path / "train.tsv", "MNLI", [row], header),
                                          glue_data.TASKS["MNLI"])
    assert labels.tolist() == [1] and pairs[0][1] == "Everyone really likes the newest benefits"


@pytest.mark.parametrize(("task", "row", "message"), [
    ("RTE", "2\tA dog runs.\tAn animal moves.\tmaybe", "label 'maybe' is not one of entailment, not_entailment"),
    ("STS-B", "\t".join(["2"] + ["x"] * 8 + ["high"]), "label 'high' is not a number (STS-B is a regression task)"),
    ("MRPC", "1\t1\t2\tonly one sentence", "4 tab-separated fields, MRPC needs at least 5"),
])
def test_a_bad_row_is_one_error_line_naming_file_and_line_and_writes_nothing(task, row, message, tmp_path, repo_env):
    tsv = write_tsv(tmp_path / "dev.tsv", task, LAYOUTS[task][1] + [row])
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n")
    result = subprocess.run([sys.executable, "-m", "workflow.glue.data", "--task", task, "--input", str(tsv),
                             "--vocab", str(vocab), "--output", str(tmp_path / "out.npz")],
                            env=repo_env, capture_output=True, text=True)
    assert result.returncode == 1
    line = len(LAYOUTS[task][1]) + 2  # the header, then the good rows
    assert result.stderr.strip().splitlines()[-1] == f"error: {tsv}:{line}: {message}"
    assert not list(tmp_path.glob("out*"))


def test_features_match_the_tokenizers_own_pair_encoding(tmp_path, repo_env):
    max_seq_length = 32  # no truncation: tokenizers' longest_first breaks ties unlike run_classifier (tested below)
    words = "[PAD] [UNK] [CLS] [SEP] [MASK] a man is playing flute plane taking off an air . the".split()
    (tmp_path / "vocab.txt").write_text("\n".join(words) + "\n")
    tsv = write_tsv(tmp_path / "dev.tsv", "STS-B")
    subprocess.run([sys.executable, "-m", "workflow.glue.data", "--task", "STS-B", "--input", str(tsv), "--vocab",
                    str(tmp_path / "vocab.txt"), "--output", str(tmp_path / "dev.npz"), "--max-seq-length", str(max_seq_length)],
                   env=repo_env, check=True, capture_output=True)
    features = load_features(tmp_path / "dev.npz")
    tokenizer = load_tokenizer(tmp_path / "vocab.txt", lowercase=True)
    tokenizer.enable_padding(length=max_seq_length)
    for row, (a, b) in enumerate(EXPECTED["STS-B"][0]):
        reference = tokenizer.encode(a, b)  # [CLS] a [SEP] b [SEP], BERT's post-processor
        assert features["input_ids"][row].tolist() == reference.ids
        assert features["token_type_ids"][row].tolist() == reference.type_ids
        assert features["attention_mask"][row].tolist() == reference.attention_mask
    assert features["labels"].tolist() == pytest.approx([5.0, 3.8])


def test_a_long_pair_is_truncated_longer_text_first_to_max_seq_length():
    class Words:  # a whitespace tokenizer standing in for WordPiece: ids are word lengths
        def token_to_id(self, token):
            return {"[CLS]": 101, "[SEP]": 102, "[PAD]": 0}[token]

        def encode_batch(self, texts, add_special_tokens):
            return [type("E", (), {"ids": [len(w) for w in t.split()]})() for t in texts]

    pairs = [("a bb ccc dddd eeeee ffffff", "g hh")]
    features = featurize(pairs, np.array([1]), Words(), max_seq_length=9)
    # run_classifier's _truncate_seq_pair: 6 + 2 > 6 tokens -> pop from the longer (a) until 4 + 2 fit
    assert features["input_ids"][0].tolist() == [101, 1, 2, 3, 4, 102, 1, 2, 102]
    assert features["token_type_ids"][0].tolist() == [0, 0, 0, 0, 0, 0, 1, 1, 1]
    # a tie pops from b: 3 + 3 > 4 -> b to 2, then a (3 > 2) to 2
    tie = featurize([("a bb ccc", "d ee fff")], np.array([0]), Words(), max_seq_length=7)
    assert tie["input_ids"][0].tolist() == [101, 1, 2, 102, 1, 2, 102]


def test_an_unknown_task_names_the_known_ones():
    with pytest.raises(UserError, match=r"unknown GLUE task 'SST2' \(known: CoLA, SST-2, MRPC"):
        glue_data.task_of("SST2")


def test_lines_end_at_newlines_only_and_bad_bytes_name_their_line(tmp_path):
    tsv = write_tsv(tmp_path / "train.tsv", "QQP", ["1\t2\t3\tWhy is the\rsky blue?\tWhat colour is the sky?\t1"])
    pairs, labels, _ = glue_data.read_tsv(tsv, glue_data.TASKS["QQP"])
    assert pairs == [("Why is the\rsky blue?", "What colour is the sky?")] and labels.tolist() == [1]
    tsv.write_bytes(tsv.read_bytes() + b"4\t5\t6\tcaf\xe9?\tcafe?\t0\n")
    with pytest.raises(UserError, match=rf"^{tsv}:3: not UTF-8 text \(invalid continuation byte\)$"):
        glue_data.read_tsv(tsv, glue_data.TASKS["QQP"])
