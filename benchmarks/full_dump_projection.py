"""Benchmark: every data stage's per-core rate on a replicated real-shaped dump, projected to full English Wikipedia.

    python benchmarks/full_dump_projection.py [--mb 40] [--novel 0.07] [--nodes 1 8] [--cores-per-node 128]

Measures: builds a bz2 dump of --mb MB of XML from sample/enwiki-sample-pages-articles.xml's pages, then runs each
stage's real command as its rule does, one process each, on one core: wikipedia_templates (the part's template
pages), extract_wikipedia (real wikiextractor, --templates), punkt (ONE model for all parts), format (with that
model), shard (pass 1 timed apart: it runs in parallel over the parts), vocab (trained at two sizes: fixed cost +
per MB, on 2 threads, its CPU split into the main thread's (serial) and the rayon pool's and histogram processes'
(parallel); also on 1 thread against 2 threads on the same input, whose files must be equal), tokenize and encode (seq 128 and 512) and hdf5_dir's checksumming. Text from format on is given
--novel of its words new (benchmarks/wikipedia_sample.py with_novel_words), as a real shard keeps meeting new words
while the repeated sample does not. Rates are per CPU second (the process and its children, from wait4), so a
shared machine slows the wall clock more than the figures.

Projects: each stage's work scaled to the full dump (FULL below), split into the DAG's jobs (per dump part:
templates, extract, format; one punkt; one shard with its threads; one vocab with its threads; per shard: tokenize;
per shard and phase: encode; per phase: hdf5_dir), each job's threads read from its rule in rules/*.smk, each job
paying its measured process startup. The jobs are then scheduled as Snakemake would on N nodes x C cores, each
job taking `threads` cores of one node as soon as its inputs exist: every part's extract waits for the templates
of ALL parts, punkt for every extract, format for punkt, shard for every format, vocab for shard, tokenize for
vocab, while each shard's encode follows its own tokenize (pipelined) and hdf5_dir waits for its phase's encodes.
The wall time is that schedule's end. Serial parts are modelled where the code has them: wikiextractor's one mapper
process reads (and bz2-decompresses) its part, whatever --processes; shard's pass 2 streams in corpus order; the
vocab trainer's main thread (its merge loop, conversion, I/O) is serial, the rest (word counting, merge updates,
character histogram) is split over its threads.
"""
import argparse
import bz2
import hashlib
import heapq
import json
import math
import pickle
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from wikipedia_sample import ROOT, SAMPLE_XML, replicate_dump, run_stage  # noqa: E402

sys.path.insert(0, str(ROOT))

PYTHON = sys.executable
FULL = {  # the full English Wikipedia dump the projection is for
    "bz2_gb": 22, "xml_gb": 95, "articles": 6.8e6, "tokens": 4.0e9, "dump_parts": 60,
    "n_training_shards": 256, "n_test_shards": 256, "vocab_training_shards": 32, "test_fraction": 0.1,
    "punkt_chars": 20_000_000,
}
TARGET_HOURS = 0.25
PREDICTIONS = {128: 20, 512: 80}
# The rule behind each stage (its `threads:` is read from rules/*.smk).
RULES = {"templates": "wikipedia_templates", "extract": "extract_wikipedia", "punkt": "punkt", "format": "format",
         "shard": "shard", "vocab": "vocab", "tokenize": "tokenize", "encode": "encode", "hdf5_dir": "hdf5_dir"}
# What would bring a held-back stage down (printed with the figures that show it).
FIXES = {
    "templates": "Would: one pass per part for templates and articles (the part is decompressed twice now).",
    "extract": "Would: a faster extractor per core (wikiextractor's template expansion and cleaning in Python "
               "are the cost), or more nodes; per job, wikiextractor's one mapper caps it beyond its cap/threads.",
    "punkt": "Would: a supplied format.punkt_model (no training), or training on fewer characters.",
    "shard": "Would: pass 2 written in parallel, e.g. each part's documents appended to their shards by one job "
             "per part, then concatenated per shard in part order.",
    "vocab": "Would: a given vocab.file (Google's, as NVIDIA uses), fewer vocab.training_shards, or more threads.",
}
# The wikiextractor mapper's own work, as process_dump does it with --templates: skip siteinfo, load the template
# file, then one pass over the part's pages, each page pickled onto the job queue.
MAPPER = """
import pickle, sys
from wikiextractor import WikiExtractor as W
dump, templates = sys.argv[1:3]
pages = W.decode_open(dump)
for line in pages:
    if '</siteinfo>' in line:
        break
templates, redirects, pages, _ = W.load_and_compact_templates(templates, dump, pages)
with templates, redirects:
    for page in W.collect_pages(pages):
        pickle.dumps(page)
"""
SHARD_PASS1 = """
import sys
from pathlib import Path
from workflow.data.shard import measure
measure([Path(p) for p in sys.argv[1:]], "sentences", 1)
"""


