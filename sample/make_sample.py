"""Regenerate the sample dump from its readable source: `python sample/make_sample.py`.

sample/enwiki-sample-pages-articles.xml (hand-edited, the source of truth) -> the .xml.bz2 the demo and tests
download, and sample/enwiki-sample-md5sums.txt listing its md5 the way dumps.wikimedia.org does.
"""
import bz2
import hashlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "enwiki-sample-pages-articles.xml"
DUMP = HERE / "enwiki-sample-pages-articles.xml.bz2"
MD5SUMS = HERE / "enwiki-sample-md5sums.txt"


def main() -> None:
    data = bz2.compress(SOURCE.read_bytes(), compresslevel=9)  # deterministic: same XML, same bytes
    DUMP.write_bytes(data)
    # a real dump's list names several files; ours names the dump and a sibling, so lookup by basename is exercised
    MD5SUMS.write_text(
        f"{hashlib.md5(b'').hexdigest()}  enwiki-sample-stub-articles.xml.gz\n"
        f"{hashlib.md5(data).hexdigest()}  {DUMP.name}\n"
    )
    print(f"{DUMP.name}: {len(data)} bytes, md5 {hashlib.md5(data).hexdigest()}")


if __name__ == "__main__":
    main()
