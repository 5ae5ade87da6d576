"""Stage 3, format: articles (extract's JSON lines), books (a directory of .txt) or a user's corpus (config
`corpora.<name>`, workflow/data/corpora.py) -> NVIDIA's text layout.

`sentences` style: one sentence per line, a blank line between documents (what shard and tokenize read);
`articles` style: one document per line. Sentences are split with nltk Punkt, offline: either a pre-installed
punkt_tab model directory, or Punkt trained here on the corpus itself; in both, a curated list of abbreviations
and single-letter initials is added, with the corpus language's own (CURATED; nltk's own model is a download, which
air-gapped clusters don't have). Scripts that leave no space between sentences (Chinese, Japanese) are then split
at their own sentence marks (split_cjk), which Punkt cannot see.

Nothing is dropped silently. What is not written is counted by reason in the log and in the `--summary` JSON
(documents, paragraphs, and characters of whitespace-collapsed paragraphs: read = kept + dropped):
- heading: a section title (extract marks wikiextractor's with HEADING_MARK), a book's title or chapter line;
- disambiguation: a "(disambiguation)" page, or one whose prose is only "X may refer to:" and the like;
- no_prose: a document with no prose at all (wikiextractor left nothing but headings, or nothing);
- too_short: a document with less than min_article_chars characters of prose (stubs).
Every other line of an article is prose and is kept, whatever its last character.
"""
import argparse
import collections
import json
import logging
import re
from pathlib import Path
from typing import Iterable, Iterator, NamedTuple, Sequence

from nltk.tokenize.punkt import PunktParameters, PunktSentenceTokenizer, PunktToken, PunktTrainer
from tqdm import tqdm

from workflow.atomic import atomic_path, write_json
from workflow.cli import UserError, run
from workflow.pool import forked_pool
from workflow.data.corpora import Corpus, corpus_documents
from workflow.data.extract import HEADING_MARK

log = logging.getLogger("format")

# Titles and Latin abbreviations that never end a sentence: Punkt's learned statistics may not split after them
# (a corpus where "Lincoln" often starts sentences otherwise splits "Mr. | Lincoln").
NEVER_SENTENCE_FINAL = frozenset(
    """
    mr mrs ms messrs dr prof gen brig col lt maj capt sgt cpl cmdr adm gov sen rep rev hon pres supt insp
    e.g i.e cf vs viz approx ca incl esp fig figs
    """.split()
)
# Single-letter initials (T. S. Eliot, W. B. Yeats); not "i", which ends sentences as a numeral (World War I.).
INITIALS = frozenset("abcdefghjklmnopqrstuvwxyz")
# Abbreviations Punkt cannot be trusted to learn from a small corpus (lower case, no final period); these can end
# a sentence ("... Eastmarsh Foods Inc. It was ..."), so Punkt's evidence still decides after them.
# Deliberately absent: ones that usually end a sentence (etc, a.m, p.m, b.c, a.d).
ABBREVIATIONS = NEVER_SENTENCE_FINAL | INITIALS | frozenset(
    """
    sr jr st mt ft no nos vol vols pp p ed eds ch sec art op al
    jan feb mar apr jun jul aug sep sept oct nov dec mon tue wed thu fri sat sun
    inc ltd co corp bros dept univ assn inst est intl natl govt
    u.s u.s.a u.k u.n e.u d.c n.y l.a ph.d m.d b.a m.a b.sc m.sc
    """.split()
)


class Curated(NamedTuple):
    """What Punkt is told rather than left to learn, for one language (lower case, no final period)."""

    never_final: frozenset  # never end a sentence (titles, "z. B."-like forms)
    abbreviations: frozenset  # abbreviations whose end Punkt's evidence still judges
    ordinal_followers: frozenset  # after "<number>." these words mean an ordinal, not a sentence end ("3. Oktober")


# Extra lists by wikipedia.language (or corpora.<name>.language); the English ones hold for every language.
LANGUAGE_CURATED = {
    "de": Curated(
        frozenset("nr dr prof bzw vgl ggf sog bspw insb evtl inkl zzt hl abb kap rd dipl dipl.-ing tel".split()),
        frozenset("""jh jhd mio mrd str abs bd bde hrsg geb gest chr usw ca aufl verf hbf ff ä ö ü
                     mo di mi do fr sa""".split()),
        frozenset("""januar jänner februar märz april mai juni juli august september oktober november dezember
                     jahrhundert jahrhunderts jahrtausend jahrtausends weltkrieg weltkriegs platz mal liga bundesliga
                     klasse auflage armee division hälfte legislaturperiode stock fc jh jhd""".split()),
    ),
}


