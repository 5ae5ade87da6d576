"""Benchmark: every data stage's per-core rate on generated real-shaped pages, projected to full English Wikipedia.

    python benchmarks/full_dump_projection.py [--mb 40] [--novel 0.07] [--nodes 1 8] [--cores-per-node 128]
        [--disk-mb-s 1000] [--submit-s 2] [--group-cores N] [--threads extract=8 ...]

Measures: builds a bz2 dump of --mb MB of XML of real-shaped pages (benchmarks/enwiki_pages.py: its docstring
states the enwiki figures it matches: ~11 KB of XML per article, XML->text ~0.18, templates nested with parser
functions, <ref> citations, infoboxes, tables, redirects and other namespaces), then runs each stage's real command
as its rule does, one process each, on one core: wikipedia_templates (the part's template pages; its scan's and
its decompression threads' CPU apart, from a 2-thread run), compile_templates (its parent's and its worker
processes' CPU apart, from a 2-process run),
compile_templates (on --template-sample generated template pages: once per dump, scaled by the count to enwiki's
~900k), the compiled file's load (what every extract job pays first, same scaling), extract_wikipedia (real
wikiextractor with template expansion, --templates compiled; on CPython, and on PyPy, the rule's interpreter
(envs/extract.yaml), where one is here: benchmarks/wikipedia_sample.pypy_python; at 1 and 2 workers, PyPy's
JIT warming up in each; the JSON of both compared; punkt's own extraction of its first pages runs on CPython), punkt, format (with that model), shard (pass 1 timed
apart), vocab (trained at two sizes: fixed cost + per MB, its CPU split into the main thread's and the rest; and on
1 against 2 threads on the same input, whose files must be equal), tokenize and encode (seq 128 and 512; NVIDIA's
recipe and the dynamic-masking, full-sentences one: RECIPES) and hdf5_dir's checksumming. Text from format on is given --novel of its words new (wikipedia_sample.with_novel_words),
as a real shard keeps meeting new words. Rates are per CPU second (the process and its children, from wait4), so a
shared machine slows the wall clock more than the figures.

Projects: the full dump (FULL: enwiki-20241001, 24 GB bz2, ~100 GB XML, 7.0 M articles, 63 parts, ~900k templates;
text, tokens and HDF5 bytes follow from the XML by the measured ratios) split into the DAG's jobs (per part:
templates, extract, format; one compile_templates; one punkt; one shard; one vocab; per shard: tokenize; per shard
and length: encode; per length: hdf5_dir), each job's threads read from its rule in rules/*.smk, each job paying
its measured process startup. Parts are of unequal size (ASSUMED: 0.5x to 1.5x the mean; the md5sums list has no
sizes). The vocab's threads follow a fit from its 1- and 2-thread runs (serial fraction + the CPU each added thread
costs; Amdahl, applied at the rule's threads); the template scan's decompression divides over its threads, its
byte search does not. Each job also writes its bytes at --disk-mb-s per node shared by its stage's jobs on that
node (ASSUMED bandwidth). The jobs are then run as profiles/slurm submits them, on N nodes x C cores
(benchmarks/slurm_schedule.py): its `groups` packed `group-components` to a Slurm job of up to `cores` CPUs (no
wait inside one), each Slurm job's end seen by Snakemake only at the Slurm plugin's next status check (its polling,
as its code does it: first check `slurm-init-seconds-before-status-checks` after a submission, the interval 10 s
longer after each check that saw nothing end, reset when one did), each submitted job pending --submit-s later
(ASSUMED), pending jobs started in submission order where they fit, a job's members starting --job-overhead-s after
the job does (its Snakemake jobstep starting: MEASURED on the test cluster by benchmarks/slurm_polling.py); a given
vocab is copied on the submit host (localrules). Dependencies: compile waits for every part's templates, each extract for compile, punkt for compile
(it extracts the first part's first pages itself), a part's format for its extract and punkt, shard for every
format, vocab for shard, tokenize for vocab, each shard's encode for its tokenize, hdf5_dir for its length's
encodes. The wall time is that schedule's end. Serial parts are modelled where the code has them: wikiextractor's
one mapper process reads (and bz2-decompresses) its part, whatever --processes; the vocab trainer's main thread;
Punkt's training. The other encode recipe is projected as a second row (wall time, HDF5, peak disk).

The model is held against a measured run of the real DAG by benchmarks/projection_check.py.
"""
import argparse
import bz2
import hashlib
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
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from enwiki_pages import dump as enwiki_dump  # noqa: E402
from enwiki_pages import template_set  # noqa: E402
from slurm_schedule import policy_from_profile, schedule, slurm_jobs  # noqa: E402
from wikipedia_sample import ROOT, SAMPLE_XML, pypy_python, run_stage  # noqa: E402

sys.path.insert(0, str(ROOT))
from workflow.data.punkt import PREFIX_MB  # noqa: E402

PROFILE = ROOT / "profiles" / "slurm" / "config.v8+.yaml"

PYTHON = sys.executable
FULL = {  # the full English Wikipedia dump the projection is for (enwiki-20241001; text and tokens follow from
    # the XML by the ratios measured on the generated pages)
    "bz2_gb": 24, "xml_gb": 100, "articles": 7.0e6, "dump_parts": 63, "templates": 900_000,
    "n_training_shards": 256, "n_test_shards": 256, "test_fraction": 0.1,
    "punkt_chars": 20_000_000,
}
TARGET_HOURS = {"given": 0.25, "trained": 0.3}  # one node; LDDL: 0.27 h from extracted text on one DGX A100
PREDICTIONS = {128: 20, 512: 80}
# The encode recipes projected (their key suffix: encode options, what the files hold): NVIDIA's (the default
# config) and the field's current one, whose files hold the corpus once, unmasked.
RECIPES = {"": ([], "static masks, next-sentence pairs, dupe_factor 5"),
           "_dynamic": (["--masking", "dynamic", "--objective", "full_sentences"],
                        "encode.masking: dynamic, encode.objective: full_sentences: unmasked, written once")}
