"""Stage 2, extract: MediaWiki XML dump (bz2) -> JSON lines of articles ({"id", "title", "text"}) via wikiextractor.

Runs the real wikiextractor 3.1.0 (parallel processes; it keeps only namespace-0, non-redirect pages, judged by
<ns>, so `--namespaces` is not needed: that flag is about link prefixes) and works around its quirks:
- it drops section titles' markup to a bare `Title.` line, indistinguishable from a one-line paragraph; its own
  `mark_headers` (which its CLI does not expose) is switched on, so they come out as `## Title.` (HEADING_MARK);
- it skips redirects and pages of other namespaces without a word: they are counted by fate in the log (PAGES_LOG);
- it HTML-escapes text by default (`AT&T` -> `AT&amp;T`); only `--html-safe ''` disables that (`False` does not);
  titles come out still escaped, so they are unescaped here;
- `-b` below 200K writes nothing and exits 0, so a size far above any article is passed;
- its `revid` is the contributor's id, not the revision's, so it is dropped;
- a truncated or corrupt bz2 dies with a traceback, and a non-MediaWiki XML yields zero articles with exit 0:
  both become a one-line error naming the file, and no output;
- it keeps the single newlines of the wikitext, which MediaWiki reads as spaces: a sentence wrapped over two lines
  would reach `format` (one paragraph per line) as two; the lines of a paragraph are joined here (blank lines,
  headings, list items, table rows, indented lines and block tags such as <p> and <blockquote> still separate);
- it expands templates with the definitions found in its input file: a dump processed in parts is extracted with
  the template pages of every part (`workflow.data.template_pages` collects them from one part, `workflow.data.templates`
  compiles them all once, `--templates` loads that file in place of wikiextractor's own parse), so each part's
  articles read exactly as they would in the whole dump;
- it leaves an article's <onlyinclude> tags in its text (it drops <noinclude> and <includeonly>): MediaWiki shows
  what they enclose on the article's own page, so the tags are removed and their content kept (ONLYINCLUDE_TAG);
- it fills {{CURRENTYEAR}}, {{CURRENTMONTH}}, {{CURRENTDAY}}, {{CURRENTHOUR}} and {{CURRENTTIME}} from the clock
  (`time.strftime`, before every page), and templates such as {{age}} expand through them: here every date and
  time magic word is the dump's date at 00:00:00 UTC (`--date-file`, DumpDateMagicWords), so the text is the same
  whatever day and second a part is extracted.
"""
from __future__ import annotations  # also runs on PyPy 3.9 (the extract rule)

import argparse
import bz2
import codecs
import collections
import datetime
import html
import json
import logging
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from contextlib import ExitStack
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from workflow.atomic import atomic_path
from workflow.cli import UserError, configure_logging, run
from workflow.data.templates import load_compiled

log = logging.getLogger("extract")

# transclusion markup of pages that other articles include a part of (a season's episode table, a lead): on the
# article's own page MediaWiki shows the enclosed text and not the tags; wikiextractor cleans text still XML-escaped
ONLYINCLUDE_TAG = re.compile(r"&lt;\s*/?\s*onlyinclude\s*/?\s*&gt;", re.IGNORECASE)
MEDIAWIKI_ROOT = re.compile(r"\{http://www\.mediawiki\.org/xml/export-[0-9.]+/\}mediawiki")
OUTPUT_FILE_SIZE = "1G"  # wikiextractor's -b: must be >= 200K or it silently writes nothing
PAGES_LOG = "pages of the dump:"
HEADING_MARK = "## "  # wikiextractor's mark_headers prefix; no other line can start with it (`#` lines are lists, dropped)


def tally_pages(lines: Iterable[str], fates: collections.Counter) -> Iterator[str]:
    """The dump's lines, unchanged, counting each page as an article, a redirect or a page of another namespace."""
    ns, redirect = None, False
    for line in lines:
        if "<" in line:  # markup; text inside <text> is XML-escaped, so its lines never start with a tag
            tag = line.lstrip()
            if tag.startswith("<ns>"):
                ns = tag[4:tag.find("<", 4)]
            elif tag.startswith("<redirect"):
                redirect = True
            elif tag.startswith("</page>"):
                fates["other namespaces" if ns != "0" else "redirects" if redirect else "articles"] += 1
                ns, redirect = None, False
        yield line