def curated(language: str | None) -> Curated:
    """The curated lists for `language` (an ISO 639 code, e.g. de; None or unknown: the English ones alone)."""
    extra = LANGUAGE_CURATED.get(language or "en", Curated(frozenset(), frozenset(), frozenset()))
    return Curated(NEVER_SENTENCE_FINAL | extra.never_final, ABBREVIATIONS | extra.never_final | extra.abbreviations,
                   extra.ordinal_followers)


DEFAULT_TRAIN_CHARS = 20_000_000  # Punkt's statistics settle long before this; bounds time and memory
# Below this much training text, Punkt "learns" ordinary words that happen to end sentences (does., sky.) as
# abbreviations; only dotted forms (s.a, e.g) and initials are kept from such a small corpus.
MIN_CHARS_TO_TRUST_LEARNED_WORDS = 5_000_000
BOOK_HEADING_MAX_WORDS = 8  # a book's title, byline or "Chapter 12" line: short, with no sentence punctuation
# a sentence's last character: Latin marks and closers, CJK marks and closers (a book heading ends with none)
_SENTENCE_END = ('.', '!', '?', '"', "'", "\u201d", "\u2019", ")", *"。！？｡」』）…")
CJK_SENTENCE_MARKS = "。！？｡"
CJK_OPENERS = "「『（《【〔〈“‘"
CJK_CLOSERS = "」』）》】〕〉”’"  # kept with the sentence they close
_CJK_MARK = re.compile(f"[{CJK_SENTENCE_MARKS}]")
_CJK_CHARACTER = re.compile("[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]")
_SPACES = re.compile(r"\s+")
# how wikiextractor leaves a disambiguation page once its lists are gone: "Mercury may refer to:"
_DISAMBIGUATION_LEAD = re.compile(r"\b(?:refers?|stands?) (?:to|for):$")
DOCUMENT_DROP_REASONS = ("disambiguation", "no_prose", "too_short")
PARAGRAPH_DROP_REASONS = ("heading", *DOCUMENT_DROP_REASONS)  # a dropped document's prose counts under its reason


class Document(NamedTuple):
    title: str
    text: str
    is_book: bool  # books: paragraphs between blank lines; articles: wikiextractor's one paragraph per line


def _collapsed(text: str) -> str:
    return _SPACES.sub(" ", text).strip()


def article_paragraphs(text: str) -> tuple[list[str], list[str]]:
    """(prose, headings) of an extracted article: each non-blank line is one paragraph, marked lines are headings."""
    prose, headings = [], []
    for line in text.split("\n"):
        if line.startswith(HEADING_MARK):
            headings.append(_collapsed(line[len(HEADING_MARK):]))
        elif paragraph := _collapsed(line):
            prose.append(paragraph)
    return prose, headings


def is_book_heading(paragraph: str) -> bool:
    """A book's title, byline or chapter line: a few words without sentence punctuation at the end (each CJK
    character counts as a word: the script puts no spaces between words)."""
    words = len(paragraph.split()) + len(_CJK_CHARACTER.findall(paragraph))
    return not paragraph.endswith(_SENTENCE_END) and words <= BOOK_HEADING_MAX_WORDS


def book_paragraphs(text: str) -> tuple[list[str], list[str]]:
    """(prose, headings) of a book: paragraphs between blank lines (or one per line without any), lines joined."""
    blocks = re.split(r"\n\s*\n", text) if "\n\n" in text else text.split("\n")
    prose, headings = [], []
    for block in blocks:
        paragraph = _collapsed(block)
        if paragraph:
            (headings if is_book_heading(paragraph) else prose).append(paragraph)
    return prose, headings


def paragraphs_of(document: Document) -> tuple[list[str], list[str]]:
    return (book_paragraphs if document.is_book else article_paragraphs)(document.text)


def document_drop_reason(document: Document, prose: list[str], min_article_chars: int) -> str | None:
    """Why a whole document is not written (one of DOCUMENT_DROP_REASONS), or None to keep it."""
    if not document.is_book and (
        document.title.endswith("(disambiguation)")
        # an article may open with "refers to:" too; a disambiguation page has nothing but such list introductions
        or (prose and _DISAMBIGUATION_LEAD.search(prose[0]) and all(p.endswith(":") for p in prose))
    ):
        return "disambiguation"
    chars = sum(map(len, prose))
    if chars == 0:
        return "no_prose"
    if chars < min_article_chars:
        return "too_short"
    return None


