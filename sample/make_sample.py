"""Regenerate the sample dump from its readable source: `python sample/make_sample.py`.

sample/enwiki-sample-pages-articles.xml (hand-edited, the source of truth) -> the .xml.bz2 the demo and tests
download, and sample/enwiki-sample-md5sums.txt listing its md5 the way dumps.wikimedia.org does.

sample/parts/ holds the same dump the way dumps.wikimedia.org also publishes it: in parts, each a complete export
(same <siteinfo>) of consecutive pages, named `enwiki-sample-pages-articlesN.xml-pFIRSTpLAST.bz2` (page ids FIRST..LAST),
listed in sample/parts/enwiki-sample-md5sums.txt. Set `wikipedia.url: sample/parts/enwiki-sample-pages-articles.xml.bz2`
(`wikipedia.parts: auto`) to run the workflow on them.
"""
import bz2
import hashlib
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "enwiki-sample-pages-articles.xml"
DUMP = HERE / "enwiki-sample-pages-articles.xml.bz2"
MD5SUMS = HERE / "enwiki-sample-md5sums.txt"
PARTS = HERE / "parts"
N_PARTS = 3


def split_pages(xml: str, n_parts: int) -> list[tuple[int, int, str]]:
    """(first page id, last page id, a complete export of those pages) for `n_parts` runs of consecutive pages."""
    head, rest = xml.split("  <page>", 1)
    body, tail = ("  <page>" + rest).rsplit("</mediawiki>", 1)
    pages = re.findall(r"  <page>.*?</page>\n", body, flags=re.S)
    size = -(-len(pages) // n_parts)
    parts = []
    for start in range(0, len(pages), size):
        chunk = pages[start : start + size]
        ids = [int(re.search(r"<id>(\d+)</id>", page)[1]) for page in chunk]  # a page's own id comes first
        parts.append((ids[0], ids[-1], head + "".join(chunk) + "</mediawiki>" + tail))
    return parts


def main() -> None:
    xml = SOURCE.read_text(encoding="utf-8")
    data = bz2.compress(xml.encode("utf-8"), compresslevel=9)  # deterministic: same XML, same bytes
    DUMP.write_bytes(data)
    # a real dump's list names several files; ours names the dump and a sibling, so lookup by basename is exercised
    MD5SUMS.write_text(
        f"{hashlib.md5(b'').hexdigest()}  enwiki-sample-stub-articles.xml.gz\n"
        f"{hashlib.md5(data).hexdigest()}  {DUMP.name}\n"
    )
    print(f"{DUMP.name}: {len(data)} bytes, md5 {hashlib.md5(data).hexdigest()}")

    PARTS.mkdir(exist_ok=True)
    lines = [f"{hashlib.md5(data).hexdigest()}  {DUMP.name}\n"]  # the dump site lists the whole file too
    for number, (first, last, part_xml) in enumerate(split_pages(xml, N_PARTS), 1):
        name = f"enwiki-sample-pages-articles{number}.xml-p{first}p{last}.bz2"
        part = bz2.compress(part_xml.encode("utf-8"), compresslevel=9)
        (PARTS / name).write_bytes(part)
        lines.append(f"{hashlib.md5(part).hexdigest()}  {name}\n")
        print(f"parts/{name}: {len(part)} bytes")
    (PARTS / MD5SUMS.name).write_text("".join(lines))


if __name__ == "__main__":
    main()
