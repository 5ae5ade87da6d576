"""Fine-tuning features (SQuAD, GLUE): the tokenizer they are made with, and their .npz files.

API:
    load_tokenizer(vocab, lowercase, strip_accents=None, tokenize_chinese_chars=True)
                                        -> tokenizers.BertWordPieceTokenizer, or for a byte-level BPE tokenizer.json
                                        its own tokenizers.Tokenizer ([CLS]/[SEP] added by the featurizers)
    add_tokenizer_arguments(parser) / tokenizer_from_args(args)   the featurizers' --vocab, the normalisation flags
                                        (--[no-]lowercase, --[no-]strip-accents, --[no-]tokenize-chinese-chars) and
                                        --tokenizer-config (the fine-tuned model's tokenizer_config.json, which wins)
    save_features(path, {name: array})  byte-identical .npz for identical arrays, written atomically
    load_features(path) -> {name: array}  memory-mapped, copy-on-write
"""
import argparse
import io
import json
import math
import struct
import zipfile
from pathlib import Path

import numpy as np

from workflow.atomic import atomic_path
from workflow.cli import UserError
from workflow.data.vocab import Normalization, read_tokenizer_json, vocab_file_type


def load_tokenizer(vocab: str | Path, lowercase: bool, strip_accents: bool | None = None,
                   tokenize_chinese_chars: bool = True):
    """The project's WordPiece tokenizer (BERT normalisation, [CLS]/[SEP] not added automatically); accents are
    stripped as `strip_accents` says, or, when None, exactly when lower-casing (BERT's and HF's rule). A byte-level
    BPE tokenizer.json is its own tokenizer (its casing and prefix space: what AutoTokenizer loads from an export;
    the casing arguments do not apply); the featurizers encode with add_special_tokens=False."""
    from tokenizers import BertWordPieceTokenizer

    if vocab_file_type(vocab) == "bpe":
        tokenizer = read_tokenizer_json(vocab)
        tokenizer.no_truncation()
        tokenizer.no_padding()
        return tokenizer
    try:
        return BertWordPieceTokenizer(str(vocab), lowercase=lowercase, handle_chinese_chars=tokenize_chinese_chars,
                                      strip_accents=lowercase if strip_accents is None else strip_accents)
    except Exception as error:  # tokenizers raises a bare Exception for a missing/garbled vocab
        raise UserError(f"{vocab}: cannot load WordPiece vocab: {error}") from error


def tokenizer_settings(path: str | Path) -> dict:
    """load_tokenizer's casing keywords from an HF tokenizer_config.json (BertTokenizer's defaults where absent)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise UserError(f"{path}: cannot read a tokenizer config: {error}") from None
    return {"lowercase": bool(data.get("do_lower_case", True)), "strip_accents": data.get("strip_accents"),
            "tokenize_chinese_chars": bool(data.get("tokenize_chinese_chars", True))}


def add_tokenizer_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vocab", required=True, help="WordPiece vocab.txt or byte-level BPE tokenizer.json")
    Normalization.add_arguments(parser)
    parser.add_argument("--tokenizer-config", default=None, help="the fine-tuned model's tokenizer_config.json: its "
                        "do_lower_case, strip_accents and tokenize_chinese_chars (instead of the flags above)")


def tokenizer_from_args(args: argparse.Namespace):
    """The tokenizer of the model being fine-tuned: its tokenizer_config.json's normalisation if given, else the
    normalisation flags."""
    if args.tokenizer_config:
        return load_tokenizer(args.vocab, **tokenizer_settings(args.tokenizer_config))
    normalization = Normalization.from_args(args)
    return load_tokenizer(args.vocab, normalization.lowercase, normalization.strip_accents,
                          normalization.tokenize_chinese_chars)


def save_features(path: str | Path, features: dict[str, np.ndarray]) -> None:
    """Write arrays as an .npz readable by numpy.load, byte-identical for identical arrays (fixed zip dates)."""
    with atomic_path(path) as temporary:
        with zipfile.ZipFile(temporary, "w", compression=zipfile.ZIP_STORED) as archive:
            for name in sorted(features):
                buffer = io.BytesIO()
                np.save(buffer, features[name], allow_pickle=False)
                info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
                archive.writestr(info, buffer.getvalue())


def load_features(path: str | Path) -> dict[str, np.ndarray]:
    """Read features written by save_features, memory-mapped copy-on-write: a node's ranks share one copy in the page
    cache (SQuAD's 88k features of 384 tokens are about 0.4 GB per copy). Compressed members are read into memory."""
    try:
        with zipfile.ZipFile(path) as archive, open(path, "rb") as file:
            if any(info.compress_type != zipfile.ZIP_STORED for info in archive.infolist()):
                with np.load(path, allow_pickle=False) as compressed:
                    return {name: compressed[name] for name in compressed.files}
            return {info.filename.removesuffix(".npy"): _mapped_member(path, file, info)
                    for info in archive.infolist()}
    except (OSError, ValueError, KeyError, struct.error, zipfile.BadZipFile) as error:
        raise UserError(f"{path}: cannot read features: {error}") from error


def _mapped_member(path: str | Path, file, info: zipfile.ZipInfo) -> np.ndarray:
    """One stored .npy member of the zip as a memory map: past the member's local header, then the .npy header."""
    file.seek(info.header_offset)
    local_header = file.read(30)
    if local_header[:4] != b"PK\x03\x04":
        raise ValueError(f"{info.filename}: no local file header at byte {info.header_offset}")
    name_length, extra_length = struct.unpack("<HH", local_header[26:30])
    file.seek(info.header_offset + 30 + name_length + extra_length)
    read_header = {(1, 0): np.lib.format.read_array_header_1_0,
                   (2, 0): np.lib.format.read_array_header_2_0}[np.lib.format.read_magic(file)]
    shape, fortran_order, dtype = read_header(file)
    if dtype.hasobject:
        raise ValueError(f"{info.filename}: object arrays are not features")
    if math.prod(shape) == 0:
        return np.empty(shape, dtype)
    return np.memmap(path, dtype=dtype, mode="c", offset=file.tell(), shape=shape, order="F" if fortran_order else "C")
