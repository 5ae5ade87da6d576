"""Stage 3a, punkt: one Punkt sentence-splitting model for a corpus that is formatted in parts.

Trained (as `format` would train it on the whole corpus) on the first characters of the extracted parts read in
order, and saved as a punkt_tab directory that every part's `format` job loads: the sentences of an article do not
depend on which part it is in. Only the first parts are read (the rule gives it the first format.punkt_parts), so
it waits for their extracts alone; when they hold fewer characters than it trains on, its log says so.
"""
import argparse
import itertools
import logging
from pathlib import Path
from typing import Sequence

from workflow.atomic import atomic_path
from workflow.cli import run
from workflow.data.format import DEFAULT_TRAIN_CHARS, prose_texts, read_documents, train_punkt, write_punkt_tab

log = logging.getLogger("punkt")


def train_model(inputs: Sequence[str | Path], output: str | Path, train_chars: int = DEFAULT_TRAIN_CHARS) -> Path:
    """Train Punkt on the documents of `inputs` (extract's JSON lines), in order, and write the model to `output`."""
    lengths = []
    texts = (lengths.append(len(text)) or text  # lazy: stops at train_chars
             for text in prose_texts(itertools.chain.from_iterable(read_documents(Path(path)) for path in inputs)))
    params = train_punkt(texts, train_chars)
    if sum(lengths) < train_chars:
        log.warning("the %d inputs hold %d characters of prose, fewer than the %d Punkt trains on: more parts "
                    "(config format.punkt_parts) would give it more", len(inputs), sum(lengths), train_chars)
    with atomic_path(output) as temporary:
        write_punkt_tab(params, temporary)
    log.info("Punkt model of %d inputs -> %s", len(inputs), output)
    return Path(output)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m workflow.data.punkt", description=__doc__.splitlines()[0])
    parser.add_argument("--input", nargs="+", required=True, help="extract's JSON lines of the first parts, in order")
    parser.add_argument("--output", required=True, help="punkt_tab model directory")
    parser.add_argument("--train-chars", type=int, default=DEFAULT_TRAIN_CHARS, help="characters Punkt trains on")
    args = parser.parse_args(argv)
    train_model(args.input, args.output, args.train_chars)


if __name__ == "__main__":
    run(main)
