"""NVIDIA DeepLearningExamples (DLE) BERT checkpoints in and out: its `ckpt_*.pt` files hold {'model': state dict of
DLE's modeling.BertForPreTraining, ...}; DLE's run_squad.py and run_glue.py start from one with
`model.load_state_dict(torch.load(ckpt, map_location='cpu')["model"], strict=False)`, after padding the
bert_config.json's vocab_size up to a multiple of 8.

Parameter names (DLE PyTorch/LanguageModeling/BERT/modeling.py) equal ours (Hugging Face's) except:
    - the fused Linear+activation layers are `dense_act` (LinearActivation): `bert.encoder.layer.N.intermediate`,
      `bert.pooler` and `cls.predictions.transform` (ours: `dense`);
    - `cls.predictions.decoder.weight` is stored (tied to the word embeddings; we drop the alias);
    - older checkpoints name LayerNorm parameters gamma/beta (read as weight/bias; DLE itself needs weight/bias);
    - a checkpoint saved from a DDP-wrapped model prefixes every name with `module.` (read without it).
The task heads (`qa_outputs.*`, `classifier.*`) are named alike.

Activations: DLE's bert_config.json says "gelu" for the same model in every version, but DLE computed it as the
exact erf GELU before 2022 and as F.gelu(x, approximate=True), the tanh form, since. `gelu` ("tanh" or "erf",
config model.dle_gelu) says which DLE a checkpoint comes from or goes to; we name the two forms as Hugging Face
does (GELU). DLE 2020's "bias_gelu" (bias + the erf form, fused) is read as the erf form.

API:
    load_checkpoint(path, bert_config, gelu=) -> (BertConfig, state dict in our names)   an HF directory
                                               (model.load_pretrained) or a DLE checkpoint file (as below)
    load_dle_checkpoint(path, bert_config, gelu=) -> (BertConfig, state dict in our names)   every tensor mapped or
                                               refused; hidden_act in our names
    save_dle_checkpoint(model, path, gelu=)    {'model': state dict in DLE's names}, vocab rows padded to 8, and
                                               beside it (.json) the bert_config.json DLE runs it with (--config_file);
                                               refused when that DLE has no activation equal to the model's
    save_dle_export(model, directory, gelu=)   the same into an export directory (dle_checkpoint.pt/.json); a
                                               model that DLE cannot run exactly gets the weights and a warning
    from_dle(dle_state, path) / to_dle(state)  the name mapping itself
    our_activation / dle_activation            the activation names, DLE's -> ours and back

    python -m workflow.train.models.dle_checkpoint import --checkpoint ckpt_8601.pt --bert-config bert_config.json \
        --vocab vocab.txt [--no-lowercase] [--gelu tanh|erf] --output DIR     (an HF directory, as our exports)
    python -m workflow.train.models.dle_checkpoint export --model results/pretrain/phase2/model [--gelu tanh|erf] \
        --output ckpt.pt     (and ckpt.json, DLE's --config_file)
"""
from __future__ import annotations

import argparse
import logging
import os
import pickle
from pathlib import Path

import torch

from workflow.atomic import atomic_path, write_json
from workflow.cli import UserError, run
from workflow.data.vocab import Normalization
from workflow.train.models.bert import BertConfig, BertForPreTraining, load_pretrained, save_pretrained
from workflow.train.models.kit import load_weights, read_config_json

log = logging.getLogger(__name__)

# Our module path -> DLE's, for the layers DLE fuses with their activation (LinearActivation `dense_act`).
_FUSED = (".intermediate.dense.", ".pooler.dense.", ".transform.dense.")
DECODER = "cls.predictions.decoder.weight"  # DLE stores the tied decoder weight; it is the word embeddings
WORD_EMBEDDINGS = "bert.embeddings.word_embeddings.weight"
VOCAB_ROWS = (WORD_EMBEDDINGS, "cls.predictions.bias")  # rows per vocabulary entry
TASK_HEADS = ("qa_outputs.weight", "qa_outputs.bias", "classifier.weight", "classifier.bias")
GELU_KEY = "model.dle_gelu"
GELU = {"tanh": "gelu_pytorch_tanh", "erf": "gelu"}  # what DLE's "gelu" computes, since 2022 and before, our names
_SINCE = {"tanh": "since", "erf": "before"}  # ... 2022
_ALIKE = ("relu", "swish", "tanh")  # DLE's other activations (modeling.py ACT2FN), named as ours
DLE_ACTIVATIONS = ("gelu", "bias_gelu", *_ALIKE)


