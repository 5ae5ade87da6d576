"""Benchmark: every data stage's per-core rate on a replicated real-shaped dump, projected to full English Wikipedia.

    python benchmarks/full_dump_projection.py [--mb 40] [--nodes 1 8] [--cores-per-node 128]

Builds a bz2 dump of --mb MB of XML from sample/enwiki-sample-pages-articles.xml's pages (up to GBs), then runs
each stage as the DAG does, one process each, on one core (processes/threads 1): extract (real wikiextractor),
format, shard (256 + 256), vocab (trained, twice: fixed cost + per-MB), tokenize and encode (seq 128 and 512) on
the whole text, and hdf5_dir's checksumming. Rates are per CPU second (the process and its children, from
wait4), so a shared machine slows the wall clock more than the figures.

The projection scales each stage's work to the full dump (FULL below), splits it over the DAG's jobs (one per
dump part for extract/format, one streaming shard pass, one job per shard for tokenize/encode) with the threads
its rule declares (rules/*.smk `threads:`), runs floor(cores / threads) jobs at a time per node, and adds the
stages up (a stage waits for the one before: an upper bound, as Snakemake overlaps parts of neighbouring stages).
Serial parts are modelled where the code has them: wikiextractor's single mapper process reads (and bz2-
decompresses) the dump twice, template pass then page pass, whatever --processes; format trains Punkt on its
input's first 20 M characters before splitting in parallel.
"""
import argparse
import hashlib
import json
import math
import pickle
import re
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from wikipedia_sample import ROOT, SAMPLE_XML, replicate_dump, run_stage  # noqa: E402

PYTHON = sys.executable
FULL = {  # the full English Wikipedia dump the projection is for
    "bz2_gb": 22, "xml_gb": 95, "articles": 6.8e6, "tokens": 4.0e9, "dump_parts": 60,
    "n_training_shards": 256, "n_test_shards": 256, "vocab_training_shards": 32, "test_fraction": 0.1,
}
TARGET_HOURS = 0.25
VOCAB_RUNS = (16, 128)  # training shards the vocab is trained on, twice: a fixed cost and a cost per MB
PREDICTIONS = {128: 20, 512: 80}
# The rule of each stage in rules/*.smk (its `threads:` is read from there) and its job count on the full DAG.
RULES = {"extract": "extract_wikipedia", "format": "format", "shard": "shard", "vocab": "vocab",
         "tokenize": "tokenize", "encode": "encode", "hdf5_dir": "hdf5_dir"}
# What would bring a held-back stage down (printed with the figures that show it).
FIXES = {
    "extract": "Would: more, smaller parts (the multistream index cuts the dump at any page boundary), or one "
               "parallel decompression (lbzip2) to plain XML that wikiextractor reads without bz2.",
    "format": "Would: Punkt trained once on the first part (or a supplied format.punkt_model) instead of per job.",
    "shard": "Would: shards written in parallel, e.g. each part's documents assigned by a deterministic hash and "
             "each shard concatenated by its own job.",
    "vocab": "Would: a given vocab.file (Google's, as NVIDIA uses), or the trainer's threads from `threads:`.",
}
# The wikiextractor mapper's own work, as process_dump does it: skip siteinfo, the template pass over the whole
# input, then the page pass, each page pickled onto the job queue.
MAPPER = """
import pickle, sys
from wikiextractor import WikiExtractor as W
dump = sys.argv[1]
pages = W.decode_open(dump)
for line in pages:
    if '</siteinfo>' in line:
        break
templates, redirects, pages, _ = W.load_and_compact_templates(None, dump, pages)
with templates, redirects:
    for page in W.collect_pages(pages):
        pickle.dumps(page)
"""
PUNKT = """
import sys
from workflow.data.format import read_documents, train_punkt
from pathlib import Path
train_punkt(read_documents(Path(sys.argv[1])), int(sys.argv[2]))
"""


def rule_threads(rule: str) -> int:
    """`threads:` of `rule` in rules/*.smk (1 when the rule declares none, as Snakemake does)."""
    for path in sorted((ROOT / "rules").glob("*.smk")):
        text = path.read_text()
        for match in re.finditer(rf"^\s*rule {rule}:\n(.*?)(?=^\s*rule \w+:|\Z)", text, re.M | re.S):
            threads = re.search(r"^\s*threads:\s*(\d+)\s*$", match.group(1), re.M)
            return int(threads.group(1)) if threads else 1
    raise SystemExit(f"rule {rule} not found in rules/*.smk")


