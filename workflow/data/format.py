"""Stage 3, format: articles (extract's JSON lines) or books (a directory of .txt) -> NVIDIA's text layout.

`sentences` style: one sentence per line, a blank line between documents (what shard and tokenize read);
`articles` style: one document per line. Sentences are split with nltk Punkt, offline: either a pre-installed
punkt_tab model directory, or Punkt trained here on the corpus itself plus a curated list of abbreviations
(nltk's own model is a download, which air-gapped clusters don't have).
"""
import argparse
import json
import logging
import multiprocessing
import re
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from nltk.tokenize.punkt import PunktParameters, PunktSentenceTokenizer, PunktTrainer
from tqdm import tqdm

from workflow.atomic import atomic_path
from workflow.cli import UserError, run

log = logging.getLogger("format")

# Abbreviations Punkt cannot be trusted to learn from a small corpus (lower case, no final period).
# Deliberately absent: ones that usually end a sentence (etc, a.m, p.m, b.c, a.d).
ABBREVIATIONS = frozenset(
    """
    mr mrs ms dr prof sr jr st mt ft gen col lt maj capt sgt cmdr adm gov sen rep rev hon pres supt insp
    e.g i.e cf vs viz approx ca incl esp fig figs no nos vol vols pp p ed eds ch sec art op
    jan feb mar apr jun jul aug sep sept oct nov dec mon tue wed thu fri sat sun
    inc ltd co corp bros dept univ assn inst est intl natl govt
    u.s u.s.a u.k u.n e.u d.c n.y l.a ph.d m.d b.a m.a b.sc m.sc
    """.split()
)
DEFAULT_TRAIN_CHARS = 20_000_000  # Punkt's statistics settle long before this; bounds time and memory
# Below this much training text, Punkt "learns" ordinary words that happen to end sentences (does., sky.) as
# abbreviations; only dotted forms (s.a, e.g) and initials are kept from such a small corpus.
MIN_CHARS_TO_TRUST_LEARNED_WORDS = 5_000_000
_SENTENCE_END = ('.', '!', '?', '"', "'", "\u201d", "\u2019", ")")
_INNER_PUNCTUATION = re.compile(r"[.,;:!?\"()]")
_SPACES = re.compile(r"\s+")


def is_heading(line: str) -> bool:
    """Section titles and the like: no final punctuation, or a few words and a period (wikiextractor's `History.`)."""
    if not line.endswith(_SENTENCE_END):
        return True
    words = line.split()
    return len(words) <= 5 and line.endswith(".") and not _INNER_PUNCTUATION.search(line[:-1])


def paragraphs_of(text: str) -> list[str]:
    """The prose paragraphs of a document: blank-line or newline separated, headings dropped, whitespace collapsed."""
    blocks = re.split(r"\n\s*\n", text) if "\n\n" in text else text.split("\n")
    result = []
    for block in blocks:
        paragraph = _SPACES.sub(" ", block).strip()
        if paragraph and not is_heading(paragraph):
            result.append(paragraph)
    return result


def read_documents(source: Path) -> Iterator[str]:
    """Raw document texts: one per line of extract's JSON lines, or one per `*.txt` book of a directory."""
    if source.is_dir():
        books = sorted(source.glob("*.txt"))
        if not books:
            raise UserError(f"{source}: no *.txt books in this directory")
        for book in books:
            yield book.read_text(encoding="utf-8", errors="replace")
        return
    if not source.is_file():
        raise UserError(f"{source}: no such file")
    with open(source, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            try:
                yield json.loads(line)["text"]
            except (json.JSONDecodeError, KeyError, TypeError) as error:
                raise UserError(f"{source}:{number}: not an extracted article ({error})") from error


def train_punkt(texts: Iterable[str], train_chars: int = DEFAULT_TRAIN_CHARS) -> PunktParameters:
    """Punkt parameters learned (unsupervised) from the first `train_chars` characters of `texts`, plus ABBREVIATIONS."""
    trainer = PunktTrainer()
    seen = 0
    for text in texts:
        text = "\n\n".join(paragraphs_of(text))
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


def load_splitter(punkt_model: str | None, corpus: Path | None = None, train_chars: int = DEFAULT_TRAIN_CHARS) -> PunktSentenceTokenizer:
    """A Punkt sentence splitter: the punkt_tab model in directory `punkt_model`, else one trained on `corpus`."""
    if punkt_model:
        log.info("Punkt model loaded from %s", punkt_model)
        return PunktSentenceTokenizer(read_punkt_tab(punkt_model))
    return PunktSentenceTokenizer(train_punkt(read_documents(corpus), train_chars))


_splitter: PunktSentenceTokenizer | None = None


def _init_worker(splitter: PunktSentenceTokenizer) -> None:
    global _splitter
    _splitter = splitter


def split_document(text: str) -> tuple[int, list[str]]:
    """(prose characters, sentences) of one raw document, with the worker's splitter."""
    sentences, chars = [], 0
    for paragraph in paragraphs_of(text):
        chars += len(paragraph)
        sentences.extend(s for s in (_SPACES.sub(" ", s).strip() for s in _splitter.tokenize(paragraph)) if s)
    return chars, sentences


def format_corpus(
    source: str | Path,
    output: str | Path,
    style: str = "sentences",
    min_article_chars: int = 200,
    punkt_model: str | None = None,
    processes: int = 1,
    train_chars: int = DEFAULT_TRAIN_CHARS,
) -> dict:
    """Write the documents of `source` (JSON lines or a books directory) to `output` in `style`; return counts."""
    source, output = Path(source), Path(output)
    if style not in ("sentences", "articles"):
        raise UserError(f"format style {style!r}: expected 'sentences' or 'articles'")
    splitter = load_splitter(punkt_model, source, train_chars)
    kept = dropped = sentences_written = 0
    with atomic_path(output) as temporary, open(temporary, "w", encoding="utf-8") as out:
        with multiprocessing.get_context("fork").Pool(max(1, processes), _init_worker, (splitter,)) as pool:
            results = pool.imap(split_document, read_documents(source), chunksize=16)  # ordered: deterministic
            for chars, sentences in tqdm(results, desc=f"format {source.name}", unit=" docs"):
                if chars < min_article_chars or not sentences:
                    dropped += 1
                    continue
                kept += 1
                sentences_written += len(sentences)
                if style == "sentences":
                    out.write("\n".join(sentences) + "\n\n")
                else:
                    out.write(" ".join(sentences) + "\n")
        if kept == 0:
            raise UserError(
                f"{source}: empty corpus: none of its {dropped} documents has min_article_chars={min_article_chars} characters of prose"
            )
    log.info("%s: %d documents kept, %d dropped, %d sentences -> %s", source, kept, dropped, sentences_written, output)
    return {"documents": kept, "dropped": dropped, "sentences": sentences_written}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m workflow.data.format", description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="extract's JSON lines, or a directory of .txt books")
    parser.add_argument("--output", required=True)
    parser.add_argument("--style", choices=["sentences", "articles"], default="sentences")
    parser.add_argument("--min-article-chars", type=int, default=200)
    parser.add_argument("--punkt-model", default=None, help="punkt_tab model directory (default: train on the input)")
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--train-chars", type=int, default=DEFAULT_TRAIN_CHARS, help="characters Punkt trains on")
    args = parser.parse_args(argv)
    format_corpus(args.input, args.output, args.style, args.min_article_chars, args.punkt_model or None,
                  args.processes, args.train_chars)


if __name__ == "__main__":
    run(main)
