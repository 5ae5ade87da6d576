"""Stage 4, shard: formatted corpora -> N training + M test text shards, balanced by size, deterministic from a seed.

Every shard is one sentence per line with a blank line between documents (what tokenize reads). Memory stays
constant in the corpus text: pass 1 only measures document sizes (8 bytes per document), the assignment is
computed from those, and pass 2 streams each document to its shard through bounded write buffers. Both passes run
over the inputs (a dump's parts) in parallel: from the sizes, each input's documents have a known byte offset in
each shard, so every input writes its own stretch of the shards, and the bytes are those of one stream.

Within a shard the documents keep the inputs' order, so `corpora.json` beside the splits (MANIFEST) says which
corpus each one is from: per split and shard, the count of documents of each corpus, in corpus order. An input's
corpus is named by its path: `.../wikipedia/<part>.txt` is wikipedia, any other `<name>.txt` is <name>.
"""
import argparse
import heapq
import logging
from array import array
from contextlib import ExitStack
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
from tqdm import tqdm

from workflow.atomic import atomic_path, write_json
from workflow.cli import UserError, run
from workflow.pool import forked_pool

log = logging.getLogger("shard")

SPLITS = ("training", "test")
MANIFEST = "corpora.json"
BUFFER_BYTES = 64 << 20  # pending shard text held before a flush; bounds memory whatever the corpus size


def documents(path: Path, style: str) -> Iterator[list[str]]:
    """The documents of a formatted file as lists of lines (sentences style) or single lines (articles style)."""
    with open(path, encoding="utf-8") as lines:
        if style == "articles":
            for line in lines:
                if line.strip():
                    yield [line.strip()]
            return
        document: list[str] = []
        for line in lines:
            line = line.strip()
            if line:
                document.append(line)
            elif document:
                yield document
                document = []
        if document:
            yield document


def _document_sizes(path: Path, style: str) -> array:
    """The size in bytes of every document of one formatted file (its size in a shard, blank line included)."""
    if not path.is_file():
        raise UserError(f"{path}: no such file")
    sizes = array("q")  # 8 bytes per document (a list of ints would take ~36 on a 6M-article dump)
    for document in tqdm(documents(path, style), desc=f"measure {path.name}", unit=" docs", disable=None):
        sizes.append(sum(len(line.encode("utf-8")) + 1 for line in document) + 1)
    return sizes


def corpus_of(path: Path) -> str:
    """The corpus a formatted input belongs to: wikipedia for every part of the dump, else its file's stem."""
    return "wikipedia" if path.parent.name == "wikipedia" else path.stem


def corpus_documents_per_shard(inputs: Sequence[Path], per_input: list[np.ndarray], shard_of: np.ndarray,
                               n_training: int, n_test: int) -> dict:
    """MANIFEST's content: the corpora in order, and per split the documents of each corpus in each shard."""
    names = list(dict.fromkeys(corpus_of(path) for path in inputs))
    corpus = np.repeat([names.index(corpus_of(path)) for path in inputs], [len(sizes) for sizes in per_input])
    counts = np.zeros((n_training + n_test, len(names)), np.int64)
    np.add.at(counts, (shard_of, corpus), 1)
    return {"corpora": names, "training": counts[:n_training].tolist(), "test": counts[n_training:].tolist()}


def _map_inputs(function, arguments: list[tuple], processes: int) -> list:
    """function(*each of `arguments`), in order; in `processes` forked processes when there are several."""
    if processes > 1 and len(arguments) > 1:
        with forked_pool(min(processes, len(arguments))) as pool:
            return pool.starmap(function, arguments)
    return [function(*each) for each in arguments]


def measure_inputs(inputs: Sequence[Path], style: str, processes: int = 1) -> list[np.ndarray]:
    """Pass 1: the size in bytes of every document of each input (a dump's part), the inputs measured in parallel."""
    for path in inputs:
        if not path.is_file():
            raise UserError(f"{path}: no such file")
    per_input = _map_inputs(_document_sizes, [(path, style) for path in inputs], processes)
    return [np.frombuffer(sizes, dtype=np.int64).astype(np.int64) for sizes in per_input]


