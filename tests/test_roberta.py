"""The RoBERTa family (RoBERTa and XLM-R): Hugging Face parity (both model types, eager and sdpa, padding, gradients),
positions offset past the padding index, packed rows = each sequence alone on both attention paths, HF loading our
export and our loading HF's own save."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.test_model import (NESTED_WARNING, as_batch, encoded_instances, packed_attention,  # noqa: F401 (a fixture)
                              randomise, run_batch)
from workflow.cli import UserError
from workflow.data.pack import pack_arrays
from workflow.train.models.roberta import (RobertaConfig, RobertaForMaskedLM, load_pretrained, roberta_position_ids,
                                           save_pretrained)

transformers = pytest.importorskip("transformers")

HF_CLASSES = {"roberta": ("RobertaConfig", "RobertaForMaskedLM"),
              "xlm-roberta": ("XLMRobertaConfig", "XLMRobertaForMaskedLM")}
PAD = 1


def small_config(model_type="roberta", **overrides) -> RobertaConfig:
    return RobertaConfig(**{**dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                   intermediate_size=64, max_position_embeddings=40, model_type=model_type),
                            **overrides})


def hf_model(config: RobertaConfig, implementation: str = "sdpa"):
    config_class, model_class = (getattr(transformers, name) for name in HF_CLASSES[config.model_type])
    fields = {k: v for k, v in config.to_dict().items() if k != "model_type"}
    return model_class(config_class(**fields, attn_implementation=implementation)).eval()


def ours_and_hf(config: RobertaConfig, implementation: str = "sdpa"):
    torch.manual_seed(0)
    ours = randomise(RobertaForMaskedLM(config)).eval()
    hf = hf_model(config, implementation)
    hf.load_state_dict(with_tied_aliases(ours.state_dict()), strict=True)
    return ours, hf


def with_tied_aliases(state: dict) -> dict:
    return {**state, "lm_head.decoder.weight": state["roberta.embeddings.word_embeddings.weight"],
            "lm_head.decoder.bias": state["lm_head.bias"]}


def padded_batch(length: int = 17, seed: int = 1):
    """Rows of HF's kind: the padding id at the padded places, the mask 0 there."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, 64, (3, length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, length * 2 // 3:] = 0
    attention_mask[2, length // 3:] = 0
    return input_ids.masked_fill(attention_mask == 0, PAD), attention_mask


# ---------------------------------------------------------------- Hugging Face parity


@pytest.mark.parametrize("model_type", ["roberta", "xlm-roberta"])
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_logits_equal_hfs_roberta_and_xlm_roberta_at_every_real_token(model_type, implementation):
    ours, hf = ours_and_hf(small_config(model_type), implementation)
    inputs = dict(zip(("input_ids", "attention_mask"), padded_batch()))
    real = inputs["attention_mask"].bool()
    with torch.no_grad():
        logits, nsp_logits = ours(**inputs)
        assert nsp_logits is None and (logits[real] - hf(**inputs).logits[real]).abs().max() < 1e-5


def test_gradients_equal_hfs():
    ours, hf = ours_and_hf(small_config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    input_ids, attention_mask = padded_batch()
    real = attention_mask.bool()
    ours(input_ids, None, attention_mask)[0][real].logsumexp(-1).sum().backward()
    hf(input_ids=input_ids, attention_mask=attention_mask).logits[real].logsumexp(-1).sum().backward()
    hf_parameters = dict(hf.named_parameters())
    for name, parameter in ours.named_parameters():
        assert torch.allclose(parameter.grad, hf_parameters[name].grad, atol=1e-5, rtol=1e-4), name


def test_positions_start_past_the_padding_index_as_hfs_do():
    input_ids, attention_mask = padded_batch(length=6)
    from transformers.models.roberta.modeling_roberta import RobertaEmbeddings

    expected = RobertaEmbeddings.create_position_ids_from_input_ids(input_ids, PAD)
    assert torch.equal(roberta_position_ids(input_ids, None, None, PAD), expected)
    # the data half pads with id 0 (<s> here): the mask, not the id, says what is padding
    assert torch.equal(roberta_position_ids(input_ids.masked_fill(attention_mask == 0, 0), attention_mask, None, PAD),
                       expected)
    assert roberta_position_ids(input_ids, None, None, PAD)[0].tolist() == [2, 3, 4, 5, 6, 7]


def test_token_type_ids_are_ignored_and_the_padding_position_row_stays_zero():
    config = small_config()
    model = RobertaForMaskedLM(config).eval()
    input_ids, attention_mask = padded_batch()
    with torch.no_grad():
        assert torch.equal(model(input_ids, torch.ones_like(input_ids), attention_mask)[0],
                           model(input_ids, None, attention_mask)[0])
    assert not model.roberta.embeddings.position_embeddings.weight[PAD].any()
    model(input_ids, None, attention_mask)[0].sum().backward()
    assert not model.roberta.embeddings.position_embeddings.weight.grad[PAD].any()


def test_the_head_runs_at_the_prediction_slots_as_at_every_position():
    model = randomise(RobertaForMaskedLM(small_config())).eval()
    input_ids, attention_mask = padded_batch()
    positions = torch.tensor([[1, 3, 0], [2, 5, 0], [1, 0, 0]])
    valid = positions > 0
    with torch.no_grad():
        every = model(input_ids, None, attention_mask)[0]
        at_slots = model(input_ids, None, attention_mask, positions)[0]
        at_valid = model(input_ids, None, attention_mask, positions, masked_lm_valid=valid)[0]
    expected = torch.gather(every, 1, positions.unsqueeze(-1).expand(-1, -1, every.shape[-1]))
    assert torch.allclose(at_slots, expected, atol=1e-6) and torch.allclose(at_valid, expected[valid], atol=1e-6)


# ---------------------------------------------------------------- packed rows


def packed_prediction_order(packed: dict) -> list[int]:
    """The real prediction slots of packed rows (row-major) ordered as the same instances' slots unpacked: by
    (instance, position in it)."""
    keys = []
    for row, positions in enumerate(packed["masked_lm_positions"]):
        starts, lengths = packed["cls_positions"][row], packed["sequence_lengths"][row]
        for position in positions[positions > 0]:
            slot = np.flatnonzero((starts <= position) & (position < starts + lengths) & (lengths > 0))[0]
            keys.append((packed["instance_index"][row, slot], position - starts[slot]))
    return sorted(range(len(keys)), key=keys.__getitem__)


@pytest.mark.filterwarnings(NESTED_WARNING)
def test_packed_rows_give_each_prediction_the_logits_of_its_sequence_alone(packed_attention):
    torch.manual_seed(0)
    model = randomise(RobertaForMaskedLM(small_config())).eval()
    arrays = encoded_instances()
    packed = pack_arrays(arrays, max_sequences_per_pack=3, masked_lm_prob=1.0)
    logits = []
    with torch.no_grad():
        for batch in (as_batch(packed), as_batch(arrays)):
            inputs = {k: v for k, v in batch.items() if k not in ("masked_lm_labels", "next_sentence_labels")}
            logits.append(model(**inputs, masked_lm_valid=batch["masked_lm_labels"] >= 0)[0])
        loss = run_batch(model, as_batch(packed))[2]
    assert torch.allclose(logits[0][packed_prediction_order(packed)], logits[1], atol=1e-5, rtol=0)
    assert loss["nsp_count"] == 0


# ---------------------------------------------------------------- Hugging Face directories


@pytest.mark.parametrize("model_type", ["roberta", "xlm-roberta"])
def test_hf_loads_our_export_with_its_own_class_and_gives_our_logits(model_type, tmp_path):
    ours, _ = ours_and_hf(small_config(model_type))
    save_pretrained(ours, ours.config, None, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == model_type
    model_class = getattr(transformers, HF_CLASSES[model_type][1])
    assert written["architectures"] == [model_class.__name__]
    loaded = model_class.from_pretrained(tmp_path).eval()
    auto = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path).eval()
    assert type(auto) is model_class
    input_ids, attention_mask = padded_batch()
    real = attention_mask.bool()
    with torch.no_grad():
        expected = ours(input_ids, None, attention_mask)[0]
        for model in (loaded, auto):
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
            assert (logits - expected)[real].abs().max() < 1e-5


@pytest.mark.parametrize("model_type", ["roberta", "xlm-roberta"])
def test_we_load_hfs_own_save_keeping_its_model_type(model_type, tmp_path):
    hf = hf_model(small_config(model_type))
    hf.save_pretrained(tmp_path)
    config, state = load_pretrained(tmp_path)
    assert config.model_type == model_type and config == small_config(model_type)
    ours = RobertaForMaskedLM(config).eval()
    ours.load_state_dict(state, strict=True)
    input_ids, attention_mask = padded_batch()
    with torch.no_grad():
        difference = ours(input_ids, None, attention_mask)[0] - hf(input_ids=input_ids,
                                                                   attention_mask=attention_mask).logits
    assert difference[attention_mask.bool()].abs().max() < 1e-5


def test_a_directory_of_another_model_type_is_refused_in_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(UserError, match="a 'bert' model, not a RoBERTa or XLM-R one"):
        load_pretrained(tmp_path)


def test_presets_have_the_published_sizes_and_positions():
    base, large = RobertaConfig.preset("roberta-base"), RobertaConfig.preset("roberta-large")
    assert (base.hidden_size, base.num_hidden_layers, base.max_position_embeddings, base.positions) == (768, 12, 514,
                                                                                                        512)
    assert (large.hidden_size, large.num_hidden_layers, large.intermediate_size) == (1024, 24, 4096)
    parameters = sum(p.numel() for p in RobertaForMaskedLM(RobertaConfig.preset("roberta-tiny")).parameters())
    assert parameters < 10_000_000


# ---------------------------------------------------------------- tokenizers: special tokens by role

TEXT = ("The river flows north through the valley. Its water feeds the old mill, which ground wheat for the town. "
        "In winter the river freezes and the children skate on it. ") * 40
ROBERTA_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]  # ids 0-3, as RoBERTa's and XLM-R's; <mask> the last


def roberta_bpe(path):
    """A tiny RoBERTa-style tokenizer.json: byte-level BPE without a prefix space, <s> 0, <pad> 1, its processor."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(TEXT.split(". "), trainers.BpeTrainer(
        vocab_size=300, special_tokens=ROBERTA_SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tokenizer.add_special_tokens([AddedToken("<mask>", lstrip=True, special=True)])
    tokenizer.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0), add_prefix_space=False)
    tokenizer.save(str(path))
    return path


def xlmr_unigram(path):
    """A tiny XLM-R-style tokenizer.json: a SentencePiece Unigram (Metaspace "▁"), <s> 0, <pad> 1, <mask> last."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.Unigram())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.train_from_iterator(TEXT.split(". "), trainers.UnigramTrainer(
        vocab_size=120, special_tokens=ROBERTA_SPECIALS, unk_token="<unk>", show_progress=False))
    tokenizer.add_special_tokens([AddedToken("<mask>", lstrip=True, special=True)])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)])
    tokenizer.save(str(path))
    return path