def rule_threads(rule: str) -> int:
    """`threads:` of `rule` in rules/*.smk (1 when the rule declares none, as Snakemake does); of a rule defined
    in two branches (vocab: copied or trained), the larger."""
    found = []
    for path in sorted((ROOT / "rules").glob("*.smk")):
        text = path.read_text()
        for match in re.finditer(rf"^\s*rule {rule}:\n(.*?)(?=^\s*rule \w+:|^\S|\Z)", text, re.M | re.S):
            threads = re.search(r"^\s*threads:\s*(\d+)\b", match.group(1), re.M)
            found.append(int(threads.group(1)) if threads else 1)
    if not found:
        raise SystemExit(f"rule {rule} not found in rules/*.smk")
    return max(found)


NOVEL_TEXT = """
import math, sys
from pathlib import Path
from benchmarks.wikipedia_sample import with_novel_words
source, megabytes, output, fraction, seed = Path(sys.argv[1]), float(sys.argv[2]), Path(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
text = source.read_text(encoding="utf-8")
text = text * math.ceil(megabytes * 1e6 / len(text.encode("utf-8")))
cut = text.find("\\n\\n", int(megabytes * 1e6))  # characters ~ bytes: the text is mostly ASCII
output.write_text(with_novel_words(text if cut < 0 else text[: cut + 2], fraction, seed), encoding="utf-8")
"""


def novel_text(source: Path, megabytes: float, output: Path, fraction: float, seed: int) -> Path:
    """`source` repeated (or cut, at a document boundary) to about `megabytes` MB, with `fraction` of its words made
    new (fresh ones in each copy). In a child process: this one stays small, so the stages' peak RSS (wait4 counts
    the forked parent's pages) is their own."""
    run_stage([PYTHON, "-c", NOVEL_TEXT, source, megabytes, output, fraction, seed])
    return output