# Stands for a blank line through wikiextractor's cleaning, which merges a run of blank or punctuation-only lines
# into one newline (its `\n\W+?\n`); a line it keeps (word characters) and `compact` then drops (a list item).
PARAGRAPH_BREAK = "*snakebert-paragraph-break"


def join_wrapped_lines(source: list[str], kept: list[str]) -> list[str]:
    """The lines wikiextractor's `compact` kept of `source` (its input lines), each paragraph on one line: two kept
    lines are joined with a space when they were adjacent lines of `source`; a blank line, a heading, a list item,
    a table row, a dropped line, or an indented (`:`) or preformatted (` `) line between or on either side keeps
    them apart, as MediaWiki renders them apart."""
    joined: list[str] = []
    previous = None  # source index of the last joined line, while the next one may continue it
    position = 0
    for line in kept:
        index = None
        if line.strip() and not line.startswith(HEADING_MARK):
            # compact keeps lines verbatim (indented ones without their colons), so they are found in order
            index = next((i for i in range(position, len(source))
                          if source[i] == line or (source[i][:1] == ":" and source[i].lstrip(":") == line)), None)
        if index is None or source[index][:1] in (":", " "):
            joined.append(line)
            previous = None
        else:
            if previous is not None and index == previous + 1:
                joined[-1] += " " + line
            else:
                joined.append(line)
            previous = index
        position = position if index is None else index + 1
    return joined


# MediaWiki's names (English: the words a {{CURRENTMONTHNAME}} of enwiki writes), not the locale's
MONTH_NAMES = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
               "November", "December")
DAY_NAMES = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
DATE_IN_NAME = re.compile(r".+?-(?P<date>[0-9]{8})-pages-articles")  # dumps.wikimedia.org: enwiki-20241001-...


def date_in_name(name: str) -> datetime.date | None:
    """The dump date a dump site's file name carries (`enwiki-20241001-pages-articles1.xml-p1p41242.bz2`), or None."""
    match = DATE_IN_NAME.match(name)
    try:
        return datetime.datetime.strptime(match["date"], "%Y%m%d").date() if match else None
    except ValueError:  # eight digits that are no date
        return None


def date_magic_words(date: datetime.date) -> dict[str, str]:
    """MediaWiki's date and time magic words at 00:00:00 UTC of `date`, lower-cased as wikiextractor looks them up;
    LOCAL* as CURRENT* (enwiki's local time is UTC). Formats as MediaWiki's: CURRENTDAY unpadded, CURRENTTIME `00:00`,
    CURRENTDOW 0 for Sunday, CURRENTWEEK the ISO week."""
    words = {
        "year": f"{date.year}", "month": f"{date.month:02d}", "month1": f"{date.month}", "month2": f"{date.month:02d}",
        "monthname": MONTH_NAMES[date.month - 1], "monthnamegen": MONTH_NAMES[date.month - 1],
        "monthabbrev": MONTH_NAMES[date.month - 1][:3], "day": f"{date.day}", "day2": f"{date.day:02d}",
        "dayname": DAY_NAMES[date.weekday()], "dow": f"{date.isoweekday() % 7}", "week": f"{date.isocalendar()[1]}",
        "hour": "00", "time": "00:00", "timestamp": f"{date:%Y%m%d}000000",
    }  # fmt: skip
    return {scope + name: value for scope in ("current", "local") for name, value in words.items()}


CLOCK_WORDS = frozenset(date_magic_words(datetime.date(2000, 1, 1)))  # their names


def parse_dump_date(text: str, source: str = "config key 'wikipedia.date'") -> datetime.date:
    """The YYYY-MM-DD date `text` (of wikipedia.date, or a file named by `source`)."""
    try:
        if len(text) == 10:  # Python 3.11's fromisoformat also takes 20241001
            return datetime.date.fromisoformat(text)
    except ValueError:
        pass
    raise UserError(f"{source}: {text!r} is not a date (YYYY-MM-DD)")


def read_dump_date(path: str | Path) -> datetime.date:
    """The date a dump date file holds (`YYYY-MM-DD`, as `python -m workflow.data.download date` writes it)."""
    try:
        return parse_dump_date(Path(path).read_text(encoding="utf-8").strip(), str(path))
    except FileNotFoundError as error:
        raise UserError(f"{path}: no such file") from error


