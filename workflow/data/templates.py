"""Stage 2a, templates: the template pages of every part of the dump, compiled once into the lookup tables that
wikiextractor expands templates with; every extract job loads that one file read-only.

wikiextractor 3.1.0 parses the template pages it is given (`--templates`) into a sorted, binary-searchable set of
byte blobs (its `template_blob`) before it extracts anything: for the full English dump's ~900k template pages,
a parse of ~1.5-2 GB in every extract job. Here its own parser (`load_templates` with its streaming blob builders)
runs once over the parts' template pages in part order (the parts' files parsed in parallel processes, their pages
added to the builders in part order), and the blobs are saved in one file; `extract` hands them
to wikiextractor where its parse would have produced them (`compact_blobs`), so every article reads the same.
"""
from __future__ import annotations  # also runs on PyPy 3.9 (the extract rule)

import argparse
import logging
import mmap
import struct
from pathlib import Path
from typing import Sequence

from workflow.atomic import atomic_path
from workflow.cli import UserError, run
from workflow.pool import forked_pool

log = logging.getLogger("templates")

MAGIC = b"snakebert compiled wikiextractor templates 1\n"
HEADER = struct.Struct("<7Q")  # template count, then the lengths of the 6 blobs (templates', then redirects')


class AddedPairs:
    """Stands in for wikiextractor's blob builder in a worker process: keeps the (title, text) pairs its loader adds,
    for the parent to add to the real builder in the same order."""

    def __init__(self):
        self.pairs: list[tuple[str, str]] = []

    def add(self, title: str, text: str) -> None:
        self.pairs.append((title, text))


def parse_template_pages(path_and_prefix: tuple[str, str]) -> tuple[int, list, list]:
    """wikiextractor's loader on one file of template pages: (pages counted, templates' pairs, redirects' pairs)."""
    from wikiextractor.WikiExtractor import load_templates

    path, prefix = path_and_prefix
    templates, redirects = AddedPairs(), AddedPairs()
    with open(path, encoding="utf-8") as lines:
        count, _prefix = load_templates(lines, blob_builder=templates, redirects_blob_builder=redirects,
                                        template_prefix=prefix)
    return count, templates.pairs, redirects.pairs


def template_prefix(pages: Sequence[str | Path]) -> str:
    """The title prefix ("Template:") wikiextractor's loader takes, when not told, from the first title with a colon
    past its second character; "" when there is none (then every file's loader looks for it alike)."""
    from wikiextractor.WikiExtractor import tagRE

    for path in pages:
        with open(path, encoding="utf-8") as lines:
            for line in lines:
                match = tagRE.search(line) if "<title" in line else None
                if match and match.group(2) == "title" and (colon := match.group(3).find(":")) > 1:
                    return match.group(3)[: colon + 1]
    return ""


def compile_templates(pages: Sequence[str | Path], output: str | Path, processes: int = 1) -> int:
    """Parse the template pages of `pages` (workflow.data.template_pages files, in part order) with wikiextractor's
    own loader and write its blobs to `output`; return the number of template pages.

    The files are parsed in `processes` processes at once (the loader reads each page on its own); their pages
    reach wikiextractor's blob builder in file order, so the blobs are those of one pass over all of them.
    """
    from wikiextractor.template_blob import StreamingTemplateBlobBuilder

    for path in pages:
        if not Path(path).is_file():
            raise UserError(f"{path}: no such file")
    prefix = template_prefix(pages)
    templates, redirects = StreamingTemplateBlobBuilder(), StreamingTemplateBlobBuilder()
    count = 0
    with forked_pool(max(1, min(processes, len(pages)))) as pool:
        # imap: in file order, each file's pairs added (and let go) while later files are parsed
        for pages_read, template_pairs, redirect_pairs in pool.imap(
                parse_template_pages, [(str(path), prefix) for path in pages], chunksize=1):
            count += pages_read
            for builder, pairs in ((templates, template_pairs), (redirects, redirect_pairs)):
                for title, text in pairs:
                    builder.add(title, text)
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
    parser.add_argument("--processes", type=int, default=1, help="files parsed at once")
    args = parser.parse_args(argv)
    compile_templates(args.input, args.output, args.processes)


if __name__ == "__main__":
    run(main)