def our_activation(name: str, gelu: str, source) -> str:
    """Our name of what DLE computes for its hidden_act `name`, its "gelu" read as the `gelu` form."""
    if name == "gelu":
        return GELU[gelu]
    if name == "bias_gelu":  # DLE 2020: bias + the erf form, fused
        return GELU["erf"]
    if name in _ALIKE:
        return name
    raise UserError(f"{source}: hidden_act {name!r} is not an activation of DLE's BERT (one of "
                    f"{', '.join(DLE_ACTIVATIONS)})")


def dle_activation(name: str, gelu: str) -> str:
    """DLE's hidden_act for our activation `name` in the DLE whose "gelu" is the `gelu` form; refused in one line
    when that DLE computes no equal (the erf GELU since 2022, the tanh form before)."""
    if name == GELU[gelu] or (gelu == "tanh" and name == "gelu_new"):  # gelu_new: the tanh form, written out
        return "gelu"
    if name in _ALIKE:
        return name
    other = "tanh" if name in ("gelu_new", GELU["tanh"]) else "erf" if name == GELU["erf"] else None
    fix = f": set {GELU_KEY}: {other} for DLE {_SINCE[other]} 2022" if other else ""
    raise UserError(f"hidden_act {name!r}: DLE {_SINCE[gelu]} 2022 ({GELU_KEY}: {gelu}, its gelu the {gelu} form) "
                    f"computes no equal activation{fix}")


def padded_vocab_size(size: int) -> int:
    """DLE's vocab_size: the bert_config.json's rounded up to a multiple of 8 (run_pretraining/run_squad/run_glue)."""
    return (size + 7) // 8 * 8


def dle_name(name: str) -> str:
    for ours in _FUSED:
        name = name.replace(ours, ours.replace(".dense.", ".dense_act."))
    return name


def our_name(name: str) -> str:
    name = name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
    for ours in _FUSED:
        name = name.replace(ours.replace(".dense.", ".dense_act."), ours)
    return name


def _expected_shapes(config: BertConfig) -> dict:
    """Our names and shapes of a BertForPreTraining of `config` (built on the meta device: no memory)."""
    with torch.device("meta"):
        return {name: tuple(tensor.shape) for name, tensor in BertForPreTraining(config).state_dict().items()}


def from_dle(dle_state: dict, source) -> dict:
    """DLE's state dict in our names (the tied decoder alias dropped once checked to be the word embeddings)."""
    state = {our_name(name): tensor for name, tensor in dle_state.items() if name != DECODER}
    if DECODER in dle_state and WORD_EMBEDDINGS in dle_state and not torch.equal(dle_state[DECODER],
                                                                                 dle_state[WORD_EMBEDDINGS]):
        raise UserError(f"{source}: {DECODER} differs from {WORD_EMBEDDINGS} (DLE ties them): not a DLE BERT")
    return state


def to_dle(state: dict) -> dict:
    """Our state dict in DLE's names, the vocabulary rows padded with zeros to a multiple of 8 (as DLE builds the
    model) and the tied decoder weight stored as DLE's state_dict() has it (the same tensor: saved once)."""
    out = {}
    for name, tensor in state.items():
        if name in VOCAB_ROWS and tensor.shape[0] % 8:
            padding = tensor.new_zeros(padded_vocab_size(tensor.shape[0]) - tensor.shape[0], *tensor.shape[1:])
            tensor = torch.cat([tensor, padding])
        out[dle_name(name)] = tensor
    if WORD_EMBEDDINGS in out:
        out[DECODER] = out[WORD_EMBEDDINGS]
    return out


