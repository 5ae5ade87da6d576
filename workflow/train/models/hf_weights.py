"""The weights of a Hugging Face model directory, as every family reads them: in any of the files HF writes or has
written, and under the pretraining model's names whether the directory holds the pretraining model or its bare
encoder (HF's `base_model_prefix`).

API:
    WEIGHT_FILES                            the files looked for, in order
    read_weights(directory, where, base_model_prefix) -> dict   the tensors of model.safetensors, its shards
        (model.safetensors.index.json), pytorch_model.bin or its shards, loaded without running code (safetensors;
        torch.load(weights_only=True)), under the pretraining model's names: a bare encoder's (BertModel,
        RobertaModel, ModernBertModel: no key under `base_model_prefix`) put under it, TF-era LayerNorm gamma/beta
        as weight/bias. `where` starts the error line (a directory without them, a shard missing)
"""
from __future__ import annotations

import json
import pickle
from pathlib import Path

from workflow.cli import UserError

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def read_weights(directory: str | Path, where: str, base_model_prefix: str) -> dict:
    return _with_base_prefix(_read_directory(Path(directory), where), base_model_prefix + ".")


def _read_directory(directory: Path, where: str) -> dict:
    name = next((name for name in WEIGHT_FILES if (directory / name).is_file()), None)
    if name is None:
        raise UserError(f"{where}: no weights ({', '.join(WEIGHT_FILES)})")
    if not name.endswith(".index.json"):
        return _read_file(directory / name, where)
    try:
        weight_map = json.loads((directory / name).read_text(encoding="utf-8"))["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise UserError(f"{where}: cannot read {name}: {error!r}") from None
    state = {}
    for shard in sorted(set(weight_map.values())):
        if not (directory / shard).is_file():
            raise UserError(f"{where}: {name} names the shard {shard}, which is not there")
        state.update(_read_file(directory / shard, where))
    absent = sorted(set(weight_map) - set(state))
    if absent:
        raise UserError(f"{where}: {name} maps {len(absent)} tensors that no shard holds, e.g. {absent[0]}")
    return state


def _read_file(path: Path, where: str) -> dict:
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        if path.suffix == ".safetensors":
            return load_file(str(path))
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise UserError(f"{where}: {path.name} pickles more than tensors, and a pickle's code is never run here: "
                        "save its state dict as model.safetensors where you trust it") from None
    except (OSError, RuntimeError, ValueError, EOFError, SafetensorError) as error:  # a file cut short, not weights
        reason = str(error).strip("'\"").splitlines()[0] if str(error) else repr(error)
        raise UserError(f"{where}: cannot read {path.name}: {reason}") from None


def _with_base_prefix(state: dict, prefix: str) -> dict:
    renamed = {key.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias"): value
               for key, value in state.items()}
    if any(key.startswith(prefix) for key in renamed):
        return renamed
    return {prefix + key: value for key, value in renamed.items()}