def measure(args, work: Path) -> dict:
    """Run every stage once on the replicated dump; returns sizes and CPU seconds."""
    m = {}
    dump = work / "enwiki-replicated-pages-articles.xml.bz2"
    start = time.perf_counter()
    m["dump"] = replicate_dump(args.mb, dump)
    print(f"dump: {m['dump']['xml_bytes'] / 1e6:.1f} MB XML ({m['dump']['bz2_bytes'] / 1e6:.2f} MB bz2), "
          f"{m['dump']['pages']:,} pages, built in {time.perf_counter() - start:.0f} s", flush=True)
    # What a process costs before it does any work (interpreter, imports; wikiextractor's processes for extract):
    # subtracted below, as it vanishes at full size.
    m["startup"] = {module: run_stage([PYTHON, "-c", f"import {module}"]).cpu for module in
                    ("workflow.data.format", "workflow.data.shard", "workflow.data.tokenize", "workflow.data.encode",
                     "wikiextractor.WikiExtractor")}
    m["startup"]["workflow.data.extract"] = run_stage([PYTHON, "-m", "workflow.data.extract", "--input", SAMPLE_XML,
                                                       "--output", work / "sample.jsonl", "--processes", 1]).cpu
    extracted, formatted = work / "wikipedia.jsonl", work / "wikipedia.txt"
    m["extract"] = run_stage([PYTHON, "-m", "workflow.data.extract", "--input", dump, "--output", extracted,
                              "--processes", 1])
    m["mapper"] = run_stage([PYTHON, "-c", MAPPER, dump])
    m["extracted_bytes"] = extracted.stat().st_size
    m["articles"] = sum(1 for _ in open(extracted, encoding="utf-8"))
    m["format"] = run_stage([PYTHON, "-m", "workflow.data.format", "--input", extracted, "--output", formatted,
                             "--processes", 1])
    m["punkt_chars"] = min(20_000_000, sum(len(json.loads(line)["text"]) for line in open(extracted, encoding="utf-8")))
    m["punkt"] = run_stage([PYTHON, "-c", PUNKT, extracted, 20_000_000])
    m["formatted_bytes"] = formatted.stat().st_size
    # shard's work per MB is tiny next to its startup: it gets the formatted text repeated to --shard-mb MB.
    shard_input = work / "wikipedia_repeated.txt"
    with open(shard_input, "wb") as out:
        for _ in range(max(1, math.ceil(args.shard_mb * 1e6 / m["formatted_bytes"]))):
            out.write(formatted.read_bytes())
    m["shard_bytes"] = shard_input.stat().st_size
    shards = work / "shards"
    m["shard"] = run_stage([PYTHON, "-m", "workflow.data.shard", "--input", shard_input, "--output-dir", shards,
                            "--n-training-shards", FULL["n_training_shards"], "--n-test-shards",
                            FULL["n_test_shards"]])
    training = shards / "training"
    one_thread = {"RAYON_NUM_THREADS": "1"}
    vocab = work / "vocab.txt"
    m["vocab_runs"] = []
    for n_shards in VOCAB_RUNS:
        text_bytes = sum((training / f"shard_{i}.txt").stat().st_size for i in range(n_shards))
        run = run_stage([PYTHON, "-m", "workflow.data.vocab", "--shard-dir", training, "--n-shards", n_shards,
                         "--size", 30522, "--output", vocab], env=one_thread)
        m["vocab_runs"].append((text_bytes, run.cpu))
    tokenized = work / "wikipedia.npz"
    m["tokenize"] = run_stage([PYTHON, "-m", "workflow.data.tokenize", "--text", formatted, "--vocab", vocab,
                               "--output", tokenized, "--threads", 1], env=one_thread)
    with np.load(tokenized) as data:
        m["tokens"] = int(len(data["ids"]))
    for length in (128, 512):
        output = work / f"seq{length}.hdf5"
        m[f"encode{length}"] = run_stage([PYTHON, "-m", "workflow.data.encode", "--tokenized", tokenized, "--vocab",
                                          vocab, "--output", output, "--max-seq-length", length,
                                          "--max-predictions-per-seq", PREDICTIONS[length], "--split", "training",
                                          "--shard-index", 0])
        with h5py.File(output, "r") as handle:
            m[f"instances{length}"] = int(handle["input_ids"].shape[0])
        m[f"hdf5_bytes{length}"] = output.stat().st_size
    start = time.process_time()
    hashed = 0
    for length in (128, 512):
        with open(work / f"seq{length}.hdf5", "rb") as handle:
            digest = hashlib.sha256()
            while block := handle.read(1 << 22):
                digest.update(block)
                hashed += len(block)
    m["sha256_rate"] = hashed / max(time.process_time() - start, 1e-6)
    return m