def wikiextractor_main(date: str | None) -> None:
    """wikiextractor's own CLI with its `mark_headers` on (section titles come out as `## Title.` lines), the
    wrapped lines of a paragraph joined (join_wrapped_lines), every date and time magic word that of `date`
    (YYYY-MM-DD, the dump's date; None: none, they expand to nothing), ending with one log line of the pages it read
    by fate (it skips redirects and other namespaces without a word)."""
    from wikiextractor import WikiExtractor
    from wikiextractor import extract as wikiextract
    from wikiextractor.extract import Extractor

    clean_text, compact, substitute = Extractor.clean_text, wikiextract.compact, wikiextract.substituteLineBreakTag
    # wikiextractor turns <p> and the like into one newline (none next to whitespace); a paragraph break keeps the
    # paragraphs apart, and <blockquote> (which it drops as an inline tag) is one too
    paragraph_tags = re.compile("|".join(rf"<{tag}\b.*?>|</\s*{tag}\s*>"
                                         for tag in (*wikiextract.blockSeparatorTags, "blockquote")), re.I | re.S)

    def clean_text_marking_headers(self, text, mark_headers=False, **options):
        text = ONLYINCLUDE_TAG.sub("", text)
        text = "\n".join(line if line.strip() else PARAGRAPH_BREAK for line in text.split("\n"))
        return clean_text(self, text, mark_headers=True, **options)

    def compact_paragraphs(text, **options):
        kept = compact(text, **options)
        return [line.replace(PARAGRAPH_BREAK, " ") for line in join_wrapped_lines(text.split("\n"), kept)]

    def substitute_paragraph_tags(pattern, text, separator=" "):
        if pattern is wikiextract.block_separator_tag_pattern:
            return paragraph_tags.sub(f"\n{PARAGRAPH_BREAK}\n", text)
        return substitute(pattern, text, separator)

    words = {} if date is None else date_magic_words(datetime.date.fromisoformat(date))

    class DumpDateMagicWords(wikiextract.MagicWords):
        """A page's magic words, those of date and time the dump's: the clock's values that wikiextractor's
        clean_text sets before every page (time.strftime) are never taken."""

        def __init__(self):
            super().__init__()
            self.values.update(words)

        def __setitem__(self, name, value):
            if name not in CLOCK_WORDS:
                super().__setitem__(name, value)

    # its workers are forked, so they inherit these
    wikiextract.MagicWords = DumpDateMagicWords  # the one seam: Extractor.__init__ makes its magic words with it
    Extractor.clean_text = clean_text_marking_headers
    WikiExtractor.load_and_compact_templates = load_compiled_templates(WikiExtractor.load_and_compact_templates)
    wikiextract.compact = compact_paragraphs
    wikiextract.substituteLineBreakTag = substitute_paragraph_tags
    fates = collections.Counter()
    collect_pages = WikiExtractor.collect_pages  # runs in this (the reading) process
    WikiExtractor.collect_pages = lambda lines: collect_pages(tally_pages(lines, fates))
    configure_logging("wikiextractor")  # its lines in the workflow's one format too
    WikiExtractor.main()
    log.info("%s %d read: %d articles, %d redirects and %d pages of other namespaces skipped", PAGES_LOG,
             sum(fates.values()), fates["articles"], fates["redirects"], fates["other namespaces"])


def load_compiled_templates(load_and_compact_templates):
    """wikiextractor's template loader, taking a `--templates` file as compiled by workflow.data.templates: its
    blobs go where wikiextractor's parse would have put them (shared memory, `compact_blobs`)."""
    from wikiextractor import template_blob

    def load(template_file, input_file, input, template_prefix=""):
        if not template_file:
            return load_and_compact_templates(template_file, input_file, input, template_prefix)
        count, templates, redirects = load_compiled(template_file)
        log.info("loaded %d compiled templates from %s", count, template_file)
        return template_blob.compact_blobs(*templates), template_blob.compact_blobs(*redirects), input, template_prefix

    return load


