"""Benchmark: how many articles read the clock: their text would change from one day to the next if the date and
time magic words were taken from the clock (as wikiextractor does) instead of the dump's date.

    python benchmarks/clock_dependent_pages.py [--mb 5] [--dump enwiki-...-pages-articles.xml.bz2 ...]

For the bundled sample, a generated dump of --mb MB of XML (benchmarks/enwiki_pages.py) and any --dump (a real one:
its own template pages are followed), it counts
- the articles that call a date or time magic word ({{CURRENTYEAR}}, {{CURRENTDAY}}, {{LOCALTIME}} ...) directly or
  through templates, transitively (template pages and template redirects followed);
- the articles whose extracted text differs between two consecutive days, and between two days a year apart:
  the real extract run twice, the date given through its one seam, as the clock would give it;
and scales the share to the full dump's 7.0 M articles.
"""
import argparse
import bz2
import datetime
import json
import re
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.enwiki_pages import dump as generated_dump  # noqa: E402
from workflow.data.extract import CLOCK_WORDS, extract  # noqa: E402

SAMPLE = ROOT / "sample" / "enwiki-sample-pages-articles.xml"
FULL_DUMP_ARTICLES = 7.0e6  # enwiki-20241001 (benchmarks/enwiki_pages.py)
DAY = datetime.date(2024, 10, 1)
# a template call's name: what stands between `{{` and the first `|` or `}}` (parser functions `{{#if:` excluded)
CALL = re.compile(r"\{\{\s*(?:safesubst:|subst:)?\s*([^{}|#<>\[\]\n]+?)\s*(?:\||\}\})")
REDIRECT = re.compile(r"#REDIRECT\s*\[\[\s*(?:Template:)?([^\]|#]+)", re.I)


def canonical(name: str) -> str:
    """A template's name as MediaWiki matches it: `Template:` dropped, `_` as space, first letter upper case."""
    name = re.sub(r"^template:", "", name.strip().replace("_", " "), flags=re.I)
    return name[:1].upper() + name[1:]


def pages(path: Path):
    """(namespace, title, is_redirect, text) of every page of a dump."""
    with (bz2.open if path.suffix == ".bz2" else open)(path, "rb") as stream:
        for _event, element in ElementTree.iterparse(stream):
            if element.tag.endswith("}page") or element.tag == "page":
                fields = {child.tag.rsplit("}", 1)[-1]: child for child in element.iter()}
                text = fields["text"].text or "" if "text" in fields else ""
                yield fields["ns"].text, fields["title"].text, "redirect" in fields, text
                element.clear()


def calls(text: str) -> set[str]:
    return {match.group(1) for match in CALL.finditer(text)}


def reads_clock(names: set[str]) -> bool:
    return any(name.lower() in CLOCK_WORDS for name in names)


def clock_dependent_articles(path: Path) -> tuple[int, set[str]]:
    """(articles, the titles of those that reach a date or time magic word, directly or through templates)."""
    templates, articles = {}, {}
    for ns, title, redirect, text in pages(path):
        if ns == "10":
            target = REDIRECT.match(text)
            templates[canonical(title)] = {target.group(1)} if target else calls(text)
        elif ns == "0" and not redirect:
            articles[title] = calls(text)
    clock = {name for name, called in templates.items() if reads_clock(called)}
    while True:  # templates calling one that reads the clock, until none is added
        added = {name for name, called in templates.items()
                 if name not in clock and any(canonical(call) in clock for call in called)}
        if not added:
            break
        clock |= added
    dependent = {title for title, called in articles.items()
                 if reads_clock(called) or any(canonical(call) in clock for call in called)}
    return len(articles), dependent


def changed_articles(path: Path, work: Path, days: tuple[datetime.date, datetime.date]) -> set[str]:
    """The titles of the articles whose extracted text differs between `days` (the real extract, twice)."""
    texts = []
    for day in days:
        output = work / f"{path.stem}-{day}.jsonl"
        extract(path, output, processes=2, date=day)
        texts.append({(record := json.loads(line))["title"]: record["text"]
                      for line in output.read_text(encoding="utf-8").splitlines()})
    return {title for title, text in texts[0].items() if texts[1].get(title) != text}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=5.0, help="MB of XML of the generated dump")
    parser.add_argument("--dump", type=Path, nargs="*", default=[], help="more dumps to count (.xml or .xml.bz2)")
    args = parser.parse_args()
    print(f"{'dump':<26} {'articles':>9} {'reach clock':>12} {'changed +1 day':>15} {'changed +1 year':>16} "
          f"{'share':>7} {'at 7.0 M articles':>18}")
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        generated = work / "generated.xml"
        generated_dump(args.mb, generated)
        for label, path in (("sample", SAMPLE), (f"generated ({args.mb:g} MB)", generated),
                            *((path.name[:26], path) for path in args.dump)):
            n_articles, dependent = clock_dependent_articles(path)
            next_day = changed_articles(path, work, (DAY, DAY + datetime.timedelta(days=1)))
            next_year = changed_articles(path, work, (DAY, DAY.replace(year=DAY.year + 1)))
            share = len(dependent | next_day | next_year) / n_articles
            print(f"{label:<26} {n_articles:>9,} {len(dependent):>12,} {len(next_day):>15,} {len(next_year):>16,} "
                  f"{share:>7.2%} {share * FULL_DUMP_ARTICLES:>18,.0f}")


if __name__ == "__main__":
    main()