def xlmr_converted(path):
    """An XLM-R tokenizer.json as the published ones are made: a SentencePiece Unigram model (its defaults, as XLM-R's:
    <unk> 0, <s> 1, </s> 2) converted by transformers' XLMRobertaTokenizer, with fairseq's ids (<s> 0, <pad> 1,
    </s> 2, <unk> 3, the pieces one up), its Precompiled normaliser and WhitespaceSplit + Metaspace pre-tokeniser."""
    import io

    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(SAMPLE_XML.read_text(encoding="utf-8").split("\n")),
                                             model_writer=model, vocab_size=1000, minloglevel=2)
    (path.parent / "sentencepiece.bpe.model").write_bytes(model.getvalue())
    transformers.XLMRobertaTokenizer.from_pretrained(path.parent).backend_tokenizer.save(str(path))
    return path


SAMPLE_XML = Path(__file__).parents[1] / "sample" / "enwiki-sample-pages-articles.xml"
# accents, digits, a dash, CJK, spaces in a row: what the Precompiled (NFKC) normaliser and the pre-tokeniser touch
SAMPLE_LINES = "Café №5 — the ﬁrst ２０２４ Ｔｏｋｙｏ:   東京  was   built in 1890 (Naïve façade)."
TOKENIZERS = {"roberta": ("roberta", roberta_bpe), "xlm-roberta": ("xlm-roberta", xlmr_unigram),
              "xlm-roberta-converted": ("xlm-roberta", xlmr_converted)}