TEMPLATE_FILES = 8  # the generated template set is compiled from this many files (parts)
# A Slurm job's start inside its allocation before its first member runs: the jobstep's Snakemake parsing the
# workflow, Slurm's prolog. MEASURED by benchmarks/slurm_polling.py on the test cluster (Elapsed - sleep: 3.0 s
# with its 5-rule Snakefile), plus the 0.2 s more that a dry run takes to parse this workflow than that one.
JOB_OVERHEAD_S = 3.2
# The rule behind each stage (its `threads:` is read from rules/*.smk).
RULES = {"templates": "wikipedia_templates", "compile": "compile_templates", "extract": "extract_wikipedia", "punkt": "punkt", "format": "format",
         "shard": "shard", "vocab": "vocab", "tokenize": "tokenize", "encode": "encode", "hdf5_dir": "hdf5_dir"}
# What would bring a held-back stage down (printed with the figures that show it).
FIXES = {
    "templates": "Would: more threads per job (its bz2 decompression divides over them).",
    "compile": "Would: the pages added to the blobs by the workers (the merge of sorted runs; now the parent adds them).",
    "extract": "Would: a faster extractor per core (wikiextractor's template expansion and cleaning in Python "
               "are the cost), or more nodes; per job, wikiextractor's one mapper caps it beyond its cap/threads.",
    "punkt": "Would: a supplied format.punkt_model (no training), or training on fewer characters.",
    "format": "Would: a faster sentence split (NLTK's Punkt, pure Python, is the cost); the formats run once the "
              "extracts ahead of them in Slurm's queue have started (in the extract's job, or ahead of them, projects slower).",
    "shard": "Would: more threads (both passes split over the parts).",
    "vocab": "Would: a given vocab.file (Google's, as NVIDIA uses), fewer vocab.training_shards, or more threads.",
}
# The wikiextractor mapper's own work, as process_dump does it with --templates: skip siteinfo, load the compiled
# templates, then one pass over the part's pages, each page pickled onto the job queue.
MAPPER = """
import pickle, sys
from wikiextractor import WikiExtractor as W
from workflow.data.extract import load_compiled_templates
dump, templates = sys.argv[1:3]
pages = W.decode_open(dump)
for line in pages:
    if '</siteinfo>' in line:
        break
templates, redirects, pages, _ = load_compiled_templates(W.load_and_compact_templates)(templates, dump, pages)
with templates, redirects:
    for page in W.collect_pages(pages):
        pickle.dumps(page)
"""
LOAD_TEMPLATES = """
import sys
from wikiextractor import WikiExtractor as W
from workflow.data.extract import load_compiled_templates
templates, redirects, _, _ = load_compiled_templates(W.load_and_compact_templates)(sys.argv[1], "-", None, "Template:")
with templates, redirects:
    pass
"""
SHARD_PASS1 = """
import sys
from pathlib import Path
from workflow.data.shard import measure
measure([Path(p) for p in sys.argv[1:]], "sentences", 1)
"""


def vocab_training_shards() -> int:
    """config.yaml's vocab.training_shards (what a user runs; else the schema's default): the sample of the
    training shards a vocab is trained on."""
    vocab = yaml.safe_load((ROOT / "config.yaml").read_text()).get("vocab") or {}
    schema = yaml.safe_load((ROOT / "config.schema.yaml").read_text())["properties"]["vocab"]["properties"]
    shards = vocab.get("training_shards", schema["training_shards"]["default"])
    return FULL["n_training_shards"] if shards is None else shards  # null: all


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


THREAD_SPLIT = """
def cpu(task):  # user + system seconds of one thread of this process
    fields = open(f"/proc/self/task/{task}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

main = cpu(os.getpid())
total = sum(getattr(resource.getrusage(who), field) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
            for field in ("ru_utime", "ru_stime"))  # the process's ended threads and processes included
print(json.dumps({"serial": main, "parallel": total - main}))
"""
# The CPU of the main thread (serial) and of the others (parallel) of: vocab training; the template scan; the
# template compile (its worker processes: parallel).
VOCAB_SPLIT = """
import json, os, resource, sys
shard_dir, n_shards, size, threads, output = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
os.environ.update(RAYON_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="true")  # before tokenizers' pool starts
from workflow.data.vocab import train_vocab
train_vocab([f"{shard_dir}/shard_{i}.txt" for i in range(n_shards)], output, size, True, threads=threads)
""" + THREAD_SPLIT
COMPILE_SPLIT = """
import json, os, resource, sys
from workflow.data.templates import compile_templates
compile_templates(sys.argv[3:], sys.argv[1], int(sys.argv[2]))
""" + THREAD_SPLIT
TEMPLATES_SPLIT = """
import json, os, resource, sys
from workflow.data.template_pages import collect_template_pages
collect_template_pages(sys.argv[1], sys.argv[2], int(sys.argv[3]))
""" + THREAD_SPLIT


