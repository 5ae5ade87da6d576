"""Hugging Face directories as users bring them: a bare encoder (BertModel, RobertaModel, XLMRobertaModel,
ModernBertModel: sentence encoders, domain checkpoints), weights in shards, or a pickled pytorch_model.bin. Every
family starts pretraining and fine-tuning from each with the directory's own tensors; weights that lack the encoder
are refused rather than trained from random."""
import json

import pytest
import safetensors.torch
import torch
import transformers

from workflow.cli import UserError
from workflow.squad.finetune import load_qa_model
from workflow.train.models.family import ModelSettings, family
from workflow.train.models.hf_weights import read_weights

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
# model_type -> (our family, HF's bare encoder, its config, the encoder's name in the pretraining model)
KINDS = {
    "bert": ("bert", "BertModel", lambda: transformers.BertConfig(vocab_size=99, max_position_embeddings=64, **SMALL),
             "bert."),
    "roberta": ("roberta", "RobertaModel", lambda: transformers.RobertaConfig(
        vocab_size=99, max_position_embeddings=66, pad_token_id=1, bos_token_id=0, eos_token_id=2, **SMALL),
        "roberta."),
    "xlm-roberta": ("roberta", "XLMRobertaModel", lambda: transformers.XLMRobertaConfig(
        vocab_size=99, max_position_embeddings=66, pad_token_id=1, bos_token_id=0, eos_token_id=2, **SMALL),
        "roberta."),
    "modernbert": ("modernbert", "ModernBertModel", lambda: transformers.ModernBertConfig(
        vocab_size=104, max_position_embeddings=64, pad_token_id=0, cls_token_id=1, bos_token_id=1, sep_token_id=2,
        eos_token_id=2, global_attn_every_n_layers=2, local_attention=16, **SMALL), "model."),
}


def bare_encoder(model_type: str):
    torch.manual_seed(0)
    _, class_name, config, _ = KINDS[model_type]
    return getattr(transformers, class_name)(config()).eval()


def save(model, directory, layout: str):
    """`model` as HF's save_pretrained writes it (one file, or shards of ~20 KB), or as older transformers did:
    a pickled state dict in pytorch_model.bin."""
    if layout == "pytorch_model.bin":
        directory.mkdir(parents=True)
        model.config.to_json_file(directory / "config.json")
        torch.save(model.state_dict(), directory / "pytorch_model.bin")
    else:
        model.save_pretrained(directory, **({"max_shard_size": "20KB"} if layout == "shards" else {}))
    return directory


def pretraining_model(model_type: str, directory):
    name = KINDS[model_type][0]
    settings = ModelSettings.from_config({"family": name, "init_from": str(directory)})
    vocab_size = KINDS[model_type][2]().vocab_size
    return family(name).build(settings, None, vocab_size, 32)[1]


def assert_holds_encoder(ours: dict, hf, prefix: str):
    theirs = {k: v for k, v in hf.state_dict().items() if not k.startswith("pooler.") and "position_ids" not in k}
    assert theirs and all(torch.equal(ours[prefix + key], value) for key, value in theirs.items())


@pytest.mark.parametrize("layout", ["model.safetensors", "shards", "pytorch_model.bin"])
@pytest.mark.parametrize("model_type", list(KINDS))
def test_pretraining_continues_a_bare_encoder_in_any_layout(model_type, layout, tmp_path, caplog):
    hf = bare_encoder(model_type)
    directory = save(hf, tmp_path / "hf", layout)
    assert (layout == "shards") == (directory / "model.safetensors.index.json").is_file()
    with caplog.at_level("WARNING", logger="family"):
        model = pretraining_model(model_type, directory)
    assert_holds_encoder(model.state_dict(), hf, KINDS[model_type][3])
    assert "kept freshly initialised" in caplog.text  # the masked-LM head, which a bare encoder lacks


@pytest.mark.parametrize("model_type", list(KINDS))
def test_fine_tuning_starts_from_a_bare_encoder_in_shards(model_type, tmp_path):
    hf = bare_encoder(model_type)
    model, _ = load_qa_model(save(hf, tmp_path / "hf", "shards"))
    assert_holds_encoder(model.state_dict(), hf, KINDS[model_type][3])


@pytest.mark.parametrize("model_type", ["roberta", "modernbert"])
def test_weights_without_the_encoder_are_refused_not_trained_from_random(model_type, tmp_path):
    hf = bare_encoder(model_type)
    directory = save(hf, tmp_path / "hf", "model.safetensors")
    state = {f"encoder_v2.{k}": v for k, v in hf.state_dict().items()}  # another model's names
    (directory / "model.safetensors").unlink()
    torch.save(state, directory / "pytorch_model.bin")
    with pytest.raises(UserError, match=rf"model.init_from {directory}: its weights lack \d+ of the encoder's "
                                        r"tensors, e\.g\. .*start from a directory of the whole model"):
        pretraining_model(model_type, directory)


def test_a_directory_without_weights_or_with_a_shard_missing_is_refused_naming_it(tmp_path):
    save(bare_encoder("bert"), tmp_path / "hf", "shards")
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (tmp_path / "hf" / shard).unlink()
    with pytest.raises(UserError, match=f"here: model.safetensors.index.json names the shard {shard}, which is not"):
        read_weights(tmp_path / "hf", "here", "bert")
    with pytest.raises(UserError, match=r"here: no weights \(model.safetensors, model.safetensors.index.json, "
                                        r"pytorch_model.bin, pytorch_model.bin.index.json\)"):
        read_weights(tmp_path, "here", "bert")


class Payload:
    """What a pickle may carry besides tensors: code that runs when it is loaded."""

    def __reduce__(self):
        return (print, ("this ran",))


def test_a_pytorch_model_bin_is_read_without_running_its_code(tmp_path, capsys):
    torch.save({"weight": torch.ones(2), "payload": Payload()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(UserError, match="here: pytorch_model.bin pickles more than tensors, and a pickle's code is "
                                        "never run here: save its state dict as model.safetensors"):
        read_weights(tmp_path, "here", "bert")
    assert "this ran" not in capsys.readouterr().out
    for name in ("pytorch_model.bin", "model.safetensors"):  # a download cut short
        (tmp_path / "pytorch_model.bin").unlink()
        save_weights = safetensors.torch.save_file if name == "model.safetensors" else torch.save
        save_weights({"weight": torch.ones(1000)}, tmp_path / name)
        whole = (tmp_path / name).read_bytes()
        (tmp_path / name).write_bytes(whole[:len(whole) // 2])
        with pytest.raises(UserError, match=f"here: cannot read {name}: .+"):
            read_weights(tmp_path, "here", "bert")