def bz2_rates(dump: Path, megabytes: float = 20.0) -> dict:
    """MB of XML per CPU second that bz2 decompresses: the replicated dump (far more compressible than a real one)
    vs the bundled real export's bz2 (compressed as exported), decompressed over and over."""
    real = SAMPLE_XML.with_name(SAMPLE_XML.name + ".bz2").read_bytes()
    start, size = time.process_time(), 0
    while size < megabytes * 1e6:
        size += len(bz2.decompress(real))
    rates = {"real": size / 1e6 / (time.process_time() - start), "real_ratio": size / (size // len(bz2.decompress(real))) / len(real)}
    start, size = time.process_time(), 0
    with bz2.open(dump) as stream:
        while block := stream.read(1 << 22):
            size += len(block)
    rates.update(replicated=size / 1e6 / (time.process_time() - start), replicated_ratio=size / dump.stat().st_size)
    return rates


VOCAB_SPLIT = """
import json, os, resource, sys
shard_dir, n_shards, size, threads, output = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
os.environ.update(RAYON_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="true")  # before tokenizers' pool starts
from workflow.data.vocab import train_vocab
train_vocab([f"{shard_dir}/shard_{i}.txt" for i in range(n_shards)], output, size, True, threads=threads)

def cpu(task):  # user + system seconds of one thread of this process
    fields = open(f"/proc/self/task/{task}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

main = cpu(os.getpid())
children = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"serial": main, "parallel": sum(map(cpu, os.listdir("/proc/self/task"))) - main
                  + children.ru_utime + children.ru_stime}))
"""


def vocab_run(shard_dir: Path, n_shards: int, size: int, threads: int, output: Path):
    return run_stage([PYTHON, "-m", "workflow.data.vocab", "--shard-dir", shard_dir, "--n-shards", n_shards,
                      "--size", size, "--threads", threads, "--output", output])


def measure(args, work: Path) -> dict:
    """Run every stage once on the replicated dump; returns sizes and CPU seconds."""
    m = {"novel": args.novel}
    dump = work / "enwiki-replicated-pages-articles.xml.bz2"
    start = time.perf_counter()
    m["dump"] = replicate_dump(args.mb, dump)
    print(f"dump: {m['dump']['xml_bytes'] / 1e6:.1f} MB XML ({m['dump']['bz2_bytes'] / 1e6:.2f} MB bz2), "
          f"{m['dump']['pages']:,} pages, built in {time.perf_counter() - start:.0f} s", flush=True)
    m["bz2"] = bz2_rates(dump)
    # What a process costs before it does any work (interpreter, imports; wikiextractor's processes for extract):
    # subtracted from the rates, then paid once per job in the projection.
    m["startup"] = {module: run_stage([PYTHON, "-c", f"import workflow.data.{module}"]).cpu for module in
                    ("format", "punkt", "shard", "vocab", "tokenize", "encode", "hdf5_dir")}
    m["startup"]["mapper"] = run_stage([PYTHON, "-c", "import wikiextractor.WikiExtractor"]).cpu
    m["startup"]["templates"] = run_stage([PYTHON, "-m", "workflow.data.extract", "--template-pages-only", "--input",
                                           SAMPLE_XML, "--output", work / "sample.templates.xml"]).cpu
    m["startup"]["extract"] = run_stage([PYTHON, "-m", "workflow.data.extract", "--input", SAMPLE_XML, "--output",
                                         work / "sample.jsonl", "--processes", 1]).cpu
    templates, extracted = work / "part.templates.xml", work / "part.jsonl"
    m["templates"] = run_stage([PYTHON, "-m", "workflow.data.extract", "--template-pages-only", "--input", dump,
                                "--output", templates])
    m["extract"] = run_stage([PYTHON, "-m", "workflow.data.extract", "--input", dump, "--output", extracted,
                              "--processes", 1, "--templates", templates])
    m["mapper"] = run_stage([PYTHON, "-c", MAPPER, dump, templates])
    m["extracted_bytes"] = extracted.stat().st_size
    m["articles"] = sum(1 for _ in open(extracted, encoding="utf-8"))
    print(f"extract: {m['articles']:,} articles, {m['extracted_bytes'] / 1e6:.1f} MB JSON", flush=True)
    punkt = work / "punkt"
    m["punkt"] = run_stage([PYTHON, "-m", "workflow.data.punkt", "--input", extracted, "--output", punkt])
    from workflow.data.format import prose_texts, read_documents

    m["punkt_chars"] = min(FULL["punkt_chars"], sum(map(len, prose_texts(read_documents(extracted)))))
    formatted = work / "part.txt"
    m["format"] = run_stage([PYTHON, "-m", "workflow.data.format", "--input", extracted, "--output", formatted,
                             "--summary", work / "part.summary.json", "--punkt-model", punkt, "--processes", 1])
    m["formatted_bytes"] = formatted.stat().st_size
    # From here on the text has new words at a steady rate, as a real corpus does.
    novel = novel_text(formatted, m["formatted_bytes"] / 1e6, work / "novel.txt", args.novel, seed=0)
    m["novel_bytes"] = novel.stat().st_size
    # shard: per-MB work is small next to its startup, so it gets --shard-mb MB as parts (copies of that text)
    n_parts = max(2, math.ceil(args.shard_mb * 1e6 / m["novel_bytes"]))
    parts = [work / "parts" / f"p{index}.txt" for index in range(n_parts)]
    parts[0].parent.mkdir(exist_ok=True)
    for part in parts:
        shutil.copyfile(novel, part)
    m["shard_bytes"] = n_parts * m["novel_bytes"]
    shards = work / "shards"
    m["shard"] = run_stage([PYTHON, "-m", "workflow.data.shard", "--input", *parts, "--output-dir", shards,
                            "--n-training-shards", FULL["n_training_shards"], "--n-test-shards",
                            FULL["n_test_shards"], "--processes", 1])
    m["shard_pass1"] = run_stage([PYTHON, "-c", SHARD_PASS1, *parts])
    for part in parts:
        part.unlink()
    print(f"shard: {m['shard_bytes'] / 1e6:.0f} MB in {m['shard'].cpu:.1f} s CPU", flush=True)
    # vocab: two sizes of fresh new-word text (fixed cost + cost per MB), word counting alone (a vocab no bigger
    # than the alphabet: no merges) and whole; then 1 vs 2 threads on the larger input, whose files must be equal.
    m["vocab_runs"] = []
    for index, megabytes in enumerate(args.vocab_mb):
        directory = work / f"vocab{index}"
        directory.mkdir()
        novel_text(formatted, megabytes / 2, directory / "shard_0.txt", args.novel, seed=index + 1)
        novel_text(formatted, megabytes / 2, directory / "shard_1.txt", args.novel, seed=index + 101)
        text_bytes = sum(path.stat().st_size for path in directory.glob("shard_*.txt"))
        split = json.loads(run_stage([PYTHON, "-c", VOCAB_SPLIT, directory, 2, 30522, 2, work / f"vocab_{index}.txt"]).stdout)
        m["vocab_runs"].append((text_bytes, split["serial"], split["parallel"]))
        print(f"vocab on {text_bytes / 1e6:.0f} MB: {split['serial']:.1f} s CPU serial + {split['parallel']:.1f} s "
              f"parallel", flush=True)
    directory = work / f"vocab{len(args.vocab_mb) - 1}"
    one = vocab_run(directory, 2, 30522, 1, work / "vocab_1thread.txt")
    two = vocab_run(directory, 2, 30522, 2, work / "vocab_2threads.txt")
    m["vocab_threads"] = {1: (one.cpu, one.wall, one.rss_mb), 2: (two.cpu, two.wall, two.rss_mb)}
    vocab = work / f"vocab_{len(args.vocab_mb) - 1}.txt"
    m["vocab_equal"] = (work / "vocab_1thread.txt").read_bytes() == (work / "vocab_2threads.txt").read_bytes() == vocab.read_bytes()
    tokenized = work / "novel.npz"
    m["tokenize"] = run_stage([PYTHON, "-m", "workflow.data.tokenize", "--text", novel, "--vocab", vocab,
                               "--output", tokenized, "--threads", 1], env={"RAYON_NUM_THREADS": "1"})
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


def net_cpu(m: dict, name: str, startup: str) -> float:
    """CPU seconds of stage run `name` without its process startup (kept >= 10% of the total)."""
    return max(m[name].cpu - m["startup"][startup], 0.1 * m[name].cpu)


def linear(points) -> tuple[float, float]:
    """(fixed, per unit) of a line through two (x, y) points, neither below zero."""
    (x0, y0), (x1, y1) = points
    if x1 <= x0:
        raise SystemExit(f"two different sizes are needed to tell a fixed cost from a cost per MB, got {x0} and {x1}")
    slope = max((y1 - y0) / max(x1 - x0, 1e-9), 1e-9)
    return max(y0 - x0 * slope, 0.0), slope


def model(m: dict, threads: dict, given_vocab: bool = False) -> tuple[list[dict], list[dict], dict]:
    """The full dump's stages (work, rate, jobs) and its jobs (seconds at their threads, dependencies)."""
    xml_mb = m["dump"]["xml_bytes"] / 1e6
    parts = FULL["dump_parts"]
    part_xml_mb = FULL["xml_gb"] * 1e3 / parts
    bytes_per_token = m["novel_bytes"] / m["tokens"]
    formatted_mb = FULL["tokens"] * bytes_per_token / 1e6
    extracted_mb = formatted_mb * m["extracted_bytes"] / m["formatted_bytes"]
    train_share = 1 - FULL["test_fraction"]
    n_train, n_test = FULL["n_training_shards"], FULL["n_test_shards"]
    startup = m["startup"]
    # a real dump's bz2 may decompress slower per MB of XML than the replicated one: the difference is added
    bz2_extra = max(0.0, 1 / m["bz2"]["real"] - 1 / m["bz2"]["replicated"])  # CPU seconds per MB of XML
    rate = {  # per CPU second of one core
        "templates": 1 / (net_cpu(m, "templates", "templates") / xml_mb + bz2_extra),
        "extract": 1 / (net_cpu(m, "extract", "extract") / xml_mb + bz2_extra),
        "mapper": 1 / (net_cpu(m, "mapper", "mapper") / xml_mb + bz2_extra),
        "punkt": m["punkt_chars"] / net_cpu(m, "punkt", "punkt"),
        "format": m["extracted_bytes"] / 1e6 / net_cpu(m, "format", "format"),
        "shard_pass1": m["shard_bytes"] / 1e6 / net_cpu(m, "shard_pass1", "shard"),
        "shard_pass2": m["shard_bytes"] / 1e6 / max(m["shard"].cpu - m["shard_pass1"].cpu, 1e-6),
        "tokenize": m["tokens"] / 1e6 / net_cpu(m, "tokenize", "tokenize"),
    }
    serial_fixed, serial_per_mb = linear([(b / 1e6, serial) for b, serial, _ in m["vocab_runs"]])
    parallel_fixed, parallel_per_mb = linear([(b / 1e6, parallel) for b, _, parallel in m["vocab_runs"]])
    vocab_mb = formatted_mb * train_share * FULL["vocab_training_shards"] / n_train
    t = threads
    jobs, stages = [], []

    def stage(name, unit, work, per_core, n_jobs, note, cap=None):
        stages.append(dict(stage=name, unit=unit, work=work, rate=per_core, jobs=n_jobs, threads=t[name.split()[0]],
                           note=note, cap=cap))

    def job(name, seconds, deps=(), stage_name=None):
        jobs.append(dict(stage=stage_name or name.split("[")[0], name=name, seconds=seconds, deps=list(deps),
                         threads=t[(stage_name or name).split("[")[0].split()[0]]))
        return len(jobs) - 1

    stage("templates", "MB XML", FULL["xml_gb"] * 1e3, rate["templates"], parts, "template pages of each part (bz2 read)")
    template_jobs = [job(f"templates[{p}]", startup["templates"] + part_xml_mb / rate["templates"]) for p in range(parts)]
    extract_speed = min(rate["extract"] * t["extract"], rate["mapper"])
    stage("extract", "MB XML", FULL["xml_gb"] * 1e3, rate["extract"], parts,
          "wikiextractor, bz2 input, --templates of all parts", cap=rate["mapper"])
    extract_jobs = [job(f"extract[{p}]", startup["extract"] + part_xml_mb / extract_speed, template_jobs)
                    for p in range(parts)]
    stage("punkt", "M chars", FULL["punkt_chars"] / 1e6, rate["punkt"] / 1e6, 1,
          f"one model, trained on the first {FULL['punkt_chars'] / 1e6:.0f} M characters of all parts")
    punkt_job = job("punkt", startup["punkt"] + FULL["punkt_chars"] / rate["punkt"], extract_jobs)
    stage("format", "MB JSON", extracted_mb, rate["format"], parts, "Punkt model loaded, split in processes")
    format_jobs = [job(f"format[{p}]", startup["format"] + extracted_mb / parts / (rate["format"] * t["format"]),
                       [punkt_job]) for p in range(parts)]
    pass1 = formatted_mb / (rate["shard_pass1"] * min(t["shard"], parts))
    pass2 = formatted_mb / rate["shard_pass2"]
    stage("shard", "MB text", formatted_mb, 1 / (1 / rate["shard_pass1"] + 1 / rate["shard_pass2"]), 1,
          f"pass 1 parallel ({pass1:.0f} s), pass 2 one stream ({pass2:.0f} s); {n_train} + {n_test} shards")
    shard_job = job("shard", startup["shard"] + pass1 + pass2, format_jobs)
    parallel = parallel_fixed + vocab_mb * parallel_per_mb
    serial = serial_fixed + vocab_mb * serial_per_mb
    if given_vocab:
        stage("vocab", "file", 0, 0, 1, "a given vocab.file, copied")
        vocab_job = job("vocab", startup["vocab"], [shard_job])
    else:
        stage("vocab", "MB text", vocab_mb, 1 / (parallel_per_mb + serial_per_mb), 1,
              f"{FULL['vocab_training_shards']} training shards; {parallel:.0f} s CPU over its threads + {serial:.0f} s "
              f"on the main thread")
        vocab_job = job("vocab", parallel / t["vocab"] + serial, [shard_job])
    train_tokens, test_tokens = FULL["tokens"] * train_share / n_train, FULL["tokens"] * FULL["test_fraction"] / n_test
    shard_tokens = [train_tokens] * n_train + [test_tokens] * n_test
    stage("tokenize", "M tokens", FULL["tokens"] / 1e6, rate["tokenize"], n_train + n_test,
          f"one job per shard, text with {m['novel']:.0%} new words")
    tokenize_jobs = [job(f"tokenize[{s}]", startup["tokenize"] + tokens / 1e6 / (rate["tokenize"] * t["tokenize"]),
                         [vocab_job]) for s, tokens in enumerate(shard_tokens)]
    encoded = {}
    for length in (128, 512):
        per_token = m[f"instances{length}"] / m["tokens"]
        encode_rate = m[f"instances{length}"] / 1e6 / net_cpu(m, f"encode{length}", "encode")
        stage(f"encode {length}", "M instances", FULL["tokens"] * per_token / 1e6, encode_rate, n_train + n_test,
              f"per shard, after its tokenize; {per_token * 1e3:.2f} instances per 1k tokens, dupe_factor 5")
        encode_jobs = [job(f"encode {length}[{s}]", startup["encode"] + tokens * per_token / 1e6 / (encode_rate * t["encode"]),
                           [tokenize_jobs[s]], stage_name=f"encode {length}") for s, tokens in enumerate(shard_tokens)]
        encoded[length] = encode_jobs
    for length in (128, 512):
        encode_jobs = encoded[length]
        hdf5_mb = FULL["tokens"] * m[f"hdf5_bytes{length}"] / m["tokens"] / 1e6
        stage(f"hdf5_dir {length}", "MB HDF5", hdf5_mb, m["sha256_rate"] / 1e6, 1, "sha256 of every shard + hard links")
        job(f"hdf5_dir {length}", startup["hdf5_dir"] + hdf5_mb / (m["sha256_rate"] / 1e6 * t["hdf5_dir"]), encode_jobs,
            stage_name=f"hdf5_dir {length}")
    sizes = {"formatted_gb": formatted_mb / 1e3, "extracted_gb": extracted_mb / 1e3, "bytes_per_token": bytes_per_token,
             "vocab_mb": vocab_mb}
    return stages, jobs, sizes


def schedule(jobs: list[dict], nodes: int, cores: int) -> dict[str, tuple[float, float]]:
    """Greedy list scheduling, as Snakemake: a job starts once its inputs exist on the first node with `threads`
    free cores (threads capped at a node's cores), in DAG order. Returns each stage's (first start, last end)."""
    waiting = [len(j["deps"]) for j in jobs]
    dependents = [[] for _ in jobs]
    for index, j in enumerate(jobs):
        for dep in j["deps"]:
            dependents[dep].append(index)
    free = [cores] * nodes
    ready = [index for index, count in enumerate(waiting) if count == 0]
    running: list[tuple[float, int, int]] = []  # (end, job, node)
    now, starts, ends = 0.0, {}, {}
    while ready or running:
        still = []
        for index in sorted(ready):  # DAG order
            need = min(jobs[index]["threads"], cores)
            node = next((n for n in range(nodes) if free[n] >= need), None)
            if node is None:
                still.append(index)
                continue
            free[node] -= need
            heapq.heappush(running, (now + jobs[index]["seconds"], index, node))
            starts.setdefault(jobs[index]["stage"], now)
        ready = still
        now, index, node = heapq.heappop(running)
        free[node] += min(jobs[index]["threads"], cores)
        ends[jobs[index]["stage"]] = now
        for other in dependents[index]:
            waiting[other] -= 1
            if waiting[other] == 0:
                ready.append(other)
    return {stage: (starts[stage], ends[stage]) for stage in starts}


def report(m: dict, args) -> None:
    threads = {stage: args.threads.get(stage, rule_threads(rule)) for stage, rule in RULES.items()}
    stages, jobs, sizes = model(m, threads)
    print(f"\nmeasured (1 core each, CPU seconds; machine shared, so wall clock is slower): "
          f"{m['articles']:,} articles, {m['extracted_bytes'] / 1e6:.1f} MB JSON, {m['formatted_bytes'] / 1e6:.1f} MB "
          f"text; with {m['novel']:.0%} of words new: {m['tokens']:,} tokens ({sizes['bytes_per_token']:.2f} bytes/token)")
    b = m["bz2"]
    print(f"  bz2 decompression: replicated dump ({b['replicated_ratio']:.0f}:1) {b['replicated']:.0f} MB XML/s, the "
          f"real export's bz2 ({b['real_ratio']:.1f}:1; the full dump's is {FULL['xml_gb'] / FULL['bz2_gb']:.1f}:1) "
          f"{b['real']:.0f} MB/s per core; a slower real one is charged to templates and extract")
    print("  process startup (paid once per job): " + ", ".join(f"{k} {v:.2f} s" for k, v in m["startup"].items()))
    print(f"  templates {m['templates'].cpu:7.1f} s CPU; extract {m['extract'].cpu:.1f} s CPU ({m['extract'].wall:.1f} s "
          f"wall), of which wikiextractor's mapper (reads the bz2 once): {m['mapper'].cpu:.1f} s")
    print(f"  punkt     {m['punkt'].cpu:7.1f} s CPU on {m['punkt_chars'] / 1e6:.1f} M chars; format {m['format'].cpu:.1f} s "
          f"CPU with that model")
    print(f"  shard     {m['shard'].cpu:7.1f} s CPU on {m['shard_bytes'] / 1e6:.0f} MB, of which pass 1 "
          f"{m['shard_pass1'].cpu:.1f} s; peak RSS {m['shard'].rss_mb:.0f} MB")
    for text_bytes, serial, parallel in m["vocab_runs"]:
        print(f"  vocab     {serial + parallel:7.1f} s CPU on {text_bytes / 1e6:.0f} MB, 2 threads: {serial:.1f} s on the "
              f"main thread (serial), {parallel:.1f} s on the pool and the histogram processes")
    (one_cpu, one_wall, one_rss), (two_cpu, two_wall, two_rss) = m["vocab_threads"][1], m["vocab_threads"][2]
    print(f"  vocab     same input: 1 thread {one_wall:.1f} s wall ({one_cpu:.1f} s CPU, peak RSS {one_rss:.0f} MB), 2 threads "
          f"{two_wall:.1f} s wall ({two_cpu:.1f} s CPU, peak RSS {two_rss:.0f} MB); files {'EQUAL' if m['vocab_equal'] else 'DIFFERENT'}")
    for name in ("tokenize", "encode128", "encode512"):
        print(f"  {name:9s} {m[name].cpu:7.1f} s CPU, peak RSS {m[name].rss_mb:.0f} MB")
    print(f"\nfull dump assumed: {FULL['bz2_gb']} GB bz2 = {FULL['xml_gb']} GB XML in {FULL['dump_parts']} parts, "
          f"{FULL['articles'] / 1e6:.1f} M articles, {FULL['tokens'] / 1e9:.0f} B tokens -> "
          f"{sizes['formatted_gb']:.1f} GB text (measured bytes/token), {sizes['extracted_gb']:.1f} GB JSON; "
          f"{FULL['n_training_shards']} + {FULL['n_test_shards']} shards; vocab on {sizes['vocab_mb'] / 1e3:.1f} GB; "
          f"download excluded")
    spans = {n: schedule(jobs, n, args.cores_per_node) for n in args.nodes}
    given = {n: schedule(model(m, threads, given_vocab=True)[1], n, args.cores_per_node) for n in args.nodes}
    header = "".join(f" {f'{n} node' + ('s' if n > 1 else '') + ' from-to':>17s}" for n in args.nodes)
    print(f"\n{'stage':12s} {'work':>21s} {'rate/core':>11s} {'jobs':>5s} {'thr':>4s} {'cap/job':>9s}{header}  note")
    for row in stages:
        cap = f"{row['cap']:.1f}/s" if row.get("cap") else ""
        cells = "".join(f" {spans[n][row['stage']][0]:7.0f}-{spans[n][row['stage']][1]:7.0f}s" for n in args.nodes)
        print(f"{row['stage']:12s} {row['work']:9.0f} {row['unit']:>11s} {row['rate']:9.2f}/s "
              f"{row['jobs']:5d} {row['threads']:4d} {cap:>9s}{cells}  {row['note']}")
    end = {n: max(last for _, last in spans[n].values()) for n in args.nodes}
    end_given = {n: max(last for _, last in given[n].values()) for n in args.nodes}
    print(f"{'total':12s} {'':57s}" + "".join(f" {end[n] / 3600:16.2f}h" for n in args.nodes)
          + f"  target <= {TARGET_HOURS} h on 1 node: "
          + ("MET" if end[min(args.nodes)] / 3600 <= TARGET_HOURS else "MISSED"))
    one_thread = {n: max(last for _, last in schedule(model(m, {**threads, "vocab": 1})[1], n, args.cores_per_node).values())
                  for n in args.nodes}
    print(f"{'vocab 1 thr':12s} {'':57s}" + "".join(f" {one_thread[n] / 3600:16.2f}h" for n in args.nodes)
          + "  the vocab trained on one thread (as before its rule had threads)")
    print(f"{'given vocab':12s} {'':57s}" + "".join(f" {end_given[n] / 3600:16.2f}h" for n in args.nodes)
          + "  with vocab.file (e.g. Google's)")
    order = sorted(spans[min(args.nodes)].items(), key=lambda item: item[1])
    print(f"\ncritical path on {min(args.nodes)} node(s), stage spans in start order (tokenize, encode and hdf5_dir "
          f"overlap shard by shard): " + " -> ".join(f"{stage} {stop - start:.0f} s" for stage, (start, stop) in order))
    print(f"vocab threads: the pool's CPU is assumed to split evenly over them, as it did over 2 (its main thread's is "
          f"serial); on the measuring machine 2 threads took {two_wall:.1f} s wall vs 1 thread {one_wall:.1f} s (files "
          f"{'equal' if m['vocab_equal'] else 'DIFFERENT'}): a shared 2-core machine shows no wall-clock scaling")
    cpu = sum(j["seconds"] * min(j["threads"], args.cores_per_node) for j in jobs)
    print(f"\nall jobs' core-seconds spread perfectly over one node's {args.cores_per_node} cores: "
          f"{cpu / args.cores_per_node / 3600:.2f} h; the rest is waiting at the DAG's barriers (every part's extract "
          f"needs all templates, punkt all extracts, shard all formats, tokenize the vocab)")
    print(f"what holds each stage back on 1 node (its span vs its work spread over {args.cores_per_node} cores):")
    span1 = spans[min(args.nodes)]
    for row in stages:
        stage_name, first = row["stage"], row["stage"].split()[0]
        start, stop = span1[stage_name]
        stage_jobs = [j for j in jobs if j["stage"] == stage_name]
        spread = sum(j["seconds"] * min(j["threads"], args.cores_per_node) for j in stage_jobs) / args.cores_per_node
        if stop - start < 60:
            continue
        busy = min(row["jobs"] * row["threads"], args.cores_per_node)
        reasons = []
        if busy < args.cores_per_node:
            reasons.append(f"{row['jobs']} job(s) x {row['threads']} thread(s) keep {busy} of {args.cores_per_node} cores busy")
        if row.get("cap") and row["cap"] < row["rate"] * row["threads"]:
            reasons.append(f"each job's one mapper process reads its part at {row['cap']:.1f} MB/s")
        if not reasons and spread > 0.5 * (stop - start):
            reasons.append(f"work-bound: all cores busy at {row['rate']:.2f} {row['unit']}/s per core")
        if not reasons:
            continue
        print(f"  {stage_name:12s} {stop - start:6.0f} s vs {spread:5.0f} s: " + "; ".join(reasons) + "."
              + (f" {FIXES[first]}" if first in FIXES else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=40.0, help="MB of XML in the replicated dump (up to GBs)")
    parser.add_argument("--novel", type=float, default=0.07,
                        help="fraction of words made new in the text from format on (a real corpus keeps meeting new words)")
    parser.add_argument("--shard-mb", type=float, default=200.0, help="MB of text the shard stage is timed on")
    parser.add_argument("--vocab-mb", type=float, nargs=2, default=[8.0, 32.0],
                        help="MB of text the vocab is trained on (two sizes: fixed cost + cost per MB)")
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--cores-per-node", type=int, default=128)
    parser.add_argument("--threads", nargs="*", default=[], metavar="STAGE=N",
                        help=f"threads per job instead of the rule's, e.g. extract=8 (what-if); stages: {' '.join(RULES)}")
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
