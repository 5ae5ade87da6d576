"""Benchmark: the dump's template pages compiled once vs merged and parsed by every extract job, at enwiki scale.

    python benchmarks/templates_once.py [--templates 900000] [--parts 63] [--processes 16]

Generates --templates real-shaped template pages (benchmarks/enwiki_pages.py: nested, with parser functions and
<noinclude> documentation, ~1.9 KB each; enwiki has ~900k, ~1.5-2 GB) split over --parts per-part files as
`wikipedia_templates` writes them, then measures, each in its own process (CPU s, wall s, peak RSS from wait4):
- before, per extract job: the parts' files merged into one (a copy) and parsed by wikiextractor
  (`load_and_compact_templates`, its own loader and shared-memory blobs);
- now, once: `python -m workflow.data.templates` (the same loader, once, blobs written to one file), in one
  process and in --processes (the parts' files parsed at once, added in part order): the two files must be equal;
- now, per extract job: that file loaded read-only into the same shared-memory blobs (extract's loader).
Both sides end with the templates wikiextractor's workers read; their counts must match.
"""
import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from enwiki_pages import template_set  # noqa: E402
from wikipedia_sample import run_stage  # noqa: E402

PYTHON = sys.executable
BEFORE = """
import shutil, sys
from wikiextractor import WikiExtractor as W
merged, parts = sys.argv[1], sys.argv[2:]
with open(merged, "wb") as out:
    for path in parts:
        with open(path, "rb") as pages:
            shutil.copyfileobj(pages, out)
templates, redirects, _, _ = W.load_and_compact_templates(merged, "-", None, template_prefix="Template:")
with templates as (blob, _), redirects:
    print(len(blob))
"""
NOW = """
import sys
from wikiextractor import WikiExtractor as W
from workflow.data.extract import load_compiled_templates
templates, redirects, _, _ = load_compiled_templates(W.load_and_compact_templates)(sys.argv[1], "-", None, "Template:")
with templates as (blob, _), redirects:
    print(len(blob))
"""


def write_parts(n_templates: int, n_parts: int, work: Path) -> list[Path]:
    """The template pages in `n_parts` files of about equal size, as the per-part collection writes them."""
    paths = [work / f"part{index}.templates.xml" for index in range(n_parts)]
    per_part = -(-n_templates // n_parts)
    pages = template_set(n_templates)
    for path in paths:
        with open(path, "w", encoding="utf-8") as out:
            for _, page in zip(range(per_part), pages):
                out.write(page)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--templates", type=int, default=900_000, help="template pages (enwiki: ~900k)")
    parser.add_argument("--parts", type=int, default=63, help="dump parts (enwiki: 63)")
    parser.add_argument("--processes", type=int, default=16, help="compile_templates' processes (the rule's)")
    parser.add_argument("--workdir", help="where the generated files go (default: a temporary directory)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.workdir) as work:
        work = Path(work)
        parts = write_parts(args.templates, args.parts, work)
        size = sum(path.stat().st_size for path in parts)
        print(f"{args.templates:,} template pages in {args.parts} part files: {size / 1e9:.2f} GB "
              f"({size / args.templates:.0f} bytes each)", flush=True)
        compiled = work / "templates.bin"
        once = run_stage([PYTHON, "-m", "workflow.data.templates", "--input", *parts, "--output", compiled])
        parallel = run_stage([PYTHON, "-m", "workflow.data.templates", "--input", *parts, "--output",
                              work / "parallel.bin", "--processes", args.processes])
        same = (work / "parallel.bin").read_bytes() == compiled.read_bytes()
        before = run_stage([PYTHON, "-c", BEFORE, work / "merged.xml", *parts])
        (work / "merged.xml").unlink()
        now = run_stage([PYTHON, "-c", NOW, compiled])
        counts = {int(before.stdout.split()[-1]), int(now.stdout.split()[-1])}
        print(f"compiled file {compiled.stat().st_size / 1e9:.2f} GB; templates seen by the workers: "
              f"{'EQUAL' if len(counts) == 1 else 'DIFFERENT'} ({', '.join(map(str, sorted(counts)))})")
        print(f"{'':38s} {'CPU s':>8s} {'wall s':>8s} {'peak RSS MB':>12s}")
        for label, m in (("before, per extract job: merge + parse", before), ("now, once: compile_templates", once),
                         (f"  the same, {args.processes} processes", parallel),
                         ("now, per extract job: load compiled", now)):
            print(f"{label:38s} {m.cpu:8.1f} {m.wall:8.1f} {m.rss_mb:12.0f}")
        print(f"per extract job: {before.cpu / now.cpu:.0f}x less CPU ({before.cpu:.1f} -> {now.cpu:.1f} s) and "
              f"{size / 1e9:.2f} GB less written; over {args.parts} jobs {args.parts * before.cpu:.0f} -> "
              f"{once.cpu + args.parts * now.cpu:.0f} CPU s, the compile included")
        print(f"compile in {args.processes} processes: files {'EQUAL' if same else 'DIFFERENT'}; {parallel.cpu:.1f} CPU s "
              f"vs {once.cpu:.1f} in one (wall here on {os.cpu_count()} cores: {parallel.wall:.1f} vs "
              f"{once.wall:.1f} s)")


if __name__ == "__main__":
    main()