def read_dle_state(path: str | os.PathLike) -> dict:
    """The 'model' state dict of a DLE checkpoint (or a bare state dict), never unpickling arbitrary objects."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise UserError(f"{path}: holds pickled Python objects besides tensors (an older DLE checkpoint saves its "
                        "data loader): re-save its weights alone, from a file you trust, with python -c \"import "
                        "torch; torch.save({'model': torch.load('IN', weights_only=False)['model']}, 'OUT')\"") from None
    except (OSError, RuntimeError, EOFError) as error:
        raise UserError(f"{path}: cannot read a PyTorch checkpoint ({error})") from None
    state = checkpoint.get("model", checkpoint) if isinstance(checkpoint, dict) else None
    if not isinstance(state, dict) or not state or not all(torch.is_tensor(v) for v in state.values()):
        raise UserError(f"{path}: not a DLE BERT checkpoint (no 'model' state dict of tensors)")
    if all(name.startswith("module.") for name in state):  # saved from a DDP-wrapped model
        state = {name[len("module."):]: tensor for name, tensor in state.items()}
    return state


def load_dle_checkpoint(path: str | os.PathLike, bert_config: str | os.PathLike | None, *, gelu: str
                        ) -> tuple[BertConfig, dict]:
    """(config, state dict in BertForPreTraining names, task heads kept) of a DLE checkpoint and the bert_config.json
    it was trained with; its vocab_size becomes the checkpoint's rows (DLE pads the json's to a multiple of 8), its
    hidden_act ours (its "gelu" read as the `gelu` form)."""
    if not bert_config:
        raise UserError(f"{path}: a DLE checkpoint holds weights only: give the bert_config.json it was trained with "
                        "(config model.bert_config)")
    fields = read_config_json(bert_config)
    fields["hidden_act"] = our_activation(fields.get("hidden_act", "gelu"), gelu, bert_config)
    config = BertConfig.from_dict(fields)
    state = from_dle(read_dle_state(path), path)
    if WORD_EMBEDDINGS not in state:
        raise UserError(f"{path}: no {dle_name(WORD_EMBEDDINGS)}: not a DLE BERT checkpoint")
    rows = state[WORD_EMBEDDINGS].shape[0]
    if rows not in (config.vocab_size, padded_vocab_size(config.vocab_size)):
        raise UserError(f"{path}: {rows} word embedding rows, but {bert_config} says vocab_size {config.vocab_size} "
                        f"(DLE pads it to {padded_vocab_size(config.vocab_size)}): the config of another model")
    config.vocab_size = rows
    expected = _expected_shapes(config)
    unmapped = sorted(dle_name(k) for k in state if k not in expected and k not in TASK_HEADS)
    if unmapped:
        raise UserError(f"{path}: {len(unmapped)} tensors map to no BERT parameter (another architecture, or not the "
                        f"config {bert_config}?): {', '.join(unmapped)}")
    wrong = [f"{dle_name(k)} {tuple(v.shape)} (config: {expected[k]})" for k, v in state.items()
             if k in expected and tuple(v.shape) != expected[k]]
    if wrong:
        raise UserError(f"{path}: shapes differ from {bert_config}'s model: {', '.join(wrong)}")
    return config, state


def load_checkpoint(path: str | os.PathLike, bert_config: str | os.PathLike | None, *, gelu: str
                    ) -> tuple[BertConfig, dict]:
    """(config, state dict in BertForPreTraining names) of a starting point: a path that is a file is a DLE
    checkpoint (with the bert_config.json it was trained with; "gelu" read as the `gelu` form), a directory a
    Hugging Face one."""
    if Path(path).is_file():
        return load_dle_checkpoint(path, bert_config, gelu=gelu)
    return load_pretrained(path)


def _save_weights(model: torch.nn.Module, path: str | os.PathLike) -> None:
    """{'model': state dict in DLE's names} (float32) to `path`, loadable by DLE's run_squad.py/run_glue.py."""
    state = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in model.state_dict().items()
             if k != "cls.predictions.decoder.bias"}
    with atomic_path(path) as temporary:
        torch.save({"model": to_dle(state)}, temporary)


def save_dle_checkpoint(model: torch.nn.Module, path: str | os.PathLike, *, gelu: str) -> None:
    """Write the model (a BertForPreTraining, DDP-wrapped or not) as a DLE checkpoint to `path` and the
    bert_config.json DLE runs it with beside it (`path` with .json: DLE's --config_file, hidden_act in DLE's name
    for the DLE of `gelu`); refused before anything is written when that DLE computes no equal activation."""
    model = getattr(model, "module", model)  # unwrap DDP
    activation = dle_activation(model.config.hidden_act, gelu)
    _save_weights(model, path)
    write_json(Path(path).with_suffix(".json"), {**model.config.to_dict(), "hidden_act": activation})


def save_dle_export(model: torch.nn.Module, directory: str | os.PathLike, *, gelu: str) -> None:
    """dle_checkpoint.pt and dle_checkpoint.json (save_dle_checkpoint) in an export directory. A model whose
    activation that DLE lacks (our erf-GELU presets and DLE since 2022) gets the weights alone, which DLE loads and
    runs with its own GELU, and a warning saying so."""
    path = Path(directory) / "dle_checkpoint.pt"
    try:
        save_dle_checkpoint(model, path, gelu=gelu)
    except UserError as refused:
        log.warning("%s: the weights only, no %s (DLE would run them with its own activation): %s", path,
                    path.with_suffix(".json").name, refused)
        _save_weights(getattr(model, "module", model), path)


def _import(args) -> None:
    config, state = load_dle_checkpoint(args.checkpoint, args.bert_config, gelu=args.gelu)
    model = BertForPreTraining(config)
    missing, task_heads = load_weights(model, state)
    if any(k.startswith("bert.") for k in missing):
        raise UserError(f"{args.checkpoint}: no BERT encoder tensors {[dle_name(k) for k in missing]}")
    if missing or task_heads:  # a fine-tuned checkpoint: its encoder is what fine-tuning starts from
        log.warning("%s: a fine-tuned model? pretraining heads %s freshly initialised, task head %s left out",
                    args.checkpoint, missing, task_heads)
    with atomic_path(args.output) as temporary:
        save_pretrained(model, config, args.vocab, temporary, normalization=Normalization.from_args(args))


def _export(args) -> None:
    config, state = load_pretrained(args.model)
    model = BertForPreTraining(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise UserError(f"{args.model}: not a pretrained BERT (missing {missing}, unexpected {unexpected})")
    try:
        save_dle_checkpoint(model, args.output, gelu=args.gelu)
    except UserError as refused:
        raise UserError(f"{args.model}: {refused}") from None


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    into = commands.add_parser("import", help="a DLE checkpoint -> an HF BERT directory")
    into.add_argument("--checkpoint", required=True, help="DLE ckpt_*.pt")
    into.add_argument("--bert-config", required=True, help="the bert_config.json it was trained with")
    into.add_argument("--vocab", required=True, help="the vocab.txt it was trained with")
    Normalization.add_arguments(into)  # --lowercase: the vocab is uncased (DLE's --do_lower_case)
    into.add_argument("--output", required=True, help="HF directory to write")
    gelu = dict(choices=sorted(GELU), default="tanh", help="DLE's 'gelu' is the tanh form (DLE since 2022) or the "
                "exact erf form (before): config model.dle_gelu")
    into.add_argument("--gelu", **gelu)
    out = commands.add_parser("export", help="an HF BERT directory -> a DLE checkpoint")
    out.add_argument("--model", required=True, help="HF BERT directory (e.g. results/pretrain/phase2/model)")
    out.add_argument("--output", required=True, help="DLE checkpoint .pt to write (and its .json beside)")
    out.add_argument("--gelu", **gelu)
    args = parser.parse_args(argv)
    (_import if args.command == "import" else _export)(args)


if __name__ == "__main__":
    run(main)