def open_dump(path: Path, name: str | None = None, bz2_only: bool = False):
    """Binary stream of the XML inside `path`: bz2 by magic number, else plain XML, unless `bz2_only` or `name` (the
    dump's URL, else `path`) ends in .bz2."""
    name = name or str(path)
    with open(path, "rb") as stream:
        magic = stream.read(3)
    if magic == b"BZh":
        return bz2.open(path, "rb")
    if bz2_only or name.endswith(".bz2"):
        raise UserError(f"{name}: not a bz2 file (bad magic number {magic!r}); dumps are read bz2-compressed, as "
                        "Wikimedia publishes them: compress a plain XML export with bzip2")
    return open(path, "rb")


# byte-order marks of the encodings an XML parser reads but wikiextractor does not (UTF-32's first: it starts as UTF-16's)
_OTHER_UNICODE_BOMS = ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"),
                       (codecs.BOM_UTF16_LE, "UTF-16"), (codecs.BOM_UTF16_BE, "UTF-16"))


def check_utf8(name: str, head: bytes) -> None:
    """Raise UserError unless the first bytes `head` of dump `name` are UTF-8, as Wikimedia and MediaWiki write
    exports: wikiextractor reads nothing else, where an XML parser also takes UTF-16 (a dump re-saved by an editor)."""
    encoding = next((encoding for bom, encoding in _OTHER_UNICODE_BOMS if head.startswith(bom)), None)
    found = encoding
    if encoding is None:
        try:
            codecs.getincrementaldecoder("utf-8")().decode(head, final=False)  # a character cut at the end is fine
            return
        except UnicodeDecodeError as error:
            found, encoding = f"byte {error.start} is {head[error.start:error.start + 1]!r}", "<its encoding>"
    raise UserError(f"{name}: not UTF-8 ({found}); wikiextractor reads UTF-8 dumps only, as Wikimedia writes them: "
                    f"convert it, e.g. bzcat {name.rsplit('/', 1)[-1]} | iconv -f {encoding} -t UTF-8 | bzip2 > "
                    "utf8.xml.bz2")


def check_mediawiki_export(path: Path, name: str | None = None, bz2_only: bool = False) -> None:
    """Raise UserError unless `path` starts like a MediaWiki XML export (UTF-8, root element <mediawiki
    xmlns=export-...>), bz2-compressed if `bz2_only`; the error names `name` (the dump's URL), else `path`."""
    name = name or str(path)
    try:
        with open_dump(path, name, bz2_only) as stream:
            head = stream.read(1 << 20)
    except EOFError as error:
        raise UserError(f"{name}: truncated bz2 ({error})") from error
    except OSError as error:
        raise UserError(f"{name}: corrupt bz2 ({error})") from error
    if not head.strip():
        raise UserError(f"{name}: empty dump")
    check_utf8(name, head)
    parser = ElementTree.XMLPullParser(events=("start",))
    try:
        parser.feed(head)
        events = parser.read_events()
        root, first = (next(events, (None, None))[1] for _ in range(2))  # the root and its first child
    except ElementTree.ParseError as error:
        raise UserError(f"{name}: not a MediaWiki XML export (XML error: {error})") from error
    if root is None or not MEDIAWIKI_ROOT.fullmatch(root.tag):
        tag = "none" if root is None else f"<{root.tag}>"
        raise UserError(f"{name}: not a MediaWiki XML export (root element: {tag})")
    if first is not None and first.tag != root.tag.removesuffix("mediawiki") + "siteinfo":
        # wikiextractor reads the namespaces from <siteinfo> and takes every line up to </siteinfo>: 0 articles
        raise UserError(f"{name}: a MediaWiki XML export without <siteinfo> (its first element is "
                        f"<{first.tag.split('}')[-1]}>): MediaWiki writes one first, and wikiextractor needs it")


