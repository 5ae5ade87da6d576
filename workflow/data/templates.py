"""Stage 2a, templates: the template pages of every part of the dump, compiled once into the lookup tables that
wikiextractor expands templates with; every extract job loads that one file read-only.

wikiextractor 3.1.0 parses the template pages it is given (`--templates`) into a sorted, binary-searchable set of
byte blobs (its `template_blob`) before it extracts anything: for the full English dump's ~900k template pages,
a parse of ~1.5-2 GB in every extract job. Here its own parser (`load_templates` with its streaming blob builders)
runs once over the parts' template pages in part order, and the blobs are saved in one file; `extract` hands them
to wikiextractor where its parse would have produced them (`compact_blobs`), so every article reads the same.
"""
import argparse
import itertools
import logging
import mmap
import struct
from pathlib import Path
from typing import Sequence

from workflow.atomic import atomic_path
from workflow.cli import UserError, run

log = logging.getLogger("templates")

MAGIC = b"snakebert compiled wikiextractor templates 1\n"
HEADER = struct.Struct("<7Q")  # template count, then the lengths of the 6 blobs (templates', then redirects')


def compile_templates(pages: Sequence[str | Path], output: str | Path) -> int:
    """Parse the template pages of `pages` (extract --template-pages-only files, in part order) with wikiextractor's
    own loader and write its blobs to `output`; return the number of template pages."""
    from wikiextractor.template_blob import StreamingTemplateBlobBuilder
    from wikiextractor.WikiExtractor import load_templates

    for path in pages:
        if not Path(path).is_file():
            raise UserError(f"{path}: no such file")
    templates, redirects = StreamingTemplateBlobBuilder(), StreamingTemplateBlobBuilder()
    files = [open(path, encoding="utf-8") for path in pages]
    try:  # the title prefix ("Template:") is taken from the first title, as wikiextractor does with --templates
        count, _prefix = load_templates(itertools.chain.from_iterable(files), blob_builder=templates,
                                        redirects_blob_builder=redirects)
    finally:
        for file in files:
            file.close()
    blobs = (*templates.finish(), *redirects.finish())
    with atomic_path(output) as temporary, open(temporary, "wb") as out:
        out.write(MAGIC + HEADER.pack(count, *map(len, blobs)))
        for blob in blobs:
            out.write(blob)
    log.info("%d template pages of %d parts -> %s (%.1f MB)", count, len(pages), output,
             sum(map(len, blobs)) / 1e6)
    return count


def load_compiled(path: str | Path) -> tuple[int, tuple, tuple]:
    """(template count, the templates' 3 blobs, the redirects' 3 blobs) of a compiled file, as read-only views of
    its pages (mmap: jobs on one node share them in the page cache)."""
    path = Path(path)
    with open(path, "rb") as stream:
        try:
            pages = memoryview(mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_READ))
        except ValueError:  # an empty file
            pages = memoryview(b"")
    start = len(MAGIC) + HEADER.size
    if pages[: len(MAGIC)] != MAGIC or len(pages) < start:
        raise UserError(f"{path}: not a compiled template file (python -m workflow.data.templates writes them)")
    count, *lengths = HEADER.unpack(pages[len(MAGIC):start])
    if start + sum(lengths) != len(pages):
        raise UserError(f"{path}: truncated compiled template file ({len(pages)} bytes, {start + sum(lengths)} expected)")
    blobs = []
    for length in lengths:
        blobs.append(pages[start:start + length])
        start += length
    return count, tuple(blobs[:3]), tuple(blobs[3:])


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m workflow.data.templates", description=__doc__.splitlines()[0])
    parser.add_argument("--input", nargs="+", required=True, help="template pages of every part, in part order")
    parser.add_argument("--output", required=True, help="the compiled file every extract job loads (--templates)")
    args = parser.parse_args(argv)
    compile_templates(args.input, args.output)


if __name__ == "__main__":
    run(main)