def measure(inputs: Sequence[Path], style: str, processes: int = 1) -> np.ndarray:
    """The size in bytes of every document, in corpus order."""
    return np.concatenate(measure_inputs(inputs, style, processes))


def _write_input(path: Path, style: str, shard_of: np.ndarray, offsets: np.ndarray, shards: list[Path]) -> None:
    """Pass 2 for one input: its documents (shard_of: their shards) written into the shard files from `offsets`
    (per shard, where this input's first document for it goes), through bounded buffers."""
    cursor = offsets.copy()
    pending: dict[int, list[bytes]] = {}
    pending_bytes = 0

    def flush() -> None:
        for shard, texts in pending.items():
            data = b"".join(texts)
            with open(shards[shard], "r+b") as out:
                out.seek(int(cursor[shard]))
                out.write(data)
            cursor[shard] += len(data)
        pending.clear()

    for index, document in enumerate(tqdm(documents(path, style), desc=f"shard {path.name}", unit=" docs",
                                          disable=None)):
        text = ("\n".join(document) + "\n\n").encode("utf-8")
        pending.setdefault(int(shard_of[index]), []).append(text)
        pending_bytes += len(text)
        if pending_bytes >= BUFFER_BYTES:
            flush()
            pending_bytes = 0
    flush()


def assign(sizes: np.ndarray, n_training: int, n_test: int, test_fraction: float, seed: int) -> np.ndarray:
    """Shard of every document: 0..n_training-1 = training shards, n_training.. = test shards.

    A seeded random max(n_test, round(test_fraction * N)) documents go to test. Within each split,
    documents are placed largest first on the currently lightest shard (LPT), ties broken by a seeded
    permutation, so every shard is non-empty and the loads differ by at most one document.
    """
    count = len(sizes)
    n_test_documents = max(n_test, round(test_fraction * count))
    if count - n_test_documents < n_training:
        raise UserError(
            f"corpus too small: {count} documents cannot fill {n_training} training + {n_test} test shards "
            f"(test_fraction {test_fraction} puts {n_test_documents} in test); use fewer shards or more text"
        )
    rng = np.random.default_rng(seed)
    order = rng.permutation(count)
    is_test = np.zeros(count, dtype=bool)
    is_test[order[:n_test_documents]] = True
    shard_of = np.empty(count, dtype=np.int32)
    tiebreak = rng.permutation(count)
    for split_mask, first, n_shards in ((~is_test, 0, n_training), (is_test, n_training, n_test)):
        members = np.flatnonzero(split_mask)
        members = members[np.lexsort((tiebreak[members], -sizes[members]))]
        loads = [(0, shard) for shard in range(n_shards)]
        for document in members:
            load, shard = heapq.heappop(loads)
            shard_of[document] = first + shard
            heapq.heappush(loads, (load + int(sizes[document]), shard))
    return shard_of


def _write_in_parallel(inputs: list[Path], style: str, per_input: list[np.ndarray], shard_of: np.ndarray,
                       shards: list[Path], processes: int) -> None:
    """Pass 2, the inputs in parallel: each input's stretch of every shard starts where the inputs before it end."""
    ends = np.cumsum([len(sizes) for sizes in per_input])
    loads = np.array([np.bincount(shard_of[end - len(sizes):end], weights=sizes, minlength=len(shards))
                      for end, sizes in zip(ends, per_input)], dtype=np.int64).reshape(len(inputs), len(shards))
    offsets = np.cumsum(loads, axis=0) - loads
    _map_inputs(_write_input, [(path, style, shard_of[end - len(sizes):end], offsets[i], shards)
                               for i, (path, end, sizes) in enumerate(zip(inputs, ends, per_input))], processes)


def _append_in_order(inputs: list[Path], style: str, splitter, shard_of: np.ndarray, shards: list[Path]) -> None:
    """Pass 2 as one stream in corpus order, each document split into sentences by `splitter` (articles style)."""
    pending: dict[int, list[str]] = {}
    pending_bytes = 0

    def flush() -> None:
        for shard, texts in pending.items():
            with open(shards[shard], "a", encoding="utf-8") as out:
                out.writelines(texts)
        pending.clear()

    index = 0
    for path in inputs:
        for document in tqdm(documents(path, style), desc=f"shard {path.name}", unit=" docs", disable=None):
            document = [s.strip() for s in splitter.tokenize(document[0]) if s.strip()]
            text = "\n".join(document) + "\n\n"
            pending.setdefault(int(shard_of[index]), []).append(text)
            pending_bytes += len(text)
            index += 1
            if pending_bytes >= BUFFER_BYTES:
                flush()
                pending_bytes = 0
    flush()