@pytest.fixture(scope="module", params=list(TOKENIZERS))
def tokenizer_json(request, tmp_path_factory):
    model_type, make = TOKENIZERS[request.param]
    if make is xlmr_converted:
        pytest.importorskip("sentencepiece")
    return model_type, make(tmp_path_factory.mktemp(request.param) / "tokenizer.json")


def test_text_tokenizes_as_transformers_own_xlm_roberta_tokenizer_on_wikipedia_text(tmp_path):
    """The oracle: HF's XLMRobertaTokenizer, from the SentencePiece model the tokenizer.json was converted from."""
    from workflow.data.tokenizer import Vocabulary

    pytest.importorskip("sentencepiece")
    path = xlmr_converted(tmp_path / "tokenizer.json")
    hf = transformers.XLMRobertaTokenizer.from_pretrained(tmp_path)
    ours = Vocabulary.load(path, "bpe").text_tokenizer()
    lines = [line for line in SAMPLE_XML.read_text(encoding="utf-8").split("\n") if line.strip()] + [SAMPLE_LINES]
    assert [ours.encode(line).ids for line in lines] == [hf(line, add_special_tokens=False)["input_ids"]
                                                         for line in lines]
    assert sum(map(len, lines)) > 100_000


def test_special_tokens_are_found_by_role_in_roberta_and_xlm_r_tokenizers(tokenizer_json):
    from workflow.data.tokenizer import Vocabulary

    model_type, path = tokenizer_json
    vocab = Vocabulary.load(path, "bpe")
    assert vocab.special_tokens == {"pad": "<pad>", "unk": "<unk>", "cls": "<s>", "sep": "</s>", "mask": "<mask>"}
    assert (vocab.cls, vocab.pad, vocab.sep, vocab.unk, vocab.mask) == (0, 1, 2, 3, vocab.size - 1)
    mark = "\u0120" if model_type == "roberta" else "\u2581"
    continues = vocab.continues_word
    for index, token in enumerate(vocab.tokens):
        assert continues[index] == (index not in vocab.added and not token.startswith(mark)), token
    assert continues.any() and not continues.all()


