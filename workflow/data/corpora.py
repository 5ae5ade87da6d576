"""A user's own corpus (config `corpora.<name>`): its files, and its raw documents as (source, text) pairs.

Two formats:
- `text`: a directory (every file under it, recursively) or a glob of UTF-8 files, read in sorted path order.
  `documents: file` (default): each file is one document, its paragraphs separated by blank lines (as BookCorpus);
  `documents: blank_line`: a blank line ends a document, each line is a paragraph (Google BERT's input format).
- `jsonl`: one JSON object per line, the document's text under `text_field`; `.gz` and `.bz2` files are
  decompressed. A blank line is skipped; any other line that is not an object with a string `text_field` is an error.
Every error is one line naming the corpus, the file and (for JSONL) the line.
"""
import bz2
import glob
import gzip
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from workflow.cli import UserError

FORMATS = ("text", "jsonl")
DOCUMENT_SEPARATORS = ("file", "blank_line")


@dataclass(frozen=True)
class Corpus:
    """One entry of config `corpora`, validated."""

    name: str
    format: str
    path: str
    text_field: str = "text"
    documents: str = "file"
    language: str | None = None  # Punkt's curated lists (format.CURATED); null = the wikipedia.language

    @classmethod
    def from_config(cls, name: str, section: dict) -> "Corpus":
        known = {"format", "path", "text_field", "documents", "language"}
        unknown = sorted(set(section) - known)
        if unknown:
            raise UserError(f"corpora.{name}: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        if section.get("format") not in FORMATS:
            raise UserError(f"corpora.{name}.format: {section.get('format')!r}, expected one of {', '.join(FORMATS)}")
        if not section.get("path"):
            raise UserError(f"corpora.{name}.path: not set (a directory, a glob or a file)")
        corpus = cls(name, **section)
        if corpus.documents not in DOCUMENT_SEPARATORS:
            raise UserError(f"corpora.{name}.documents: {corpus.documents!r}, expected one of "
                            f"{', '.join(DOCUMENT_SEPARATORS)}")
        return corpus


def corpus_files(corpus: Corpus) -> list[Path]:
    """The files of `corpus`, sorted: every file under its directory, or those its glob (or file name) matches."""
    path = os.path.expanduser(corpus.path)
    if os.path.isdir(path):
        files = sorted(p for p in Path(path).rglob("*") if p.is_file() and not p.name.startswith("."))
    else:
        files = sorted(Path(p) for p in glob.glob(path, recursive=True) if os.path.isfile(p))
    if not files:
        what = "no files in this directory" if os.path.isdir(path) else "no such file" if not glob.has_magic(path) \
            else "the glob matches no file"
        raise UserError(f"corpora.{corpus.name}: {corpus.path}: {what}")
    return files


def _open_text(path: Path):
    """`path` as UTF-8 text, decompressed by its suffix (.gz, .bz2)."""
    opener = {".gz": gzip.open, ".bz2": bz2.open}.get(path.suffix, open)
    return opener(path, "rt", encoding="utf-8")


def _text_documents(corpus: Corpus, path: Path) -> Iterator[tuple[str, str]]:
    with _open_text(path) as handle:
        if corpus.documents == "file":
            yield str(path), handle.read()
            return
        lines: list[str] = []
        for number, line in enumerate(handle, 1):
            if line.strip():
                lines.append(line)
            elif lines:
                yield f"{path}:{number - len(lines)}", "".join(lines)
                lines = []
        if lines:
            yield f"{path}:{number - len(lines) + 1}", "".join(lines)


def _jsonl_documents(corpus: Corpus, path: Path) -> Iterator[tuple[str, str]]:
    with _open_text(path) as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            where = f"corpora.{corpus.name}: {path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise UserError(f"{where}: not a JSON object ({error.msg} at column {error.colno})") from None
            text = record.get(corpus.text_field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise UserError(f"{where}: no string field {corpus.text_field!r} (corpora.{corpus.name}.text_field)")
            yield f"{path}:{number}", text


def corpus_documents(corpus: Corpus) -> Iterator[tuple[str, str]]:
    """(where it comes from: file or file:line, raw text) of every document of `corpus`, in file order."""
    read = _jsonl_documents if corpus.format == "jsonl" else _text_documents
    for path in corpus_files(corpus):
        try:
            yield from read(corpus, path)
        except UnicodeDecodeError as error:
            raise UserError(f"corpora.{corpus.name}: {path}: not UTF-8 ({error.reason})") from None
        except (OSError, EOFError) as error:  # a truncated or corrupt .gz/.bz2
            raise UserError(f"corpora.{corpus.name}: {path}: cannot read ({error})") from None


def corpora_error(config: dict) -> str | None:
    """What the schema cannot say about the corpus as a whole, as one line naming the key; None when it is usable:
    at least one corpus, and every `corpora` entry with files."""
    if not (config["wikipedia"]["enabled"] or config["bookcorpus"]["enabled"] or config["corpora"]):
        return ("config key 'wikipedia.enabled': false, and neither bookcorpus.enabled nor a corpora entry: "
                "there is no text to pretrain on")
    for name, section in sorted(config["corpora"].items()):
        try:
            corpus_files(Corpus.from_config(name, section))
        except UserError as error:
            return str(error)
    return None
