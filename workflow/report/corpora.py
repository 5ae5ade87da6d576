"""What each corpus gave the pretraining data: documents (read and kept), sentences and tokens, and how many of the
tokens are the vocab's unknown token (text the vocab cannot spell).

    python -m workflow.report.corpora --formatted data/formatted/wikipedia/whole.summary.json ... \
        --manifest data/shards/corpora.json --tokenized data/tokenized --output results/corpora.csv

Documents and sentences are format's (summed over a dump's parts); tokens are tokenize's, both splits, each shard's
`corpus_tokens` and `corpus_unknown_tokens` in the order of shard's corpora.json. A formatted summary is named by its
corpus as shard names its input (workflow.data.shard.corpus_of).
"""
import argparse
import csv
import io
import logging
from pathlib import Path
from typing import Sequence

import numpy as np

from workflow.atomic import write_text
from workflow.cli import run
from workflow.data.shard import SPLITS, corpus_of
from workflow.data.tokenize import load_tokenized
from workflow.report.summary import read_json

log = logging.getLogger(__name__)

COLUMNS = ("corpus", "documents_read", "documents", "sentences", "tokens", "unknown_tokens")


def corpus_statistics(formatted: Sequence[str | Path], manifest: str | Path, tokenized: str | Path) -> list[dict]:
    """One row per corpus (COLUMNS), in corpus order."""
    manifest = read_json(manifest)  # one error line if absent (shards cut by an older version: delete data/shards)
    rows = {name: dict.fromkeys(COLUMNS[1:], 0) | {"corpus": name} for name in manifest["corpora"]}
    for path in map(Path, formatted):
        summary = read_json(path)
        row = rows[corpus_of(path.with_name(path.name.removesuffix(".summary.json") + ".txt"))]
        row["documents_read"] += summary["documents"]["read"]
        row["documents"] += summary["documents"]["kept"]
        row["sentences"] += summary["sentences"]
    blank = set()  # columns some shard lacks: tokenized by an older version (the other counts still hold)
    for split in SPLITS:
        for index in range(len(manifest[split])):
            path = Path(tokenized) / split / f"shard_{index}.npz"
            load_tokenized(path)  # one error line if it is not a tokenized shard
            with np.load(path) as shard:
                for column in ("tokens", "unknown_tokens"):
                    if f"corpus_{column}" not in shard:
                        if column not in blank:
                            log.warning("%s: no corpus_%s (tokenized by an older version): %s left blank", path,
                                        column, column)
                        blank.add(column)
                        continue
                    for name, tokens in zip(manifest["corpora"], shard[f"corpus_{column}"]):
                        rows[name][column] += int(tokens)
    for row in rows.values():
        row.update(dict.fromkeys(blank, ""))
    return list(rows.values())


def to_csv(rows: list[dict]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formatted", nargs="+", required=True, help="format's summary JSONs, every corpus")
    parser.add_argument("--manifest", required=True, help="shard's corpora.json")
    parser.add_argument("--tokenized", required=True, help="tokenize's directory (training/ and test/ .npz)")
    parser.add_argument("--output", required=True, help="CSV to write")
    args = parser.parse_args(argv)
    write_text(args.output, to_csv(corpus_statistics(args.formatted, args.manifest, args.tokenized)))


if __name__ == "__main__":
    run(main)