def test_a_tokenizer_json_lacking_a_role_is_refused_naming_both_spellings(tmp_path):
    from tokenizers import Tokenizer

    from workflow.data.tokenizer import Vocabulary

    data = json.loads(roberta_bpe(tmp_path / "tokenizer.json").read_text())
    data["added_tokens"] = [token for token in data["added_tokens"] if token["content"] != "<mask>"]
    Tokenizer.from_str(json.dumps(data))  # still a tokenizer
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(UserError, match=r"tokenizer lacks the special token\(s\) \[MASK\] or <mask>"):
        Vocabulary.load(tmp_path / "tokenizer.json")


def test_the_tokenize_stage_gives_the_files_own_ids(tokenizer_json, tmp_path):
    from tokenizers import Tokenizer

    from workflow.data.tokenize import load_tokenized, tokenize_shard

    model_type, path = tokenizer_json
    documents = [["The river flows north.", "Its water feeds the old mill."], ["In winter the river freezes."]]
    (tmp_path / "shard.txt").write_text("\n\n".join("\n".join(lines) for lines in documents) + "\n")
    tokenize_shard(tmp_path / "shard.txt", path, tmp_path / "shard.npz")
    ids, sentence_offsets, _ = load_tokenized(tmp_path / "shard.npz")
    tokenizer = Tokenizer.from_file(str(path))
    # RoBERTa's BPE: a document's later sentences with the space they have inside it; XLM-R's "▁" marks each alike
    expected = [tokenizer.encode(line if i == 0 else " " + line, add_special_tokens=False).ids
                for lines in documents for i, line in enumerate(lines)]
    assert [ids[start:end].tolist() for start, end in zip(sentence_offsets[:-1], sentence_offsets[1:])] == expected


# ---------------------------------------------------------------- the family: presets, continuing, exports


def roberta_settings(**model):
    from workflow.train.models.family import ModelSettings

    return ModelSettings.from_config({"family": "roberta", "preset": "roberta-tiny", **model})


def test_a_preset_takes_the_vocabs_size_and_special_ids_and_sizes_positions_past_its_padding(tokenizer_json):
    from workflow.data.tokenizer import Vocabulary
    from workflow.train.models.family import family

    _, path = tokenizer_json
    vocab = Vocabulary.load(path)
    config, model = family("roberta").build(roberta_settings(), str(path), vocab.size, 128)
    assert (config.pad_token_id, config.bos_token_id, config.eos_token_id) == (1, 0, 2)
    assert (config.vocab_size, config.max_position_embeddings, config.positions) == ((vocab.size + 7) // 8 * 8, 514,
                                                                                    512)
    with pytest.raises(UserError, match=r"max_position_embeddings 40 \(38 past the padding index\) < sequence length"):
        family("roberta").build(roberta_settings(architecture={"max_position_embeddings": 40}), str(path), vocab.size,
                                39)


