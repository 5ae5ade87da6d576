"""Benchmark: the template pages of one dump part, found line by line (the scan before) vs by a byte search of
blocks decompressed block-parallel (`python -m workflow.data.template_pages`, now), at 1 and 2 threads.

    python benchmarks/template_scan.py [--mb 200]

Generates a bz2 dump of --mb MB of real-shaped XML (benchmarks/enwiki_pages.py), then runs each side in its own
process (CPU s, wall s, peak RSS from wait4): before, `line_scan_template_pages` (bz2 module, every line decoded
and compared); now, the workflow's scan at --processes 1 and 2. Every side writes the template pages it found;
the files must be equal. At full size a part is ~1.6 GB of XML on average (100 GB in 63 parts).
"""
import argparse
import bz2
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from enwiki_pages import dump as enwiki_dump  # noqa: E402
from wikipedia_sample import run_stage  # noqa: E402

PYTHON = sys.executable
BEFORE = """
import sys
sys.path.insert(0, sys.argv[3])
from template_scan import line_scan_template_pages
open(sys.argv[2], "wb").write(line_scan_template_pages(sys.argv[1]))
"""


def line_scan_template_pages(dump) -> bytes:
    """The template pages of bz2 `dump` read line by line: a `<page>` line opens a page, a `<ns>` line other than
    `<ns>10</ns>` drops it, a `</page>` line ends it (the scan the byte search replaced; its reference)."""
    pages, page = [], None
    with bz2.open(dump, "rb") as stream:
        for line in stream:
            if line.strip() == b"<page>":
                page = [line]
            elif page is not None:
                page.append(line)
                if line.strip().startswith(b"<ns>") and line.strip() != b"<ns>10</ns>":
                    page = None
                elif line.strip() == b"</page>":
                    pages.append(b"".join(page))
                    page = None
    return b"".join(pages)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=200.0, help="MB of XML in the generated dump")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        dump = work / "part.xml.bz2"
        sizes = enwiki_dump(args.mb, dump)
        print(f"dump: {sizes['xml_bytes'] / 1e6:.0f} MB XML ({sizes['bytes'] / 1e6:.1f} MB bz2), "
              f"{sizes['templates']:,} template pages", flush=True)
        runs = {"before: line by line": run_stage([PYTHON, "-c", BEFORE, dump, work / "before.xml",
                                                   Path(__file__).resolve().parent])}
        for threads in (1, 2):
            runs[f"now: byte search, {threads} thread(s)"] = run_stage(
                [PYTHON, "-m", "workflow.data.template_pages", "--input", dump, "--output",
                 work / f"now{threads}.xml", "--threads", threads])
        outputs = {(work / name).read_bytes() for name in ("before.xml", "now1.xml", "now2.xml")}
        print(f"template pages found: {'EQUAL' if len(outputs) == 1 else 'DIFFERENT'} on every side")
        print(f"{'':34s} {'CPU s':>7s} {'wall s':>7s} {'MB XML/CPU s':>13s} {'peak RSS MB':>12s}")
        for label, m in runs.items():
            print(f"{label:34s} {m.cpu:7.2f} {m.wall:7.2f} {sizes['xml_bytes'] / 1e6 / m.cpu:13.0f} {m.rss_mb:12.0f}")
        before, one = runs["before: line by line"], runs["now: byte search, 1 thread(s)"]
        print(f"now vs before on one thread: {before.cpu / one.cpu:.2f}x less CPU")


if __name__ == "__main__":
    main()