def net_cpu(m: dict, name: str, module: str) -> float:
    """CPU seconds of stage run `name` without its process startup (kept >= 10% of the total)."""
    return max(m[name].cpu - m["startup"][module], 0.1 * m[name].cpu)


def stages(m: dict) -> list[dict]:
    """Per stage: full-dump work, per-core rate, jobs, threads per job, serial seconds per job."""
    xml_mb = m["dump"]["xml_bytes"] / 1e6
    bytes_per_token = m["formatted_bytes"] / m["tokens"]
    formatted_mb = FULL["tokens"] * bytes_per_token / 1e6
    extracted_mb = formatted_mb * m["extracted_bytes"] / m["formatted_bytes"]
    parts, n_shards = FULL["dump_parts"], FULL["n_training_shards"] + FULL["n_test_shards"]
    punkt_rate = m["punkt_chars"] / net_cpu(m, "punkt", "workflow.data.format")  # chars per CPU second
    split_cpu = max(net_cpu(m, "format", "workflow.data.format") - net_cpu(m, "punkt", "workflow.data.format"), 1e-6)
    (small_mb, small_cpu), (large_mb, large_cpu) = [(b / 1e6, cpu) for b, cpu in m["vocab_runs"]]
    vocab_per_mb = max((large_cpu - small_cpu) / max(large_mb - small_mb, 1e-9), 1e-9)
    vocab_fixed = max(small_cpu - small_mb * vocab_per_mb, 0.0)
    vocab_mb = formatted_mb * (1 - FULL["test_fraction"]) * FULL["vocab_training_shards"] / FULL["n_training_shards"]
    part_chars = extracted_mb * 1e6 / parts  # ~ characters of one part's articles (JSON overhead is small)
    rows = [
        dict(stage="extract", unit="MB XML", work=FULL["xml_gb"] * 1e3, rate=xml_mb / net_cpu(m, "extract", "workflow.data.extract"), jobs=parts,
             cap=xml_mb / net_cpu(m, "mapper", "wikiextractor.WikiExtractor"), note="wikiextractor, bz2 input; cap: its one mapper process"),
        dict(stage="format", unit="MB JSON", work=extracted_mb, rate=m["extracted_bytes"] / 1e6 / split_cpu,
             jobs=parts, serial=min(part_chars, 20e6) / punkt_rate, note="Punkt training first (serial), then split"),
        dict(stage="shard", unit="MB text", work=formatted_mb, rate=m["shard_bytes"] / 1e6 / net_cpu(m, "shard", "workflow.data.shard"),
             jobs=1, note="one streaming pass, 256 + 256 shards"),
        dict(stage="vocab", unit="MB text", work=vocab_mb, rate=1 / vocab_per_mb, jobs=1, serial=vocab_fixed,
             note=f"trained on {FULL['vocab_training_shards']} training shards; a given vocab.txt skips it"),
        dict(stage="tokenize", unit="M tokens", work=FULL["tokens"] / 1e6, rate=m["tokens"] / 1e6 / net_cpu(m, "tokenize", "workflow.data.tokenize"),
             jobs=n_shards, note="one job per shard"),
    ]
    for length in (128, 512):
        per_token = m[f"instances{length}"] / m["tokens"]
        rows.append(dict(stage=f"encode {length}", rule="encode", unit="M instances",
                         work=FULL["tokens"] * per_token / 1e6, rate=m[f"instances{length}"] / 1e6 / net_cpu(m, f"encode{length}", "workflow.data.encode"),
                         jobs=n_shards, note=f"{per_token * 1e3:.2f} instances per 1k tokens, dupe_factor 5"))
    for length in (128, 512):
        hdf5_mb = FULL["tokens"] * m[f"hdf5_bytes{length}"] / m["tokens"] / 1e6
        rows.append(dict(stage=f"hdf5_dir {length}", rule="hdf5_dir", unit="MB HDF5", work=hdf5_mb,
                         rate=m["sha256_rate"] / 1e6, jobs=1, note="sha256 of every shard + hard links"))
    sizes = {"formatted_gb": formatted_mb / 1e3, "extracted_gb": extracted_mb / 1e3, "bytes_per_token": bytes_per_token}
    return rows, sizes


