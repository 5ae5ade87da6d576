"""The data half pads with the tokenizer's own padding id: a GPT-2-style byte-level BPE whose id 0 is text ("!") and
whose special tokens come after its merges encodes and packs without the packer's refusal, packed = unpacked, the
masker masks its id 0 as any other text token and never the padding, and a RoBERTa trained on it exports with its
padding id (BERT's files, whose padding is id 0, keep their bytes: tests/test_per_token_masks.py's digests)."""
import h5py
import numpy as np
import pytest

from tests.test_encode import assert_packed_equal_unpacked, corpus_text, read_all
from tests.test_roberta import ROBERTA_SPECIALS, pretrain_roberta_on
from workflow.data.encode import encode_shard
from workflow.data.masking_rule import EncodeSettings
from workflow.data.pack import PackSettings, pack_shard
from workflow.data.tokenize import load_tokenized, tokenize_shard
from workflow.data.tokenizer import Vocabulary
from workflow.train.masking import LoadTimeMasker
from workflow.train.pretraining_data import PretrainingSequences, list_shards

LENGTH = 128


def gpt2_bpe(path, text_path):
    """A GPT-2-style tokenizer.json trained on `text_path`: byte-level BPE without a prefix space whose alphabet comes
    first ("!" is id 0), RoBERTa's special tokens added after the merges (<pad> is not 0)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train([str(text_path)], trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tokenizer.add_special_tokens([*ROBERTA_SPECIALS, AddedToken("<mask>", lstrip=True, special=True)])
    tokenizer.post_processor = processors.RobertaProcessing(
        ("</s>", tokenizer.token_to_id("</s>")), ("<s>", tokenizer.token_to_id("<s>")), add_prefix_space=False)
    tokenizer.save(str(path))
    return path


@pytest.fixture(scope="module")
def gpt2_shard(tmp_path_factory):
    """(tokenizer.json, tokenized shard, Vocabulary) of test_encode's generated text (a quarter of its sentences end
    in "!")."""
    directory = tmp_path_factory.mktemp("pad_id")
    (directory / "shard_0.txt").write_text(corpus_text(200, seed=3), encoding="utf-8")
    path = gpt2_bpe(directory / "tokenizer.json", directory / "shard_0.txt")
    tokenize_shard(directory / "shard_0.txt", path, directory / "shard_0.npz")
    return path, directory / "shard_0.npz", Vocabulary.load(path)


def test_the_tokenizer_has_text_at_id_0_and_its_specials_after_the_merges(gpt2_shard):
    _, tokenized, vocab = gpt2_shard
    assert vocab.tokens[0] == "!" and vocab.pad > 0
    assert min(vocab.special_ids.values()) == vocab.size - len(ROBERTA_SPECIALS) - 1
    ids, _, _ = load_tokenized(tokenized)
    assert (ids == 0).sum() > 500  # "!" is text: a quarter of the sentences end with it


SETTINGS = [("full_sentences", "dynamic", "google"), ("nsp", "static", "google"),
            ("documents", "dynamic", "per_token"), ("full_sentences", "static", "per_token")]


@pytest.mark.parametrize("objective, masking, rule", SETTINGS)
def test_encode_and_pack_pad_with_the_tokenizers_id_and_packed_equals_unpacked(gpt2_shard, tmp_path, objective,
                                                                               masking, rule):
    path, tokenized, vocab = gpt2_shard
    settings = EncodeSettings(max_seq_length=LENGTH, max_predictions_per_seq=32, dupe_factor=2, masking=masking,
                              objective=objective, masking_rule=rule)
    encode_shard(tokenized, path, tmp_path / "u.hdf5", settings, 5, "training", 0, "none")
    # the packer's stray-token check passes (it refused id 0 inside a sequence as padding)
    encode_shard(tokenized, path, tmp_path / "p.hdf5", settings, 5, "training", 0, "none", PackSettings())
    unpacked, unpacked_attributes = read_all(tmp_path / "u.hdf5")
    packed, attributes = read_all(tmp_path / "p.hdf5")
    assert unpacked_attributes["pad_id"] == attributes["pad_id"] == vocab.pad
    specials = {vocab.cls, vocab.sep, vocab.mask, vocab.pad}
    assert_packed_equal_unpacked(packed, unpacked, specials, vocab)
    for arrays in (unpacked, packed):  # the padding cells hold the padding id, the real ones text with id 0 too
        padding = arrays["input_mask"] == 0
        assert padding.any() and (arrays["input_ids"][padding] == vocab.pad).all()
        assert (arrays["input_ids"][~padding] == 0).sum() > 100
    # the pack stage's own packing of the unpacked file is the encoder's, padding id and all
    pack_shard(tmp_path / "u.hdf5", tmp_path / "repacked.hdf5", compression="none")
    repacked, repacked_attributes = read_all(tmp_path / "repacked.hdf5")
    assert repacked_attributes["pad_id"] == vocab.pad
    for name in packed:
        np.testing.assert_array_equal(repacked[name], packed[name], err_msg=name)


def masked_rates(original: np.ndarray, real: np.ndarray, masked: list[tuple[np.ndarray, np.ndarray]],
                 vocab) -> tuple[float, float, int]:
    """(share of the text tokens with id 0 predicted, share of all text tokens predicted, id 0's count) over the
    `masked` (rows, positions) of reads of the rows `original` with real cells `real`."""
    text = real & ~np.isin(original, [vocab.cls, vocab.sep, vocab.mask, vocab.pad])
    predicted = np.zeros(original.shape, np.int64)
    for rows, positions in masked:
        np.add.at(predicted, (rows, positions), 1)
    assert not predicted[~text].any()  # never the padding, [CLS], [SEP] or [MASK]
    zero = text & (original == 0)
    return predicted[zero].sum() / (zero.sum() * len(masked)), predicted[text].sum() / (text.sum() * len(masked)), \
        int(zero.sum())


@pytest.mark.parametrize("masking", ["dynamic", "static"])
def test_text_at_id_0_is_masked_at_the_rate_of_other_text_and_the_padding_never(gpt2_shard, tmp_path, masking):
    path, tokenized, vocab = gpt2_shard
    settings = EncodeSettings(max_seq_length=LENGTH, max_predictions_per_seq=20, dupe_factor=1 if masking == "dynamic"
                              else 4, masking=masking, objective="full_sentences")
    encode_shard(tokenized, path, tmp_path / "p.hdf5", settings, 5, "training", 0, "none", PackSettings())
    packed, _ = read_all(tmp_path / "p.hdf5")
    real = packed["input_mask"] > 0
    if masking == "dynamic":
        masker = LoadTimeMasker.of_shard(str(tmp_path / "p.hdf5"), 7)
        assert masker.vocab.pad == vocab.pad
        original, masked = packed["input_ids"], []
        for epoch in range(4):
            out = masker(packed, epoch, 0, np.arange(len(original)))
            rows, columns = np.nonzero(out["masked_lm_positions"] > 0)
            masked.append((rows, out["masked_lm_positions"][rows, columns]))
    else:  # static: each row's masks in the file, its tokens restored from masked_lm_ids
        original = packed["input_ids"].copy()
        rows, columns = np.nonzero(packed["masked_lm_positions"] > 0)
        original[rows, packed["masked_lm_positions"][rows, columns]] = packed["masked_lm_ids"][rows, columns]
        masked = [(rows, packed["masked_lm_positions"][rows, columns])]
    zero_rate, text_rate, n_zero = masked_rates(original, real, masked, vocab)
    sd = np.sqrt(text_rate * (1 - text_rate) / (n_zero * len(masked)))
    assert n_zero > 300 and 0.1 < text_rate < 0.2
    assert abs(zero_rate - text_rate) < 4 * sd, (zero_rate, text_rate, sd)


def test_the_trainers_batches_pad_with_the_shards_padding_id(gpt2_shard, tmp_path):
    from workflow.data.hdf5_dir import build_hdf5_dir

    path, tokenized, vocab = gpt2_shard
    settings = EncodeSettings(max_seq_length=LENGTH, max_predictions_per_seq=20, dupe_factor=1, masking="dynamic",
                              objective="full_sentences")
    for split in ("training", "test"):
        (tmp_path / "encoded" / split).mkdir(parents=True)
        encode_shard(tokenized, path, tmp_path / "encoded" / split / "shard_0.hdf5", settings, 1, split, 0, "none",
                     PackSettings())
    build_hdf5_dir(tmp_path / "encoded", {"training": 1, "test": 1}, tmp_path / "hdf5")
    shards = list_shards(tmp_path / "hdf5", "training")
    assert shards[0].pad_id == vocab.pad
    sequences = PretrainingSequences(shards, seed=1)
    # a step that starts inside a row: the row's earlier sequences are not live, their tokens become padding
    batches = sequences.micro_batches(1, 7, 0, 1, rows=8)
    for batch in batches:
        padding = batch["attention_mask"] == 0
        assert padding.any() and (batch["input_ids"][padding] == vocab.pad).all()
        assert (batch["input_ids"][~padding] == 0).any()  # "!" stays text
    # shards of two padding ids are not one data directory
    other = tmp_path / "hdf5" / "training" / "zz_other.hdf5"
    other.write_bytes((tmp_path / "hdf5" / "training").glob("*.hdf5").__next__().read_bytes())
    with h5py.File(other, "a") as handle:
        handle.attrs["pad_id"] = vocab.pad - 1
    from workflow.cli import UserError

    with pytest.raises(UserError, match=rf"zz_other.hdf5: padding id {vocab.pad - 1}, but .* has {vocab.pad}; one "
                                        r"data directory holds one vocab$"):
        list_shards(tmp_path / "hdf5", "training")


def test_a_roberta_pretrained_on_it_exports_its_padding_id_and_loads_in_hfs_auto_class(gpt2_shard, tmp_path):
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    path, _, vocab = gpt2_shard
    summary, export = pretrain_roberta_on(path, "roberta", tmp_path, corpus_text(60, seed=4))
    assert (summary["family"], summary["steps"], summary["model"]["pad_token_id"]) == ("roberta", 4, vocab.pad)
    hf = AutoModelForMaskedLM.from_pretrained(export)
    assert type(hf).__name__ == "RobertaForMaskedLM"
    assert hf.config.pad_token_id == vocab.pad and hf.roberta.embeddings.word_embeddings.padding_idx == vocab.pad
    tokenizer = AutoTokenizer.from_pretrained(export)
    assert tokenizer.pad_token_id == vocab.pad and tokenizer.convert_ids_to_tokens(0) == "!"


@pytest.mark.parametrize("name, preset", [("bert", "tiny"), ("modernbert", "modernbert-tiny"),
                                          ("roberta", "roberta-tiny")])
def test_every_familys_preset_takes_the_vocabs_padding_id(gpt2_shard, name, preset):
    """The embeddings' padding_idx (a row with no gradient) is the padding's, not the row of "!"."""
    from workflow.train.models.family import ModelSettings, family

    path, _, vocab = gpt2_shard
    config, model = family(name).build(ModelSettings.from_config({"family": name, "preset": preset}), str(path),
                                       vocab.size, LENGTH)
    assert config.pad_token_id == vocab.pad
    embeddings = [module for module in model.modules() if type(module).__name__ == "Embedding"
                  and module.num_embeddings == config.vocab_size]
    assert [module.padding_idx for module in embeddings] == [vocab.pad]
