"""Atomic outputs: write under a temporary name beside the target, rename only when complete."""
from __future__ import annotations  # also runs on PyPy 3.9 (the extract rule)

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


@contextmanager
def atomic_path(final: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path (file or directory) that becomes `final` only if the block succeeds.

    On any exception the temporary is removed and `final` is left untouched, so no partial
    output ever looks complete to Snakemake or a user.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    temporary = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    _remove(temporary)
    try:
        yield temporary
        if final.is_dir() and temporary.is_dir():
            shutil.rmtree(final)
        os.replace(temporary, final)
    except BaseException:
        _remove(temporary)
        raise


def write_text(final: str | os.PathLike, text: str) -> None:
    """Write `text` to `final` atomically."""
    with atomic_path(final) as temporary:
        temporary.write_text(text, encoding="utf-8")


def write_json(final: str | os.PathLike, data) -> None:
    """Write `data` as indented, key-sorted JSON to `final` atomically."""
    write_text(final, json.dumps(data, indent=2, sort_keys=True) + "\n")