def shard_corpus(
    inputs: Sequence[str | Path],
    training_dir: str | Path,
    test_dir: str | Path,
    n_training: int,
    n_test: int,
    test_fraction: float = 0.1,
    seed: int = 12345,
    style: str = "sentences",
    punkt_model: str | None = None,
    processes: int = 1,
    manifest: str | Path | None = None,
) -> dict:
    """Write shard_{i}.txt files into `training_dir` and `test_dir` (and MANIFEST's content to `manifest`, if
    given); return their sizes in bytes per split.

    `processes` measure and write the inputs in parallel; the shards are the same bytes for any number.
    """
    inputs = [Path(path) for path in inputs]
    if n_training < 1 or n_test < 1:
        raise UserError(f"need at least one training and one test shard (got {n_training} and {n_test})")
    if not 0 <= test_fraction < 1:
        raise UserError(f"test_fraction {test_fraction}: must be in [0, 1)")
    per_input = measure_inputs(inputs, style, processes)
    sizes = np.concatenate(per_input)
    shard_of = assign(sizes, n_training, n_test, test_fraction, seed)
    splitter = None
    if style == "articles":  # shards are always one sentence per line: split the one-line documents again
        from workflow.data.format import CuratedPunkt, load_splitter, train_punkt

        splitter = load_splitter(punkt_model) if punkt_model else CuratedPunkt(
            train_punkt(line[0] for path in inputs for line in documents(path, style))
        )
    finals = [Path(training_dir) / f"shard_{i}.txt" for i in range(n_training)]
    finals += [Path(test_dir) / f"shard_{i}.txt" for i in range(n_test)]
    with ExitStack() as stack:
        temporaries = [stack.enter_context(atomic_path(final)) for final in finals]
        for temporary in temporaries:
            temporary.write_bytes(b"")
        if splitter is None:
            _write_in_parallel(inputs, style, per_input, shard_of, temporaries, processes)
        else:  # a re-split document's size is known only once split: one stream in corpus order
            _append_in_order(inputs, style, splitter, shard_of, temporaries)
    if manifest is not None:
        write_json(manifest, corpus_documents_per_shard(inputs, per_input, shard_of, n_training, n_test))
    loads = np.bincount(shard_of, weights=sizes, minlength=n_training + n_test).astype(np.int64)
    report = {"training": loads[:n_training].tolist(), "test": loads[n_training:].tolist()}
    for split in SPLITS:
        values = report[split]
        log.info("%s: %d shards, %d..%d bytes, max/min %.4f", split, len(values), min(values), max(values),
                 max(values) / min(values))
    return report


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m workflow.data.shard", description=__doc__.splitlines()[0])
    parser.add_argument("--input", nargs="+", required=True, help="formatted corpora, in order")
    parser.add_argument("--input-style", choices=["sentences", "articles"], default="sentences")
    parser.add_argument("--punkt-model", default=None, help="articles style only: punkt_tab model directory")
    parser.add_argument("--output-dir", required=True, help="gets training/ and test/ shard folders, whole or not at all")
    parser.add_argument("--n-training-shards", type=int, required=True)
    parser.add_argument("--n-test-shards", type=int, required=True)
    parser.add_argument("--test-fraction", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=12345)
    parser.add_argument("--processes", type=int, default=1, help="inputs measured in parallel (same shards for any)")
    args = parser.parse_args(argv)
    with atomic_path(args.output_dir) as output_dir:
        shard_corpus(args.input, output_dir / "training", output_dir / "test", args.n_training_shards,
                     args.n_test_shards, args.test_fraction, args.seed, args.input_style, args.punkt_model or None,
                     args.processes, output_dir / MANIFEST)


if __name__ == "__main__":
    run(main)