def test_the_export_loads_as_hfs_class_and_fills_masks_with_its_tokenizer(tokenizer_json, tmp_path):
    from transformers import AutoTokenizer, pipeline

    from workflow.data.tokenizer import Vocabulary
    from workflow.train.models.family import family

    model_type, path = tokenizer_json
    vocab = Vocabulary.load(path)
    roberta = family("roberta")
    torch.manual_seed(0)
    config, model = roberta.build(roberta_settings(architecture={"model_type": model_type}), str(path), vocab.size, 64)
    roberta.export(model, config, str(path), tmp_path / "model", None, False, "tanh")
    written = json.loads((tmp_path / "model" / "config.json").read_text())
    assert (written["model_type"], written["architectures"]) == (model_type, [HF_CLASSES[model_type][1]])
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")
    assert (tokenizer.mask_token, tokenizer.pad_token_id, tokenizer.model_max_length) == ("<mask>", 1, 512)
    encoded = tokenizer(["The river flows north.", "The mill."], padding=True, return_tensors="pt")
    assert encoded["input_ids"][0, 0] == 0 and "token_type_ids" not in encoded
    hf = getattr(transformers, HF_CLASSES[model_type][1]).from_pretrained(tmp_path / "model").eval()
    with torch.no_grad():
        ours = model.eval()(encoded["input_ids"], None, encoded["attention_mask"])[0]
        theirs = hf(**encoded).logits
    real = encoded["attention_mask"].bool()
    assert (ours - theirs)[real].abs().max() < 1e-5
    fill = pipeline("fill-mask", model=str(tmp_path / "model"), device="cpu")
    assert len(fill("The river <mask> north.", top_k=3)) == 3


def test_continuing_an_hf_directory_loads_every_weight_and_keeps_its_model_type(tokenizer_json, tmp_path):
    from workflow.data.tokenizer import Vocabulary, save_tokenizer
    from workflow.train.models.family import family

    model_type, path = tokenizer_json
    vocab = Vocabulary.load(path)
    hf = hf_model(small_config(model_type, vocab_size=vocab.size, max_position_embeddings=130))
    hf.save_pretrained(tmp_path / "hf")
    save_tokenizer(path, tmp_path / "hf")
    roberta = family("roberta")
    config, model = roberta.build(roberta_settings(preset=None, init_from=str(tmp_path / "hf")), str(path),
                                  vocab.size, 128)
    input_ids = torch.randint(5, vocab.size - 1, (2, 30))
    with torch.no_grad():
        expected = hf(input_ids=input_ids).logits
        assert (model.eval()(input_ids, None, torch.ones_like(input_ids))[0] - expected).abs().max() < 1e-5
    roberta.export(model, config, str(path), tmp_path / "out", None, False, "tanh")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == model_type
    other = tmp_path / "other.json"
    xlmr_unigram(other) if model_type == "roberta" else roberta_bpe(other)
    with pytest.raises(UserError, match="tokenize the data with it"):
        roberta.build(roberta_settings(preset=None, init_from=str(tmp_path / "hf")), str(other), vocab.size, 128)


def pretrain_roberta_on(path, model_type: str, tmp_path, text: str) -> tuple[dict, object]:
    """(summary, export directory) of a tiny RoBERTa-family pretraining run on shard-format `text` tokenized with the
    tokenizer.json `path`: the data half and the engine as the DAG runs them (tokenize, encode full sentences with
    dynamic masks and packing, the trainer's directory, pretrain, export)."""
    from workflow.data.encode import encode_shard
    from workflow.data.hdf5_dir import build_hdf5_dir
    from workflow.data.masking_rule import EncodeSettings
    from workflow.data.pack import PackSettings
    from workflow.data.tokenize import tokenize_shard
    from tests.test_pretrain import settings as train_settings
    from workflow.train.pretrain import pretrain

    (tmp_path / "text.txt").write_text(text)
    tokenize_shard(tmp_path / "text.txt", path, tmp_path / "text.npz")
    settings = EncodeSettings(max_seq_length=64, max_predictions_per_seq=10, dupe_factor=1, masking="dynamic",
                              objective="full_sentences")
    for split in ("training", "test"):
        (tmp_path / "encoded" / split).mkdir(parents=True)
        encode_shard(tmp_path / "text.npz", path, tmp_path / "encoded" / split / "shard_0.hdf5", settings, 1, split, 0,
                     None, PackSettings())
    build_hdf5_dir(tmp_path / "encoded", {"training": 1, "test": 1}, tmp_path / "hdf5")
    out = tmp_path / "out"
    summary = pretrain(train_settings(
        tmp_path, out, vocab=str(path), learning_rate=1e-3, warmup_proportion=0.1, total_steps=4,
        global_batch_size=8, micro_batch_size=4, family="roberta", preset="roberta-tiny", bert_config=None,
        architecture={"model_type": model_type, "hidden_size": 32, "intermediate_size": 64}, optimizer="adamw",
        log_every=2, checkpoint_every=4, seed=12345, eval_max_sequences=32))
    return summary, out / "model"