def prose_texts(documents: Iterable[Document]) -> Iterator[str]:
    """The prose of each document, paragraphs separated by blank lines (what Punkt trains on)."""
    for document in documents:
        yield "\n\n".join(paragraphs_of(document)[0])


def read_documents(source: Path | Corpus) -> Iterator[Document]:
    """Raw documents: one per line of extract's JSON lines, one per `*.txt` book of a directory, or a user's corpus'
    (its documents are plain text, as books: paragraphs between blank lines)."""
    if isinstance(source, Corpus):
        for where, text in corpus_documents(source):
            yield Document(where, text, True)
        return
    if source.is_dir():
        books = sorted(source.glob("*.txt"))
        if not books:
            raise UserError(f"{source}: no *.txt books in this directory")
        for book in books:
            yield Document(book.stem, book.read_text(encoding="utf-8", errors="replace"), True)
        return
    if not source.is_file():
        raise UserError(f"{source}: no such file")
    with open(source, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            try:
                article = json.loads(line)
                yield Document(str(article.get("title", "")), article["text"], False)
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as error:
                raise UserError(f"{source}:{number}: not an extracted article ({error})") from error


def train_punkt(texts: Iterable[str], train_chars: int = DEFAULT_TRAIN_CHARS) -> PunktParameters:
    """Punkt parameters learned (unsupervised) from the first `train_chars` characters of prose `texts`, plus ABBREVIATIONS."""
    trainer = PunktTrainer()
    seen = 0
    for text in texts:
        trainer.train(text, finalize=False)
        seen += len(text)
        if seen >= train_chars:
            break
    trainer.finalize_training()
    params = trainer.get_params()
    if seen < MIN_CHARS_TO_TRUST_LEARNED_WORDS:
        params.abbrev_types = {a for a in params.abbrev_types if "." in a or len(a) == 1}
    params.abbrev_types.update(ABBREVIATIONS)
    log.info("Punkt trained on %d characters: %d abbreviations", seen, len(params.abbrev_types))
    return params


def split_cjk(text: str) -> list[str]:
    """`text` split after each run of CJK sentence marks (。！？) and the closing quotes or brackets that follow it,
    except inside a quote or bracket that closes later on (「你好。我很好。」 is one sentence)."""
    if not _CJK_MARK.search(text):
        return [text]
    last_closer = max(text.rfind(closer) for closer in CJK_CLOSERS)
    sentences, start, depth, i = [], 0, 0, 0
    while i < len(text):
        char = text[i]
        i += 1
        if char in CJK_OPENERS:
            depth += 1
        elif char in CJK_CLOSERS:
            depth = max(0, depth - 1)
        elif char in CJK_SENTENCE_MARKS:
            while i < len(text) and text[i] in CJK_SENTENCE_MARKS:
                i += 1
            while i < len(text) and text[i] in CJK_CLOSERS:
                depth, i = max(0, depth - 1), i + 1
            if depth and i > last_closer:  # an opener never closed: it does not hold the rest together
                depth = 0
            if depth == 0:
                sentences.append(text[start:i])
                start = i
    sentences.append(text[start:])
    return [sentence.strip() for sentence in sentences if sentence.strip()]


class CuratedPunkt(PunktSentenceTokenizer):
    """Punkt that never splits after the `curated` never-final words, nor between "<number>." and an ordinal
    follower, whatever its statistics say about the next word; its sentences are then split at CJK marks."""

    def __init__(self, params: PunktParameters, lists: Curated | None = None):
        super().__init__(params)
        self.curated = lists or curated(None)

    def _second_pass_annotation(self, aug_tok1: PunktToken, aug_tok2: PunktToken | None) -> str | None:
        reason = super()._second_pass_annotation(aug_tok1, aug_tok2)
        if aug_tok1.sentbreak and aug_tok2 is not None and (
            aug_tok1.type_no_period in self.curated.never_final
            or (aug_tok1.type_no_period == "##number##" and aug_tok2.type_no_period in self.curated.ordinal_followers)
        ):
            aug_tok1.sentbreak, aug_tok1.abbr = False, True
            return "curated abbreviation"
        return reason

    def tokenize(self, text: str, realign_boundaries: bool = True) -> list[str]:
        return [sentence for piece in super().tokenize(text, realign_boundaries) for sentence in split_cjk(piece)]


PUNKT_TAB_FILES = ("abbrev_types.txt", "collocations.tab", "sent_starters.txt", "ortho_context.tab")


def _lines(path: Path) -> list[str]:
    return [line.rstrip("\n") for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def read_punkt_tab(directory: str | Path) -> PunktParameters:
    """Punkt parameters from a punkt_tab model directory (e.g. nltk_data/tokenizers/punkt_tab/english).

    Read directly (same four tab files nltk's load_punkt_params reads) because nltk confines its loader to
    its own data directories, and a cluster's pre-installed model may live anywhere.
    """
    directory = Path(directory)
    missing = [name for name in PUNKT_TAB_FILES if not (directory / name).is_file()]
    if missing:
        raise UserError(f"{directory}: not a punkt_tab model directory (missing {', '.join(missing)})")
    params = PunktParameters()
    params.abbrev_types = set(_lines(directory / "abbrev_types.txt"))
    params.collocations = {tuple(line.split("\t")) for line in _lines(directory / "collocations.tab")}
    params.sent_starters = set(_lines(directory / "sent_starters.txt"))
    for line in _lines(directory / "ortho_context.tab"):
        word, value = line.split("\t")
        params.ortho_context[word] = int(value)
    return params


def write_punkt_tab(params: PunktParameters, directory: str | Path) -> Path:
    """Save Punkt parameters as a punkt_tab model directory (the format read_punkt_tab reads)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "abbrev_types.txt").write_text("".join(f"{a}\n" for a in sorted(params.abbrev_types)), encoding="utf-8")
    (directory / "collocations.tab").write_text("".join(f"{a}\t{b}\n" for a, b in sorted(params.collocations)), encoding="utf-8")
    (directory / "sent_starters.txt").write_text("".join(f"{a}\n" for a in sorted(params.sent_starters)), encoding="utf-8")
    (directory / "ortho_context.tab").write_text(
        "".join(f"{a}\t{b}\n" for a, b in sorted(params.ortho_context.items())), encoding="utf-8"
    )
    return directory


def load_splitter(punkt_model: str | None, corpus: Path | Corpus | None = None,
                  train_chars: int = DEFAULT_TRAIN_CHARS, language: str | None = None) -> PunktSentenceTokenizer:
    """A Punkt sentence splitter: the punkt_tab model in directory `punkt_model`, else one trained on `corpus`.

    Either way the curated lists of `language` (and English's) hold: abbreviations, never-final words, ordinals.
    """
    lists = curated(language)
    if punkt_model:
        params = read_punkt_tab(punkt_model)
        log.info("Punkt model loaded from %s, plus %d curated abbreviations", punkt_model, len(lists.abbreviations))
    else:
        params = train_punkt(prose_texts(read_documents(corpus)), train_chars)
    params.abbrev_types.update(lists.abbreviations)
    return CuratedPunkt(params, lists)


class DocumentResult(NamedTuple):
    drop_reason: str | None
    prose: tuple[int, int]  # (paragraphs, characters)
    headings: tuple[int, int]  # (paragraphs, characters)
    sentences: list[str]


_splitter: PunktSentenceTokenizer | None = None
_min_article_chars = 0


def _init_worker(splitter: PunktSentenceTokenizer, min_article_chars: int) -> None:
    global _splitter, _min_article_chars
    _splitter, _min_article_chars = splitter, min_article_chars


def split_document(document: Document) -> DocumentResult:
    """One raw document judged and, if kept, sentence-split with the worker's splitter."""
    prose, headings = paragraphs_of(document)
    reason = document_drop_reason(document, prose, _min_article_chars)
    sentences = []
    if reason is None:
        for paragraph in prose:
            sentences.extend(s for s in (_collapsed(s) for s in _splitter.tokenize(paragraph)) if s)
    return DocumentResult(reason, (len(prose), sum(map(len, prose))), (len(headings), sum(map(len, headings))), sentences)


class DropCounts:
    """Documents, paragraphs and characters read, kept, and dropped by reason (headings always count as headings)."""

    UNITS = ("documents", "paragraphs", "characters")

    def __init__(self):
        self.read = collections.Counter()
        self.kept = collections.Counter()
        self.dropped = {unit: dict.fromkeys(DOCUMENT_DROP_REASONS if unit == "documents" else PARAGRAPH_DROP_REASONS, 0)
                        for unit in self.UNITS}

    def add(self, result: DocumentResult) -> None:
        (prose_paragraphs, prose_chars), (heading_paragraphs, heading_chars) = result.prose, result.headings
        self.read.update(documents=1, paragraphs=prose_paragraphs + heading_paragraphs, characters=prose_chars + heading_chars)
        self.dropped["paragraphs"]["heading"] += heading_paragraphs
        self.dropped["characters"]["heading"] += heading_chars
        prose = {"documents": 1, "paragraphs": prose_paragraphs, "characters": prose_chars}
        if result.drop_reason is None:
            self.kept.update(prose)
        else:
            for unit, count in prose.items():
                self.dropped[unit][result.drop_reason] += count

    def as_dict(self) -> dict:
        return {unit: {"read": self.read[unit], "kept": self.kept[unit], "dropped": self.dropped[unit]} for unit in self.UNITS}

    def log_line(self) -> str:
        def reasons(unit):
            return ", ".join(f"{reason} {count}" for reason, count in self.dropped[unit].items() if count) or "none"

        return "; ".join(f"{unit}: {self.read[unit]} read, {self.kept[unit]} kept, dropped {reasons(unit)}" for unit in self.UNITS)


def format_corpus(
    source: str | Path | Corpus,
    output: str | Path,
    style: str = "sentences",
    min_article_chars: int = 200,
    punkt_model: str | None = None,
    processes: int = 1,
    train_chars: int = DEFAULT_TRAIN_CHARS,
    summary: str | Path | None = None,
    language: str | None = None,
) -> dict:
    """Write the documents of `source` (JSON lines, a books directory or a user's corpus) to `output` in `style`,
    split with the curated lists of `language`.

    Returns (and writes to `summary`, if given) what was read, kept and dropped by reason, and the sentence count.
    """
    source = source if isinstance(source, Corpus) else Path(source)
    output = Path(output)
    label = f"corpora.{source.name}: {source.path}" if isinstance(source, Corpus) else str(source)
    if style not in ("sentences", "articles"):
        raise UserError(f"format style {style!r}: expected 'sentences' or 'articles'")
    splitter = load_splitter(punkt_model, source, train_chars, language)
    counts = DropCounts()
    sentences_written = 0
    with atomic_path(output) as temporary, open(temporary, "w", encoding="utf-8") as out:
        with forked_pool(max(1, processes), _init_worker, (splitter, min_article_chars)) as pool:
            results = pool.imap(split_document, read_documents(source), chunksize=16)  # ordered: deterministic
            for result in tqdm(results, desc=f"format {source.name}", unit=" docs", disable=None):
                counts.add(result)
                if result.drop_reason is not None:
                    continue
                sentences_written += len(result.sentences)
                if style == "sentences":
                    out.write("\n".join(result.sentences) + "\n\n")
                else:
                    out.write(" ".join(result.sentences) + "\n")
        if counts.kept["documents"] == 0:
            raise UserError(
                f"{label}: empty corpus: none of its {counts.read['documents']} documents has "
                f"min_article_chars={min_article_chars} characters of prose"
            )
        report = {"input": label, "output": str(output), **counts.as_dict(), "sentences": sentences_written}
        if summary is not None:
            write_json(summary, report)
    log.info("%s -> %s: %d sentences; %s", label, output, sentences_written, counts.log_line())
    return report


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m workflow.data.format", description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", help="extract's JSON lines, or a directory of .txt books")
    source.add_argument("--corpus", help="a user's corpus: its config section as JSON, with its name under 'name'")
    parser.add_argument("--output", required=True)
    parser.add_argument("--summary", default=None, help="JSON file: documents/paragraphs/characters read, kept, dropped by reason")
    parser.add_argument("--style", choices=["sentences", "articles"], default="sentences")
    parser.add_argument("--min-article-chars", type=int, default=200)
    parser.add_argument("--punkt-model", default=None, help="punkt_tab model directory (default: train on the input)")
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--train-chars", type=int, default=DEFAULT_TRAIN_CHARS, help="characters Punkt trains on")
    parser.add_argument("--language", default=None, help="the text's language (ISO 639 code): its curated lists")
    args = parser.parse_args(argv)
    if args.corpus:
        section = json.loads(args.corpus)
        source = Corpus.from_config(section.pop("name"), section)
    else:
        source = args.input
    format_corpus(source, args.output, args.style, args.min_article_chars, args.punkt_model or None,
                  args.processes, args.train_chars, args.summary, args.language or None)


if __name__ == "__main__":
    run(main)