def run_wikiextractor(dump: Path, workdir: Path, processes: int, date: datetime.date | None,
                      templates: Path | None = None) -> None:
    """Run wikiextractor on `dump`, its magic words of `date`, writing JSON files under `workdir`; its log goes to our
    stderr."""
    main = f"from workflow.data.extract import wikiextractor_main; wikiextractor_main({date and date.isoformat()!r})"
    command = [
        sys.executable, "-c", main,
        "--json", "--html-safe", "",
        "--processes", str(processes), "-b", OUTPUT_FILE_SIZE, "-o", str(workdir), str(dump),
    ]  # fmt: skip
    if templates is not None:
        command[3:3] = ["--templates", str(templates)]
    log.info("running %s", " ".join(repr(part) if not part else part for part in command))
    tail = collections.deque(maxlen=20)
    traceback = False  # a crash's traceback is summarized in our one-line error, not echoed
    with subprocess.Popen(command, stderr=subprocess.PIPE, text=True, errors="replace") as process:
        for line in process.stderr:
            traceback = traceback or line.startswith("Traceback")
            if not traceback:
                sys.stderr.write(line)
            tail.append(line.rstrip())
    if process.returncode != 0:
        reason = next((line for line in reversed(tail) if line.strip()), f"exit status {process.returncode}")
        if any(word in reason.lower() for word in ("eoferror", "invalid data stream", "oserror")):  # CPython, PyPy
            raise UserError(f"{dump}: truncated or corrupt bz2 ({reason.strip()})")  # found beyond the first MB
        raise UserError(f"{dump}: wikiextractor failed ({reason.strip()})")


def extract(dump: str | Path, output: str | Path, processes: int = 1, templates: str | Path | None = None,
            require_articles: bool = True, date: datetime.date | None = None) -> int:
    """Extract the articles of MediaWiki dump `dump` to JSON lines `output`; return the number of articles.

    `templates`: the compiled template file (workflow.data.templates) to expand templates with; None:
    wikiextractor takes them from `dump` itself. `require_articles`: none is an error (a dump's first pages may
    hold none: punkt reads on). `date`: the day the dump was taken, which {{CURRENTYEAR}} and the other date
    and time magic words are filled from (the workflow passes wikipedia.date or the dump's own); None: the date in
    the dump's file name, else none (they expand to nothing, as an unknown template does); never the clock.
    """
    dump, output = Path(dump), Path(output)
    if not dump.is_file():
        raise UserError(f"{dump}: no such file")
    check_mediawiki_export(dump)
    if templates is not None:
        load_compiled(templates)  # a bad file is one error line here, not a traceback from wikiextractor
    date = date or date_in_name(dump.name)
    if date is None:
        log.warning("%s: no date given or in its name: {{CURRENTYEAR}} and the like expand to nothing", dump)
    else:
        log.info("%s: {{CURRENTYEAR}} and the like of the dump's date, %s", dump, date)
    count = 0
    with ExitStack() as stack:
        temporary = stack.enter_context(atomic_path(output))
        work = stack.enter_context(tempfile.TemporaryDirectory(dir=output.parent, prefix=".wikiextractor-"))
        run_wikiextractor(dump, Path(work) / "json", processes, date, None if templates is None else Path(templates))
        # wikiextractor names its files AA/wiki_00, AA/wiki_01, ..., AB/wiki_00: sorted = written order
        parts = sorted((Path(work) / "json").glob("*/wiki_*"))
        with open(temporary, "w", encoding="utf-8") as out:
            for part in parts:
                with open(part, encoding="utf-8") as lines:
                    for line in lines:
                        article = json.loads(line)
                        record = {"id": article["id"], "title": html.unescape(article["title"]), "text": article["text"]}
                        out.write(json.dumps(record, ensure_ascii=False) + "\n")
                        count += 1
        if count == 0 and require_articles:
            raise UserError(f"{dump}: no articles (namespace 0) in this MediaWiki export")
    log.info("%s: %d articles -> %s", dump, count, output)
    return count


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m workflow.data.extract", description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="MediaWiki pages-articles XML dump (.xml.bz2 or .xml)")
    parser.add_argument("--output", required=True, help="JSON lines: one {id, title, text} per article")
    parser.add_argument("--processes", type=int, default=1, help="wikiextractor worker processes")
    parser.add_argument("--templates", default=None, help="the dump's compiled templates (workflow.data.templates)")
    parser.add_argument("--date-file", default=None,
                        help="the day the dump was taken (YYYY-MM-DD, as `workflow.data.download date` writes it): "
                             "the date of {{CURRENTYEAR}} and the like (default: the date in the dump's name, else "
                             "none: they expand to nothing)")
    args = parser.parse_args(argv)
    date = None if args.date_file is None else read_dump_date(args.date_file)
    extract(args.input, args.output, args.processes, args.templates, date=date)


if __name__ == "__main__":
    run(main)
