"""Stage 3a, punkt: one Punkt sentence-splitting model for a corpus that is formatted in parts.

Trained (as `format` would train it on the whole corpus) on the first characters of the extracted parts read in
order, and saved as a punkt_tab directory that every part's `format` job loads: the sentences of an article do not
depend on which part it is in. Only the first parts are read (the rule gives it the first format.punkt_parts);
when they hold fewer characters than it trains on, its log says so.

From the dump (`--dump`, what the workflow runs): the articles it trains on are extracted here, with the compiled
templates, from the first pages of the first parts only (a prefix of whole pages, grown until it holds enough
prose): the same articles, so the same model, as from those parts' whole extracts, without waiting for them: a
part's format waits for its own extract and this model, and this model for no extract.
"""
import argparse
import itertools
import logging
import tempfile
from pathlib import Path
from typing import Sequence

from workflow.atomic import atomic_path
from workflow.cli import UserError, run
from workflow.data.extract import check_mediawiki_export, extract
from workflow.data.template_pages import open_xml
from workflow.data.format import DEFAULT_TRAIN_CHARS, prose_texts, read_documents, train_punkt, write_punkt_tab

log = logging.getLogger("punkt")


def train_model(inputs: Sequence[str | Path], output: str | Path, train_chars: int = DEFAULT_TRAIN_CHARS) -> Path:
    """Train Punkt on the documents of `inputs` (extract's JSON lines), in order, and write the model to `output`."""
    lengths = []
    texts = (lengths.append(len(text)) or text  # lazy: stops at train_chars
             for text in prose_texts(itertools.chain.from_iterable(read_documents(Path(path)) for path in inputs)))
    params = train_punkt(texts, train_chars)
    if sum(lengths) < train_chars:
        log.warning("the %d inputs hold %d characters of prose, fewer than the %d Punkt trains on: more parts "
                    "(config format.punkt_parts) would give it more", len(inputs), sum(lengths), train_chars)
    with atomic_path(output) as temporary:
        write_punkt_tab(params, temporary)
    log.info("Punkt model of %d inputs -> %s", len(inputs), output)
    return Path(output)


PREFIX_MB = (256, 1024, 4096)  # MB of XML from a part's start, in turn, until the prose suffices (20 M chars: ~125 MB)
BLOCK = 1 << 22


def write_prefix(dump: Path, megabytes: float, output: Path, threads: int) -> bool:
    """The first whole pages of `dump`, at least `megabytes` MB of XML, as a complete export at `output`; return
    True when that is the whole dump."""
    try:
        return _write_prefix(dump, megabytes, output, threads)
    except RuntimeError as error:  # indexed_bzip2's truncated or corrupt input
        raise UserError(f"{dump}: truncated or corrupt bz2 ({type(error).__name__}: {error})") from error


def _write_prefix(dump: Path, megabytes: float, output: Path, threads: int) -> bool:
    with open_xml(dump, threads) as xml, open(output, "wb") as out:
        total, pending = 0, b""
        while total < megabytes * 1e6:
            block = xml.read(min(BLOCK, int(megabytes * 1e6) - total))
            if not block:
                out.write(pending)
                return True
            out.write(pending)
            pending, total = block, total + len(block)
        while (end := pending.rfind(b"</page>")) < 0:  # cut the last block after its last whole page
            block = xml.read(BLOCK)
            if not block:
                out.write(pending)
                return True
            pending += block
        out.write(pending[: pending.find(b"\n", end) + 1 or len(pending)] + b"</mediawiki>\n")
        return False


def train_from_dumps(dumps: Sequence[str | Path], templates: str | Path, output: str | Path, processes: int = 1,
                     train_chars: int = DEFAULT_TRAIN_CHARS, prefix_mb: Sequence[float] = PREFIX_MB) -> Path:
    """Train Punkt on the articles of the first `dumps` (parts, in order) as extract writes them with the compiled
    `templates`, extracting only as many of their first pages as `train_chars` of prose need."""
    with tempfile.TemporaryDirectory(dir=Path(output).parent, prefix=".punkt-") as work:
        extracted, chars = [], 0
        for index, dump in enumerate(map(Path, dumps)):
            check_mediawiki_export(dump)
            articles = Path(work) / f"part{index}.jsonl"
            for megabytes in (*prefix_mb, None):
                prefix = Path(work) / "prefix.xml"
                whole = megabytes is None or write_prefix(dump, megabytes, prefix, processes)
                extract(dump if megabytes is None else prefix, articles, processes, templates, require_articles=whole)
                part_chars = sum(map(len, prose_texts(read_documents(articles))))
                if whole or chars + part_chars >= train_chars:
                    break
            log.info("%s: %s, %d characters of prose", dump, "whole" if whole else f"first {megabytes} MB of XML",
                     part_chars)
            extracted.append(articles)
            chars += part_chars
            if chars >= train_chars:
                break
        return train_model(extracted, output, train_chars)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m workflow.data.punkt", description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", nargs="+", help="extract's JSON lines of the first parts, in order")
    source.add_argument("--dump", nargs="+", help="the first parts of the dump (bz2), in order: their first pages "
                        "are extracted here (needs --templates)")
    parser.add_argument("--templates", help="with --dump: the compiled templates (workflow.data.templates)")
    parser.add_argument("--processes", type=int, default=1, help="with --dump: wikiextractor's processes")
    parser.add_argument("--output", required=True, help="punkt_tab model directory")
    parser.add_argument("--train-chars", type=int, default=DEFAULT_TRAIN_CHARS, help="characters Punkt trains on")
    args = parser.parse_args(argv)
    if args.dump:
        if not args.templates:
            parser.error("--dump needs --templates")
        train_from_dumps(args.dump, args.templates, args.output, args.processes, args.train_chars)
    else:
        train_model(args.input, args.output, args.train_chars)


if __name__ == "__main__":
    run(main)
