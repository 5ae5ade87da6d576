"""Fine-tuning features (SQuAD, GLUE): the WordPiece tokenizer they are made with, and their .npz files.

API:
    load_tokenizer(vocab, lowercase) -> tokenizers.BertWordPieceTokenizer ([CLS]/[SEP] not added automatically)
    save_features(path, {name: array})  byte-identical .npz for identical arrays, written atomically
    load_features(path) -> {name: array}
"""
import io
import zipfile
from pathlib import Path

import numpy as np

from workflow.atomic import atomic_path
from workflow.cli import UserError


def load_tokenizer(vocab: str | Path, lowercase: bool):
    """The project's WordPiece tokenizer (BERT normalisation, [CLS]/[SEP] not added automatically)."""
    from tokenizers import BertWordPieceTokenizer

    try:
        return BertWordPieceTokenizer(str(vocab), lowercase=lowercase, strip_accents=lowercase)
    except Exception as error:  # tokenizers raises a bare Exception for a missing/garbled vocab
        raise UserError(f"{vocab}: cannot load WordPiece vocab: {error}") from error


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
    """Read features written by save_features."""
    try:
        with np.load(path, allow_pickle=False) as archive:
            return {name: archive[name] for name in archive.files}
    except (OSError, ValueError, zipfile.BadZipFile) as error:
        raise UserError(f"{path}: cannot read SQuAD features: {error}") from error