def wall_seconds(row: dict, threads: int, nodes: int, cores: int) -> float:
    """The stage's wall time: equal jobs, floor(cores / threads) at a time per node, each job its serial part
    plus its share of the work at `threads` x the per-core rate (or its serial cap, if lower)."""
    per_job = row["work"] / row["jobs"]
    speed = row["rate"] * min(threads, cores)
    if row.get("cap"):
        speed = min(speed, row["cap"])
    slots = nodes * max(1, cores // threads)
    return math.ceil(row["jobs"] / slots) * (row.get("serial", 0.0) + per_job / speed)


def report(m: dict, args) -> None:
    rows, sizes = stages(m)
    print(f"\nmeasured (1 core each, CPU seconds; machine shared, so wall clock is slower): "
          f"{m['articles']:,} articles, {m['extracted_bytes'] / 1e6:.1f} MB JSON, {m['formatted_bytes'] / 1e6:.1f} MB "
          f"text, {m['tokens']:,} tokens ({sizes['bytes_per_token']:.2f} bytes/token, vocab trained on this text)")
    print("  process startup (subtracted): " + ", ".join(f"{k.split('.')[-1]} {v:.2f} s" for k, v in m["startup"].items()))
    print(f"  extract   {m['extract'].cpu:7.1f} s CPU ({m['extract'].wall:.1f} s wall), of which wikiextractor's "
          f"mapper (bz2 read twice): {m['mapper'].cpu:.1f} s")
    print(f"  format    {m['format'].cpu:7.1f} s CPU, of which Punkt training on {m['punkt_chars'] / 1e6:.1f} M chars: "
          f"{m['punkt'].cpu:.1f} s")
    for (text_bytes, cpu), n in zip(m["vocab_runs"], VOCAB_RUNS):
        print(f"  vocab     {cpu:7.1f} s CPU on {n} training shards ({text_bytes / 1e6:.1f} MB)")
    print(f"  shard     {m['shard'].cpu:7.1f} s CPU on {m['shard_bytes'] / 1e6:.0f} MB (the text repeated), peak RSS "
          f"{m['shard'].rss_mb:.0f} MB")
    for name in ("tokenize", "encode128", "encode512"):
        print(f"  {name:9s} {m[name].cpu:7.1f} s CPU, peak RSS {m[name].rss_mb:.0f} MB")
    print(f"\nfull dump assumed: {FULL['bz2_gb']} GB bz2 = {FULL['xml_gb']} GB XML in {FULL['dump_parts']} parts, "
          f"{FULL['articles'] / 1e6:.1f} M articles, {FULL['tokens'] / 1e9:.0f} B tokens -> "
          f"{sizes['formatted_gb']:.1f} GB text (measured bytes/token), {sizes['extracted_gb']:.1f} GB JSON; "
          f"{FULL['n_training_shards']} + {FULL['n_test_shards']} shards; download excluded")
    header = "".join(f" {f'{n} node' + ('s' if n > 1 else ''):>10s}" for n in args.nodes)
    print(f"\n{'stage':12s} {'work':>21s} {'rate/core (CPU)':>11s} {'jobs':>5s} {'thr':>4s} {'cap/job':>9s}{header}  note")
    totals = {n: 0.0 for n in args.nodes}
    without_vocab = {n: 0.0 for n in args.nodes}
    for row in rows:
        threads = args.threads.get(row["stage"].split()[0], rule_threads(RULES[row["stage"].split()[0]]))
        walls = {n: wall_seconds(row, threads, n, args.cores_per_node) for n in args.nodes}
        for n in args.nodes:
            totals[n] += walls[n]
            without_vocab[n] += walls[n] if row["stage"] != "vocab" else 0.0
        cap = f"{row['cap']:.1f}/s" if row.get("cap") else (f"+{row['serial']:.0f}s" if row.get("serial") else "")
        cells = "".join(f" {walls[n]:9.0f}s" for n in args.nodes)
        print(f"{row['stage']:12s} {row['work']:9.0f} {row['unit']:>11s} {row['rate']:9.2f}/s "
              f"{row['jobs']:5d} {threads:4d} {cap:>9s}{cells}  {row['note']}")
    print(f"{'total':12s} {'':21s} {'':11s} {'':5s} {'':4s} {'':9s}" + "".join(f" {totals[n]:9.0f}s" for n in args.nodes)
          + "  stages in sequence (upper bound)")
    print(f"{'  in hours':12s} {'':21s} {'':11s} {'':5s} {'':4s} {'':9s}" + "".join(f" {totals[n] / 3600:9.2f}h" for n in args.nodes)
          + f"  target <= {TARGET_HOURS} h on 1 node: "
          + ("MET" if totals[min(args.nodes)] / 3600 <= TARGET_HOURS else "MISSED"))
    print(f"{'  given vocab':12s} {'':21s} {'':11s} {'':5s} {'':4s} {'':9s}"
          + "".join(f" {without_vocab[n] / 3600:9.2f}h" for n in args.nodes) + "  with vocab.file (e.g. Google's)")
    ideal = sum(row["work"] / row["rate"] for row in rows) / args.cores_per_node
    print(f"\nall stages' CPU work spread perfectly over one node's {args.cores_per_node} cores: {ideal / 3600:.2f} h "
          f"(the target needs <= {TARGET_HOURS} h)")
    print(f"what holds each stage back on 1 node (its wall vs its work spread over {args.cores_per_node} cores):")
    for row in rows:
        stage = row["stage"].split()[0]
        threads = args.threads.get(stage, rule_threads(RULES[stage]))
        wall = wall_seconds(row, threads, 1, args.cores_per_node)
        spread = row["work"] / row["rate"] / args.cores_per_node
        if wall < 60 and wall < 2 * spread + 30:
            continue
        busy = min(row["jobs"] * threads, args.cores_per_node)
        reasons = []
        if busy < args.cores_per_node:
            reasons.append(f"{row['jobs']} job(s) x {threads} thread(s) keep {busy} of {args.cores_per_node} cores busy")
        if row.get("cap") and row["cap"] < row["rate"] * threads:
            reasons.append(f"each job's one mapper process reads the bz2 twice at {row['cap']:.1f} MB/s")
        if row.get("serial", 0) >= 1:
            reasons.append(f"{row['serial']:.0f} s serial per job")
        if not reasons:
            continue
        print(f"  {row['stage']:12s} {wall:6.0f} s vs {spread:5.0f} s: " + "; ".join(reasons) + f". {FIXES.get(stage, '')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=40.0, help="MB of XML in the replicated dump (up to GBs)")
    parser.add_argument("--shard-mb", type=float, default=200.0, help="MB of text the shard stage is timed on")
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--cores-per-node", type=int, default=128)
    parser.add_argument("--threads", nargs="*", default=[], metavar="STAGE=N",
                        help="threads per job instead of the rule's, e.g. extract=8 (what-if)")
    parser.add_argument("--workdir", help="keep the intermediate files and measured.pickle here (default: a "
                        "temporary directory)")
    parser.add_argument("--measured", help="WORKDIR/measured.pickle of an earlier run: print its projection only")
    args = parser.parse_args()
    args.threads = {key: int(value) for key, value in (item.split("=") for item in args.threads)}
    if args.measured:  # re-project earlier measurements (other nodes, cores, threads) without rerunning
        report(pickle.loads(Path(args.measured).read_bytes()), args)
        return
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
        measured = measure(args, Path(args.workdir))
        (Path(args.workdir) / "measured.pickle").write_bytes(pickle.dumps(measured))
        report(measured, args)
        return
    with tempfile.TemporaryDirectory() as work:
        report(measure(args, Path(work)), args)


if __name__ == "__main__":
    main()
