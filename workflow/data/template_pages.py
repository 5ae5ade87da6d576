"""Stage 2a, template pages: the template pages (namespace 10) of one part of the dump, verbatim and in order, for
workflow.data.templates to compile; a byte search over the XML, a bz2 part decompressed block-parallel
(indexed_bzip2).
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Iterator, Sequence

from workflow.atomic import atomic_path
from workflow.cli import UserError, run
from workflow.data.extract import check_mediawiki_export

log = logging.getLogger("template_pages")

TEMPLATE_NAMESPACE = "10"  # the only pages wikiextractor takes template definitions from
TEMPLATE_PAGE_NS = b"<ns>" + TEMPLATE_NAMESPACE.encode() + b"</ns>"
SCAN_BLOCK = 1 << 24  # bytes of XML searched at a time


def template_pages(stream) -> Iterator[bytes]:
    """The template pages of a dump's XML `stream` (binary), each verbatim: its lines from `<page>` to `</page>`.

    Searches blocks of bytes for `<ns>10</ns>` (it cannot occur inside a page's text or title, which are
    XML-escaped) and cuts out the page around each hit, so the cost is the decompression's, not a loop over lines.
    """
    tail = b""
    while True:
        block = stream.read(SCAN_BLOCK)
        data = tail + block
        last = data.rfind(b"</page>")
        end = len(data) if not block else (data.find(b"\n", last) + 1 if last >= 0 else 0)
        if end <= 0 and block:  # no whole page yet: read on
            tail = data
            continue
        position = 0
        while (hit := data.find(TEMPLATE_PAGE_NS, position, end)) >= 0:
            start = data.rfind(b"\n", 0, data.rfind(b"<page>", 0, hit)) + 1
            stop = data.find(b"</page>", hit, end)
            stop = end if stop < 0 else data.find(b"\n", stop) + 1 or len(data)
            yield data[start:stop]
            position = stop
        if not block:
            return
        tail = data[end:]


def open_xml(dump: Path, threads: int = 1):
    """Binary stream of the XML of `dump`: a bz2 one decompressed on `threads` threads (indexed_bzip2, block-
    parallel; a truncated or corrupt one raises RuntimeError as it is read), else the file itself."""
    import indexed_bzip2

    with open(dump, "rb") as stream:
        bz2_input = stream.read(3) == b"BZh"
    return indexed_bzip2.open(str(dump), parallelization=threads) if bz2_input else open(dump, "rb")


def collect_template_pages(dump: str | Path, output: str | Path, threads: int = 1) -> int:
    """Copy the template pages (namespace 10) of `dump`, verbatim and in order, to `output`; return their number.

    The lines are the dump's own, so wikiextractor's loader (workflow.data.templates) reads them exactly as in its
    pre-scan of a dump. A bz2 dump is decompressed on `threads` threads (indexed_bzip2, block-parallel).
    """
    dump, output = Path(dump), Path(output)
    if not dump.is_file():
        raise UserError(f"{dump}: no such file")
    check_mediawiki_export(dump)
    count = 0
    with atomic_path(output) as temporary, open(temporary, "wb") as out:
        try:
            with open_xml(dump, threads) as xml:
                for page in template_pages(xml):
                    out.write(page.decode("utf-8", errors="replace").encode("utf-8"))
                    count += 1
        except (EOFError, OSError, RuntimeError) as error:  # indexed_bzip2 raises RuntimeError
            raise UserError(f"{dump}: truncated or corrupt bz2 ({type(error).__name__}: {error})") from error
    log.info("%s: %d template pages -> %s", dump, count, output)
    return count


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m workflow.data.template_pages", description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="MediaWiki pages-articles XML dump (.xml.bz2 or .xml)")
    parser.add_argument("--output", required=True, help="the dump's template pages (XML lines)")
    parser.add_argument("--threads", type=int, default=1, help="bz2 decompression threads")
    args = parser.parse_args(argv)
    collect_template_pages(args.input, args.output, args.threads)


if __name__ == "__main__":
    run(main)