def test_pretraining_runs_on_data_tokenized_and_encoded_with_the_models_own_tokenizer(tokenizer_json, tmp_path):
    """On RoBERTa's and XLM-R's own kind of tokenizer.json."""
    model_type, path = tokenizer_json
    summary, export = pretrain_roberta_on(path, model_type, tmp_path,
                                          "\n\n".join(TEXT.replace(". ", ".\n") for _ in range(4)))
    assert (summary["family"], summary["steps"], summary["model"]["model_type"]) == ("roberta", 4, model_type)
    # no NSP head: no NSP figure, and every held-out sequence counted
    assert "test_nsp_accuracy" not in summary and summary["test_sequences"] == int(summary["test_set"].split()[0]) > 0
    hf = getattr(transformers, HF_CLASSES[model_type][1]).from_pretrained(export)
    assert hf.config.pad_token_id == 1


# ---------------------------------------------------------------- the real DAG

DAG_OVERLAY = {
    "vocab": {"type": "bpe", "size": 1000}, "encode": {"objective": "full_sentences"},
    "model": {"family": "roberta", "preset": "roberta-tiny"}, "squad": {"enabled": False}, "glue": {"tasks": []},
    "pretrain": {"optimizer": "adamw", "eval_max_sequences": 200, "eval_every": 0, "checkpoint_every": 4,
                 "phase1": {"learning_rate": 2.0e-3, "total_steps": 6, "global_batch_size": 16, "micro_batch_size": 8},
                 "phase2": {"learning_rate": 1.0e-3, "total_steps": 3, "global_batch_size": 8, "micro_batch_size": 4}},
}


@pytest.fixture(scope="module")
def dag_run(tmp_path_factory):
    import subprocess
    import sys

    from tests.conftest import copy_workflow, snakemake_env

    root = copy_workflow(tmp_path_factory.mktemp("roberta_dag"))
    (root / "roberta.yaml").write_text(json.dumps(DAG_OVERLAY))
    result = subprocess.run([sys.executable, "-m", "snakemake", "pretrain", "--profile", "profiles/local",
                             "--configfile", "sample/config.yaml", "roberta.yaml"], cwd=root, text=True,
                            capture_output=True, env=snakemake_env(), timeout=1500)
    assert result.returncode == 0, result.stderr[-4000:]
    return root


def test_both_phases_train_roberta_through_the_dag_and_phase_2_continues_phase_1s_export(dag_run):
    summaries = [json.loads((dag_run / f"results/pretrain/{phase}/summary.json").read_text())
                 for phase in ("phase1", "phase2")]
    assert [(s["family"], s["seq_length"], s["steps"], s["objective"], s["packed"]) for s in summaries] == [
        ("roberta", 128, 6, "full_sentences", True), ("roberta", 512, 3, "full_sentences", True)]
    # the trained BPE's [PAD] is id 0: 512 positions past it
    assert [(s["model"]["pad_token_id"], s["model"]["max_position_embeddings"]) for s in summaries] == [(0, 513)] * 2


def test_the_dags_export_is_hfs_roberta_and_fills_masks_as_ours_does(dag_run):
    from transformers import AutoModelForMaskedLM, AutoTokenizer, pipeline

    from workflow.train.models.family import ModelSettings, family

    export = dag_run / "results/pretrain/phase2/model"
    hf = AutoModelForMaskedLM.from_pretrained(export).eval()
    assert type(hf) is transformers.RobertaForMaskedLM
    tokenizer = AutoTokenizer.from_pretrained(export)
    settings = ModelSettings.from_config({"family": "roberta", "init_from": str(export)})
    _, ours = family("roberta").build(settings, str(export / "tokenizer.json"), len(tokenizer), 512)
    text = "The town lies on the [MASK]."
    encoded = tokenizer(text, return_tensors="pt")
    with torch.no_grad():
        mine = ours.eval()(encoded["input_ids"], None, encoded["attention_mask"])[0]
        assert (hf(**encoded).logits - mine).abs().max() < 1e-4
    best = pipeline("fill-mask", model=str(export), device="cpu")(text, top_k=1)[0]["token"]
    slot = int((encoded["input_ids"][0] == tokenizer.mask_token_id).nonzero())
    assert best == int(mine[0, slot].argmax())