def median_cpu(command: list, env: dict | None = None, repeats: int = 5):
    """The run of `command` of median CPU of `repeats`. A stage of a few seconds, measured once, is off by this
    shared machine's noise: back to back, one encode took 1.33 to 1.68 CPU s; two runs of the same DAG differed by
    22-27% on the encode 512 and format jobs (benchmarks/projection_check.py)."""
    return sorted((run_stage(command, env) for _ in range(repeats)), key=lambda run: run.cpu)[repeats // 2]


def vocab_run(shard_dir: Path, n_shards: int, size: int, threads: int, output: Path):
    return run_stage([PYTHON, "-m", "workflow.data.vocab", "--shard-dir", shard_dir, "--n-shards", n_shards,
                      "--size", size, "--threads", threads, "--output", output])


def extract_runs(python: Path | str, dump: Path, compiled: Path, sample_compiled: Path, output: Path,
                 work: Path) -> dict:
    """What an extract job costs on interpreter `python`: process startups (the extract CLI on the sample, the
    mapper's imports, the compiled templates' load on the sample's), the load of --template-sample templates, the
    extraction on one and on two wikiextractor workers (a second worker's cost apart: PyPy warms its JIT in each),
    its mapper alone."""
    runs = {"startup": run_stage([python, "-m", "workflow.data.extract", "--input", SAMPLE_XML, "--output",
                                  work / "sample.jsonl", "--processes", 1]).cpu,
            "startup_mapper": run_stage([python, "-c", "import wikiextractor.WikiExtractor"]).cpu,
            "startup_load": run_stage([python, "-c", LOAD_TEMPLATES, compiled]).cpu,
            "load": run_stage([python, "-c", LOAD_TEMPLATES, sample_compiled])}
    for workers in (2, 1):  # the one-worker output is the one kept
        runs[f"extract{workers}"] = run_stage([python, "-m", "workflow.data.extract", "--input", dump, "--output",
                                               output, "--processes", workers, "--templates", compiled])
    runs["mapper"] = run_stage([python, "-c", MAPPER, dump, compiled])
    return runs


def measure(args, work: Path) -> dict:
    """Run every stage once on the replicated dump; returns sizes and CPU seconds."""
    m = {"novel": args.novel}
    dump = work / "enwiki-generated-pages-articles.xml.bz2"
    start = time.perf_counter()
    m["dump"] = enwiki_dump(args.mb, dump)
    print(f"dump: {m['dump']['xml_bytes'] / 1e6:.1f} MB XML ({m['dump']['bytes'] / 1e6:.2f} MB bz2), "
          f"{m['dump']['articles']:,} articles, {m['dump']['redirects']:,} redirects, {m['dump']['templates']:,} "
          f"templates, {m['dump']['other']:,} other pages (benchmarks/enwiki_pages.py), built in "
          f"{time.perf_counter() - start:.0f} s", flush=True)
    m["bz2"] = bz2_rates(dump)
    # What a process costs before it does any work (interpreter, imports; wikiextractor's processes for extract):
    # subtracted from the rates, then paid once per job in the projection.
    m["startup"] = {module: median_cpu([PYTHON, "-c", f"import workflow.data.{module}"]).cpu for module in
                    ("format", "punkt", "shard", "vocab", "tokenize", "encode", "hdf5_dir")}
    m["startup"]["templates"] = run_stage([PYTHON, "-m", "workflow.data.template_pages", "--input",
                                           SAMPLE_XML, "--output", work / "sample.templates.xml"]).cpu
    templates, compiled, extracted = work / "part.templates.xml", work / "templates.bin", work / "part.jsonl"
    m["templates"] = run_stage([PYTHON, "-m", "workflow.data.template_pages", "--input", dump,
                                "--output", templates])
    m["templates_split"] = json.loads(median_cpu([PYTHON, "-c", TEMPLATES_SPLIT, dump, templates, 2]).stdout)
    run_stage([PYTHON, "-m", "workflow.data.templates", "--input", templates, "--output", compiled])
    # compile_templates (once) and the compiled file's load (every extract job) on a template set of
    # --template-sample generated pages: both scale with the count, projected to FULL["templates"]
    # (in TEMPLATE_FILES files, as parts: the compile parses files in parallel)
    generated = list(template_set(args.template_sample))
    template_pages = [work / f"set{index}.templates.xml" for index in range(TEMPLATE_FILES)]
    for index, path in enumerate(template_pages):
        path.write_text("".join(generated[index::TEMPLATE_FILES]), encoding="utf-8")
    sample_compiled = work / "set.bin"
    m["template_sample"] = args.template_sample
    m["template_pages_bytes"] = sum(path.stat().st_size for path in template_pages)
    m["compile"] = run_stage([PYTHON, "-m", "workflow.data.templates", "--input", *template_pages, "--output",
                              sample_compiled])
    m["compile_split"] = json.loads(run_stage([PYTHON, "-c", COMPILE_SPLIT, work / "split.bin", 2,
                                               *template_pages]).stdout)
    m["compiled_bytes"] = sample_compiled.stat().st_size
    # the extract job's runs on CPython (punkt's own extraction; extract_wikipedia where no PyPy is here) and on
    # PyPy (extract_wikipedia's env): the same work, the JSON compared
    m["extract_runs"] = {"CPython": extract_runs(PYTHON, dump, compiled, sample_compiled, extracted, work)}
    pypy = pypy_python() if args.pypy else None
    if pypy is not None:
        m["extract_runs"]["PyPy"] = extract_runs(pypy, dump, compiled, sample_compiled, work / "part.pypy.jsonl", work)
        m["pypy_equal"] = (work / "part.pypy.jsonl").read_bytes() == extracted.read_bytes()
    m["extracted_bytes"] = extracted.stat().st_size
    m["articles"] = sum(1 for _ in open(extracted, encoding="utf-8"))
    print(f"extract: {m['articles']:,} articles, {m['extracted_bytes'] / 1e6:.1f} MB JSON", flush=True)
    punkt = work / "punkt"
    m["punkt"] = run_stage([PYTHON, "-m", "workflow.data.punkt", "--input", extracted, "--output", punkt])
    from workflow.data.format import prose_texts, read_documents

    m["prose_chars"] = sum(map(len, prose_texts(read_documents(extracted))))
    m["punkt_chars"] = min(FULL["punkt_chars"], m["prose_chars"])
    formatted = work / "part.txt"
    m["format"] = median_cpu([PYTHON, "-m", "workflow.data.format", "--input", extracted, "--output", formatted,
                              "--summary", work / "part.summary.json", "--punkt-model", punkt, "--processes", 1],
                             repeats=3)
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
    m["tokenize"] = median_cpu([PYTHON, "-m", "workflow.data.tokenize", "--text", novel, "--vocab", vocab,
                               "--output", tokenized, "--threads", 1], env={"RAYON_NUM_THREADS": "1"})
    with np.load(tokenized) as data:
        m["tokens"] = int(len(data["ids"]))
    m["tokenized_bytes"] = tokenized.stat().st_size
    for length in (128, 512):
        for recipe, options in RECIPES.items():
            output = work / f"seq{length}{recipe}.hdf5"
            m[f"encode{length}{recipe}"] = median_cpu([PYTHON, "-m", "workflow.data.encode", "--tokenized", tokenized,
                                                      "--vocab", vocab, "--output", output, "--max-seq-length", length,
                                                      "--max-predictions-per-seq", PREDICTIONS[length], "--split",
                                                      "training", "--shard-index", 0, *options[0]])
            with h5py.File(output, "r") as handle:
                m[f"instances{length}{recipe}"] = int(handle["input_ids"].shape[0])
            m[f"hdf5_bytes{length}{recipe}"] = output.stat().st_size
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


def extract_costs(m: dict, interpreter: str, bz2_extra: float) -> dict:
    """An extract job's costs on `interpreter` (its runs in m["extract_runs"]): CPU s per MB of XML of the workers
    (rate: MB per CPU s) and of the one mapper (mapper: MB per s), process startup, a worker's warm-up (the second
    worker's extra CPU: PyPy's JIT warms in each), the compiled templates' load per template."""
    runs = m["extract_runs"][interpreter]
    xml_mb = m["dump"]["xml_bytes"] / 1e6
    one = max(runs["extract1"].cpu - runs["startup"], 0.1 * runs["extract1"].cpu)
    mapper = max(runs["mapper"].cpu - runs["startup_mapper"], 0.1 * runs["mapper"].cpu)
    return {"interpreter": interpreter, "rate": 1 / (one / xml_mb + bz2_extra), "mapper": 1 / (mapper / xml_mb + bz2_extra),
            "startup": runs["startup"], "warmup": max(runs["extract2"].cpu - runs["extract1"].cpu, 0.0),
            "load_per_template": max(runs["load"].cpu - runs["startup_load"], 0) / m["template_sample"]}


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


def part_weights(parts: int) -> list[float]:
    """Each part's share of the dump. ASSUMED (the md5sums list has no sizes): enwiki's parts are of unequal size,
    here a linear ramp from 0.5x to 1.5x the mean, in page-id order. The order matters to the schedule (the parts
    run in that order, so the last ones make the tail): on one node largest first projects 0.003 h less, two random
    orders of the same sizes 0.005 and 0.019 h more."""
    ramp = [0.5 + index / max(parts - 1, 1) for index in range(parts)]
    return [weight / sum(ramp) for weight in ramp]


def vocab_scaling(m: dict) -> tuple[float, float]:
    """(s, o) of vocab training on the larger input, fitted from its runs at 1 and 2 threads in CPU time (the wall
    clock of a shared machine cannot show scaling): s, the serial fraction of the 1-thread run (its main thread's
    CPU), and o, the CPU a second thread adds to the parallel rest (2 threads cost more CPU than 1). At n threads
    the wall is T1 * (s + (1 - s) * (1 + o * (n - 1)) / n): Amdahl, with the measured overhead growing per thread."""
    one_cpu = m["vocab_threads"][1][0]
    _, serial, parallel_two = m["vocab_runs"][-1]
    serial = min(serial, 0.95 * one_cpu)
    overhead = max(parallel_two / (one_cpu - serial) - 1, 0.0)
    return serial / one_cpu, overhead


def model(m: dict, threads: dict, args, given_vocab: bool = False, target: dict = FULL,
          recipe: str = "") -> tuple[list[dict], list[dict], dict]:
    """The stages (work, rate, jobs, bytes written) and jobs (seconds at their threads, with their writes and the
    Slurm gap after their inputs; dependencies) of `target`: by default the full dump; a dict like FULL may also
    give its parts' MB of XML (part_mb), the vocab's training shards and the extract job's interpreter. `recipe`:
    the encode recipe (a key of RECIPES)."""
    xml_mb = m["dump"]["xml_bytes"] / 1e6
    parts = target["dump_parts"]
    part_mb = target.get("part_mb") or [target["xml_gb"] * 1e3 * weight for weight in part_weights(parts)]
    extracted_mb = target["xml_gb"] * 1e3 * m["extracted_bytes"] / 1e6 / xml_mb
    formatted_mb = extracted_mb * m["formatted_bytes"] / m["extracted_bytes"]
    novel_mb = formatted_mb * m["novel_bytes"] / m["formatted_bytes"]
    tokens = novel_mb * 1e6 * m["tokens"] / m["novel_bytes"]
    train_share = 1 - target["test_fraction"]
    n_train, n_test = target["n_training_shards"], target["n_test_shards"]
    startup = m["startup"]
    # a real dump's bz2 may decompress slower per MB of XML than the generated one: the difference is added
    bz2_extra = max(0.0, 1 / m["bz2"]["real"] - 1 / m["bz2"]["replicated"])  # CPU seconds per MB of XML
    split = m["templates_split"]  # the scan (main thread) and the decompression (indexed_bzip2's threads)
    # CPU s per MB of XML; the process startup (main thread) is paid per job apart
    templates_serial = max(split["serial"] - m["startup"]["templates"], 0) / xml_mb
    templates_parallel = split["parallel"] / xml_mb + bz2_extra
    rate = {  # per CPU second of one core
        "templates": 1 / (templates_serial + templates_parallel),
        "punkt": m["punkt_chars"] / net_cpu(m, "punkt", "punkt"),
        "format": m["extracted_bytes"] / 1e6 / net_cpu(m, "format", "format"),
        "shard_pass1": m["shard_bytes"] / 1e6 / net_cpu(m, "shard_pass1", "shard"),
        "shard_pass2": m["shard_bytes"] / 1e6 / max(m["shard"].cpu - m["shard_pass1"].cpu, 1e-6),
        "tokenize": m["tokens"] / 1e6 / net_cpu(m, "tokenize", "tokenize"),
    }
    per_template = target["templates"] / m["template_sample"]
    compile_cpu = max(m["compile"].cpu - startup["templates"], 0) * per_template
    compile_serial = min(m["compile_split"]["serial"] / sum(m["compile_split"].values()), 1.0)  # its share
    compile_s = startup["templates"] + compile_cpu * (compile_serial + (1 - compile_serial) / min(threads["compile"], parts))
    # extract_wikipedia on PyPy where measured (envs/extract.yaml), punkt's own extraction on CPython (envs/data.yaml)
    cost = extract_costs(m, target.get("interpreter") or ("PyPy" if "PyPy" in m["extract_runs"] else "CPython"), bz2_extra)
    prefix_cost = extract_costs(m, "CPython", bz2_extra)
    load_s = cost["load_per_template"] * target["templates"]  # each extract job, before its first page
    template_mb = m["template_pages_bytes"] * per_template / 1e6
    compiled_mb = m["compiled_bytes"] * per_template / 1e6
    serial_fixed, serial_per_mb = linear([(b / 1e6, serial) for b, serial, _ in m["vocab_runs"]])
    parallel_fixed, parallel_per_mb = linear([(b / 1e6, parallel) for b, _, parallel in m["vocab_runs"]])
    training_shards = target.get("vocab_training_shards") or vocab_training_shards()
    vocab_mb = novel_mb * train_share * min(training_shards, n_train) / n_train
    serial_fraction, overhead = vocab_scaling(m)
    one_thread_cpu = m["vocab_threads"][1][0] / m["vocab_threads"][2][0]  # the fit's sizes are of 2-thread runs
    t = threads
    jobs, stages = [], []

    def stage(name, unit, work, per_core, n_jobs, note, cap=None, written_mb=0.0):
        stages.append(dict(stage=name, unit=unit, work=work, rate=per_core, jobs=n_jobs, threads=t[name.split()[0]],
                           note=note, cap=cap, written_mb=written_mb))

    def job(name, seconds, deps=(), stage_name=None, written_mb=0.0, siblings=1, local=False):
        """A job's compute `seconds`, or if longer its writing of `written_mb` at its node's bandwidth shared by the
        `siblings` of its stage that fit on the node beside it; `local`: a localrules job (on the submit host)."""
        stage_key = stage_name or name.split("[")[0]
        width = min(t[stage_key.split()[0]], args.cores_per_node)
        write = written_mb / args.disk_mb_s * min(siblings, args.cores_per_node // width)
        # writes go through the page cache while the job computes: it takes the longer of the two
        jobs.append(dict(stage=stage_key, name=name, rule=RULES[stage_key.split()[0]], seconds=max(seconds, write),
                         cpu=seconds * width, deps=list(deps), threads=t[stage_key.split()[0]], local=local))
        return len(jobs) - 1

    stage("templates", "MB XML", target["xml_gb"] * 1e3, rate["templates"], parts,
          f"template pages of each part: bz2 decompressed on {t['templates']} threads, a byte search for <ns>10</ns>",
          written_mb=template_mb)
    template_jobs = [job(f"templates[{p}]", startup["templates"] + mb * (templates_serial + templates_parallel / t["templates"]),
                         written_mb=template_mb * mb / target["xml_gb"] / 1e3, siblings=parts)
                     for p, mb in enumerate(part_mb)]
    stage("compile", "k templates", target["templates"] / 1e3, target["templates"] / 1e3 / compile_cpu, 1,
          f"one job: wikiextractor's parse of all {target['templates'] / 1e3:.0f}k template pages, the parts' files "
          f"in {min(t['compile'], parts)} processes ({compile_serial:.0%} of its CPU serial: the pages added to the "
          f"blobs in order), written once", written_mb=compiled_mb)
    compile_job = job("compile", compile_s, template_jobs, written_mb=compiled_mb)
    jobs[compile_job]["cpu"] = compile_cpu
    extract_speed = min(cost["rate"] * t["extract"], cost["mapper"])
    stage("extract", "MB XML", target["xml_gb"] * 1e3, cost["rate"], parts,
          f"wikiextractor on {cost['interpreter']}, bz2 input; each job first loads the compiled templates "
          f"({load_s:.1f} s), each of its workers warms up ({cost['warmup']:.1f} CPU s)",
          cap=cost["mapper"], written_mb=extracted_mb)
    extract_jobs = [job(f"extract[{p}]", cost["startup"] + load_s + cost["warmup"] + mb / extract_speed, [compile_job],
                        written_mb=extracted_mb * mb / target["xml_gb"] / 1e3, siblings=parts)
                    for p, mb in enumerate(part_mb)]
    # punkt extracts the first pages of the first part itself: PREFIX_MB steps of XML until they hold its characters
    # (a part smaller than a step: the whole part, once), and trains on as many of them as it has
    needed_mb = target["punkt_chars"] / (m["prose_chars"] / xml_mb)
    steps = [mb for mb in PREFIX_MB if mb < min(needed_mb, part_mb[0])]
    steps.append(min(next((mb for mb in PREFIX_MB if mb >= needed_mb), part_mb[0]), part_mb[0]))
    punkt_chars = min(target["punkt_chars"], m["prose_chars"] / xml_mb * part_mb[0])
    prefix_speed = min(prefix_cost["rate"] * t["punkt"], prefix_cost["mapper"])
    prefix_load_s = prefix_cost["load_per_template"] * target["templates"]
    prefix_s = sum(prefix_cost["startup"] + prefix_load_s + mb / prefix_speed for mb in steps)
    stage("punkt", "M chars", punkt_chars / 1e6, rate["punkt"] / 1e6, 1,
          f"one model on the first {punkt_chars / 1e6:.0f} M characters: the first {steps[-1]} MB of XML "
          f"of the first part extracted in {prefix_s:.0f} s ({needed_mb:.0f} MB needed), then trained (serial)")
    punkt_job = job("punkt", startup["punkt"] + prefix_s + punkt_chars / rate["punkt"], [compile_job])
    jobs[punkt_job]["cpu"] = prefix_s * t["punkt"] + punkt_chars / rate["punkt"]
    stage("format", "MB JSON", extracted_mb, rate["format"], parts, "Punkt model loaded, split in processes",
          written_mb=formatted_mb)
    format_jobs = [job(f"format[{p}]", startup["format"] + extracted_mb * mb / target["xml_gb"] / 1e3
                       / (rate["format"] * t["format"]), [punkt_job, extract_jobs[p]],
                       written_mb=formatted_mb * mb / target["xml_gb"] / 1e3, siblings=parts) for p, mb in enumerate(part_mb)]
    pass1 = formatted_mb / (rate["shard_pass1"] * min(t["shard"], parts))
    pass2 = formatted_mb / (rate["shard_pass2"] * min(t["shard"], parts))
    stage("shard", "MB text", formatted_mb, 1 / (1 / rate["shard_pass1"] + 1 / rate["shard_pass2"]), 1,
          f"both passes over the parts in parallel ({pass1:.0f} s + {pass2:.0f} s); {n_train} + {n_test} shards",
          written_mb=formatted_mb)
    shard_job = job("shard", startup["shard"] + pass1 + pass2, format_jobs, written_mb=formatted_mb)
    one_thread = one_thread_cpu * (serial_fixed + parallel_fixed + vocab_mb * (serial_per_mb + parallel_per_mb))
    if given_vocab:
        stage("vocab", "file", 0, 0, 1, "a given vocab.file, copied on the submit host (localrules)")
        vocab_job = job("vocab", startup["vocab"], [shard_job], local=True)
    else:
        n = t["vocab"]
        wall = one_thread * (serial_fraction + (1 - serial_fraction) * (1 + overhead * (n - 1)) / n)
        stage("vocab", "MB text", vocab_mb, vocab_mb / one_thread, 1,
              f"{training_shards} training shards; {one_thread:.0f} s on 1 thread, serial "
              f"{serial_fraction:.2f}, +{overhead:.0%} CPU per added thread (fit to 1 and 2 threads): "
              f"{one_thread / wall:.1f}x on {n} threads")
        vocab_job = job("vocab", wall, [shard_job])
        jobs[vocab_job]["cpu"] = one_thread
    train_tokens, test_tokens = tokens * train_share / n_train, tokens * target["test_fraction"] / n_test
    shard_tokens = [train_tokens] * n_train + [test_tokens] * n_test
    tokenized_mb = tokens * m["tokenized_bytes"] / m["tokens"] / 1e6
    stage("tokenize", "M tokens", tokens / 1e6, rate["tokenize"], n_train + n_test,
          f"one job per shard, text with {m['novel']:.0%} new words", written_mb=tokenized_mb)
    tokenize_jobs = [job(f"tokenize[{s}]", startup["tokenize"] + n / 1e6 / (rate["tokenize"] * t["tokenize"]),
                         [vocab_job], written_mb=tokenized_mb * n / tokens, siblings=n_train + n_test)
                     for s, n in enumerate(shard_tokens)]
    encoded = {}
    for length in (128, 512):
        per_token = m[f"instances{length}{recipe}"] / m["tokens"]
        encode_rate = m[f"instances{length}{recipe}"] / 1e6 / net_cpu(m, f"encode{length}{recipe}", "encode")
        hdf5_mb = tokens * m[f"hdf5_bytes{length}{recipe}"] / m["tokens"] / 1e6
        stage(f"encode {length}", "M rows", tokens * per_token / 1e6, encode_rate, n_train + n_test,
              f"per shard, after its tokenize; {per_token * 1e3:.2f} packed rows per 1k tokens; {RECIPES[recipe][1]}",
              written_mb=hdf5_mb)
        encoded[length] = [job(f"encode {length}[{s}]", startup["encode"] + n * per_token / 1e6 / (encode_rate * t["encode"]),
                               [tokenize_jobs[s]], stage_name=f"encode {length}", written_mb=hdf5_mb * n / tokens,
                               siblings=n_train + n_test)
                           for s, n in enumerate(shard_tokens)]
    for length in (128, 512):
        hdf5_mb = tokens * m[f"hdf5_bytes{length}{recipe}"] / m["tokens"] / 1e6
        stage(f"hdf5_dir {length}", "MB HDF5", hdf5_mb, m["sha256_rate"] / 1e6, 1, "sha256 of every shard + hard links")
        job(f"hdf5_dir {length}", startup["hdf5_dir"] + hdf5_mb / (m["sha256_rate"] / 1e6 * t["hdf5_dir"]),
            encoded[length], stage_name=f"hdf5_dir {length}")
    sizes = {"formatted_gb": formatted_mb / 1e3, "extracted_gb": extracted_mb / 1e3, "tokens": tokens,
             "vocab_mb": vocab_mb, "template_gb": template_mb / 1e3, "load_s": load_s, "compile_s": compile_s,
             "extract": cost,
             "serial_fraction": serial_fraction}
    return stages, jobs, sizes


def hdf5_gb(stages: list[dict]) -> float:
    """GB of HDF5 the encode stages write."""
    return sum(row["written_mb"] for row in stages if row["stage"].startswith("encode")) / 1e3


def recipe_rows(m: dict, threads: dict, args, policy) -> None:
    """Each encode recipe's projection on the fewest nodes: wall time, HDF5 bytes, all bytes written, peak disk
    (everything written and the download) and the disk after `clean_intermediates` (the HDF5 and the download)."""
    if not all(f"encode{length}{recipe}" in m for length in (128, 512) for recipe in RECIPES):
        print("encode recipes: measured before the dynamic recipe was; measure again for its row")
        return
    nodes = min(args.nodes)
    print(f"encode recipes, the full dump on {nodes} node(s), a trained vocab (the DAG up to tokenize the same):")
    print(f"  {'recipe':<84s} {'wall':>7s} {'HDF5':>7s} {'written':>8s} {'peak disk':>9s} {'after clean':>11s}")
    for recipe, (_, description) in RECIPES.items():
        stages, jobs, _ = model(m, threads, args, recipe=recipe)
        end = max(last for _, last in schedule(jobs, nodes, args.cores_per_node, policy).values())
        written, hdf5 = sum(row["written_mb"] for row in stages) / 1e3, hdf5_gb(stages)
        print(f"  {description:<84s} {end / 3600:6.3f}h {hdf5:5.0f}GB {written:6.0f}GB {written + FULL['bz2_gb']:7.0f}GB "
              f"{hdf5 + FULL['bz2_gb']:9.0f}GB")


def report(m: dict, args) -> None:
    threads = {stage: args.threads.get(stage, rule_threads(rule)) for stage, rule in RULES.items()}
    stages, jobs, sizes = model(m, threads, args)
    policy = policy_from_profile(Path(args.profile), args.submit_s, args.group_cores, args.job_overhead_s)
    d = m["dump"]
    print(f"\nmeasured (1 core each, CPU seconds; machine shared, so wall clock is slower): generated dump "
          f"{d['xml_bytes'] / 1e6:.1f} MB XML, {d['articles']:,} articles ({d['xml_bytes'] / d['articles'] / 1e3:.1f} KB "
          f"XML each) -> {m['extracted_bytes'] / 1e6:.1f} MB JSON (XML->text {m['extracted_bytes'] / d['xml_bytes']:.2f}), "
          f"{m['formatted_bytes'] / 1e6:.1f} MB text; with {m['novel']:.0%} of words new: {m['tokens']:,} tokens")
    b = m["bz2"]
    print(f"  bz2 decompression: generated dump ({b['replicated_ratio']:.0f}:1) {b['replicated']:.0f} MB XML/s, the "
          f"real export's bz2 ({b['real_ratio']:.1f}:1; the full dump's is {FULL['xml_gb'] / FULL['bz2_gb']:.1f}:1) "
          f"{b['real']:.0f} MB/s per core; a slower real one is charged to templates and extract")
    print("  process startup (paid once per job): " + ", ".join(f"{k} {v:.2f} s" for k, v in m["startup"].items()))
    for interpreter, runs in m["extract_runs"].items():
        print(f"  extract   {runs['extract1'].cpu:7.1f} s CPU on {interpreter} ({d['xml_bytes'] / 1e6 / runs['extract1'].cpu:.2f} "
              f"MB XML per CPU s, real wikiextractor with template expansion, 1 worker; 2 workers "
              f"{runs['extract2'].cpu:.1f} s), of which its mapper (reads the bz2 once): {runs['mapper'].cpu:.1f} s; "
              f"startup {runs['startup']:.2f} s")
    if "pypy_equal" in m:
        print(f"  extract on PyPy (extract_wikipedia's env) vs CPython: JSON {'EQUAL' if m['pypy_equal'] else 'DIFFERENT'}, "
              f"{m['extract_runs']['CPython']['extract1'].cpu / m['extract_runs']['PyPy']['extract1'].cpu:.2f}x less CPU")
    else:
        print("  no PyPy here (benchmarks/wikipedia_sample.pypy_python): extract_wikipedia projected on CPython")
    load = m["extract_runs"][sizes["extract"]["interpreter"]]["load"]
    print(f"  templates {m['template_sample']:,} generated pages ({m['template_pages_bytes'] / 1e6:.0f} MB): compile "
          f"{m['compile'].cpu:.1f} s CPU (peak RSS {m['compile'].rss_mb:.0f} MB); load of the compiled file "
          f"{load.cpu:.2f} s CPU on {sizes['extract']['interpreter']} (peak RSS {load.rss_mb:.0f} MB) -> at "
          f"{FULL['templates'] / 1e3:.0f}k: compile "
          f"{sizes['compile_s']:.0f} s once, load {sizes['load_s']:.1f} s per extract job")
    print(f"  punkt     {m['punkt'].cpu:7.1f} s CPU on {m['punkt_chars'] / 1e6:.1f} M chars; format {m['format'].cpu:.1f} s "
          f"CPU with that model")
    print(f"  shard     {m['shard'].cpu:7.1f} s CPU on {m['shard_bytes'] / 1e6:.0f} MB, of which pass 1 "
          f"{m['shard_pass1'].cpu:.1f} s; peak RSS {m['shard'].rss_mb:.0f} MB")
    (one_cpu, one_wall, _), (two_cpu, two_wall, _) = m["vocab_threads"][1], m["vocab_threads"][2]
    print(f"  vocab     same input: 1 thread {one_wall:.1f} s wall ({one_cpu:.1f} s CPU), 2 threads {two_wall:.1f} s wall "
          f"({two_cpu:.1f} s CPU): serial fraction {sizes['serial_fraction']:.2f} (Amdahl fit), applied at "
          f"{threads['vocab']} threads; files {'EQUAL' if m['vocab_equal'] else 'DIFFERENT'}")
    for name in ("tokenize", *(f"encode{length}{recipe}" for recipe in RECIPES for length in (128, 512))):
        if name in m:
            print(f"  {name:9s} {m[name].cpu:7.1f} s CPU, peak RSS {m[name].rss_mb:.0f} MB")
    print(f"\nfull dump: {FULL['bz2_gb']} GB bz2 = {FULL['xml_gb']} GB XML in {FULL['dump_parts']} parts (sizes 0.5-1.5x "
          f"the mean, assumed), {FULL['articles'] / 1e6:.1f} M articles, {FULL['templates'] / 1e3:.0f}k templates "
          f"({sizes['template_gb']:.1f} GB) -> {sizes['extracted_gb']:.1f} GB JSON, {sizes['formatted_gb']:.1f} GB text, "
          f"{sizes['tokens'] / 1e9:.1f} B tokens (by the measured ratios); {FULL['n_training_shards']} + "
          f"{FULL['n_test_shards']} shards; vocab on {sizes['vocab_mb'] / 1e3:.1f} GB; download excluded; writes at "
          f"{args.disk_mb_s:.0f} MB/s per node (assumed); run as profiles/slurm submits them (benchmarks/slurm_schedule.py): "
          f"its groups as Slurm jobs of up to {policy.group_cores} CPUs, each job's end seen at the plugin's next "
          f"status check (first {policy.first_check_s:.0f} s after a submission, then every 10 s longer while nothing "
          f"ends, as the plugin does), a job pending {policy.submit_s:.0f} s after its submission (assumed), its "
          f"members starting {policy.job_overhead_s:.1f} s after it starts (measured: benchmarks/slurm_polling.py)")
    spans = {n: schedule(jobs, n, args.cores_per_node, policy) for n in args.nodes}
    given_jobs = model(m, threads, args, given_vocab=True)[1]
    given = {n: schedule(given_jobs, n, args.cores_per_node, policy) for n in args.nodes}
    header = "".join(f" {f'{n} node' + ('s' if n > 1 else '') + ' from-to':>17s}" for n in args.nodes)
    print(f"\n{'stage':12s} {'work':>21s} {'rate/core':>11s} {'jobs':>5s} {'thr':>4s} {'CPU s':>8s} {'written':>9s}"
          f"{header}  note")
    for row in stages:
        cpu = sum(j["cpu"] for j in jobs if j["stage"] == row["stage"])
        cells = "".join(f" {spans[n][row['stage']][0]:7.0f}-{spans[n][row['stage']][1]:7.0f}s" for n in args.nodes)
        print(f"{row['stage']:12s} {row['work']:9.0f} {row['unit']:>11s} {row['rate']:9.2f}/s {row['jobs']:5d} "
              f"{row['threads']:4d} {cpu:8.0f} {row['written_mb'] / 1e3:7.1f}GB{cells}  {row['note']}")
    end = {n: max(last for _, last in spans[n].values()) for n in args.nodes}
    end_given = {n: max(last for _, last in given[n].values()) for n in args.nodes}
    written = sum(row["written_mb"] for row in stages) / 1e3
    print(f"{'total':12s} {'':52s}{sum(j['cpu'] for j in jobs):8.0f} {written:7.1f}GB"
          + "".join(f" {end[n] / 3600:16.3f}h" for n in args.nodes)
          + f"  trained vocab: target <= {TARGET_HOURS['trained']} h on 1 node: "
          + ("MET" if end[min(args.nodes)] / 3600 <= TARGET_HOURS["trained"] else "MISSED"))
    print(f"{'given vocab':12s} {'':71s}" + "".join(f" {end_given[n] / 3600:16.3f}h" for n in args.nodes)
          + f"  vocab.file given (NVIDIA's recipe: Google's): target <= {TARGET_HOURS['given']} h: "
          + ("MET" if end_given[min(args.nodes)] / 3600 <= TARGET_HOURS["given"] else "MISSED")
          + f"; saves {(end[min(args.nodes)] - end_given[min(args.nodes)]) / 60:.0f} min on 1 node")
    if len(args.nodes) > 1:
        few, many = min(args.nodes), max(args.nodes)
        print(f"{many} nodes / {few}: {end[many] / end[few]:.2f} (target <= 0.6: "
              f"{'MET' if end[many] / end[few] <= 0.6 else 'MISSED'})")
    recipe_rows(m, threads, args, policy)
    units = slurm_jobs(jobs, policy)
    print(f"Slurm jobs: {sum(not u['local'] for u in units)} for {len(jobs)} rule jobs (profiles/slurm groups)")
    order = sorted(spans[min(args.nodes)].items(), key=lambda item: item[1])
    print(f"\ncritical path on {min(args.nodes)} node(s), stage spans in start order (stages overlap part by part and "
          f"shard by shard): " + " -> ".join(f"{stage} {stop - start:.0f} s" for stage, (start, stop) in order))
    hdf5 = hdf5_gb(stages)
    print(f"disk: {written:.0f} GB written, all of it on disk at the end with the {FULL['bz2_gb']} GB download: peak "
          f"{written + FULL['bz2_gb']:.0f} GB; after `snakemake clean_intermediates` (template pages, JSON, text, "
          f"shards, tokenized gone) {hdf5 + FULL['bz2_gb']:.0f} GB: the HDF5 ({hdf5:.0f} GB) and the download")
    span1 = spans[min(args.nodes)]
    print(f"what holds each stage back on 1 node (its span vs its work spread over {args.cores_per_node} cores):")
    for row in stages:
        stage_name, first = row["stage"], row["stage"].split()[0]
        start, stop = span1[stage_name]
        spread = sum(j["cpu"] for j in jobs if j["stage"] == stage_name) / args.cores_per_node
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
    parser.add_argument("--template-sample", type=int, default=50_000,
                        help="generated template pages the compile and the per-job load are timed on")
    parser.add_argument("--disk-mb-s", type=float, default=1000.0,
                        help="write bandwidth of one node to the shared filesystem, shared by its running jobs")
    parser.add_argument("--submit-s", type=float, default=2.0,
                        help="seconds from a job's submission until Slurm can start it (sbatch, its scheduler)")
    parser.add_argument("--job-overhead-s", type=float, default=JOB_OVERHEAD_S,
                        help="a Slurm job's start before its first member runs (benchmarks/slurm_polling.py)")
    parser.add_argument("--profile", default=str(PROFILE), help="the Snakemake profile whose groups are scheduled")
    parser.add_argument("--group-cores", type=int, default=None,
                        help="CPUs of one group job (default: the Slurm profile's `cores`)")
    parser.add_argument("--no-pypy", dest="pypy", action="store_false",
                        help="measure extract on CPython only (as a run without conda envs runs it)")
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
        measured = pickle.loads(Path(args.measured).read_bytes())
        if "extract_runs" not in measured:
            raise SystemExit(f"{args.measured}: measured by an older version of this benchmark (no extract_runs); "
                             "measure again (--workdir)")
        report(measured, args)
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
