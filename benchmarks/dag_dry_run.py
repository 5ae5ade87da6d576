"""Benchmark: `snakemake -n data/hdf5_seq128` with thousands of shards and the dump in parts answers in < 15 s.

    python benchmarks/dag_dry_run.py [--training-shards 4096] [--test-shards 4096] [--parts 63]

Runs the real Snakefile in an empty temporary working directory (so the whole DAG, download to HDF5, is
planned), prints the wall time and the jobs per rule, and checks that no phase-2 (seq 512) job is planned.
The dump is split as English Wikipedia's is: a local md5sums list shaped like enwiki-20240601's (63 parts,
`enwiki-20240601-pages-articlesN.xml-pFIRSTpLAST.bz2`, beside multistream parts and other files) is read
with `wikipedia.parts: auto`, as the workflow reads the real one; --parts 0 plans the single-file dump.
--stub-shards replaces the stages up to shard by one stub job, to time the data rules alone.
"""
import argparse
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DUMP = "enwiki-20240601-pages-articles.xml.bz2"
# page-id ranges of enwiki's first ten parts; later parts cover 1.5 M page ids each, several per file number
FIRST_PARTS = [1, 41243, 151574, 311330, 558392, 958046, 1483662, 2134112, 2936261, 4045403, 5399367]


def enwiki_md5sums(n_parts: int) -> str:
    """An md5sums list shaped like enwiki's: `n_parts` pages-articles parts, their multistream twins, other files."""
    starts = FIRST_PARTS[:n_parts + 1]
    while len(starts) <= n_parts:
        starts.append(starts[-1] + 1_500_000)
    lines = [f"{0:032x}  {DUMP}", f"{1:032x}  enwiki-20240601-pages-articles-multistream.xml.bz2"]
    for index, (first, following) in enumerate(zip(starts, starts[1:])):
        number = min(index + 1, 11 + (index - 10) // 3) if index >= 10 else index + 1
        for kind in ("pages-articles", "pages-articles-multistream"):
            lines.append(f"{index + 2:032x}  enwiki-20240601-{kind}{number}.xml-p{first}p{following - 1}.bz2")
    return "\n".join(lines) + "\n"


STUB = """configfile: "config.yaml"
include: "{rules}/common.smk"
rule shard_stub:
    output: directory("data/shards")
    shell: "mkdir -p {{output}}"
include: "{rules}/vocab.smk"
include: "{rules}/tokenize.smk"
include: "{rules}/encode.smk"
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--training-shards", type=int, default=4096)
    parser.add_argument("--test-shards", type=int, default=4096)
    parser.add_argument("--target", default="data/hdf5_seq128")
    parser.add_argument("--parts", type=int, default=63, help="parts of the dump (0: one file)")
    parser.add_argument("--stub-shards", action="store_true", help="only vocab/tokenize/encode/hdf5_dir + a stub")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as name:
        workdir = Path(name)
        shutil.copyfile(ROOT / "config.yaml", workdir / "config.yaml")
        (workdir / "dump").mkdir()
        (workdir / "dump" / "enwiki-20240601-md5sums.txt").write_text(enwiki_md5sums(args.parts))
        (workdir / "shards.yaml").write_text(
            f"shard:\n  n_training_shards: {args.training_shards}\n  n_test_shards: {args.test_shards}\n"
            f"wikipedia:\n  url: dump/{DUMP}\n  parts: {'auto' if args.parts else 'single'}\n"
        )
        snakefile = ROOT / "Snakefile"
        if args.stub_shards:
            snakefile = workdir / "Snakefile"
            snakefile.write_text(STUB.format(rules=ROOT / "rules"))
        command = [sys.executable, "-m", "snakemake", "--snakefile", str(snakefile), args.target,
                   "--dry-run", "--configfile", "config.yaml", "shards.yaml", "--printshellcmds"]
        start = time.perf_counter()
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        result = subprocess.run(command, cwd=workdir, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    if result.returncode:
        print(result.stdout[-2000:], result.stderr[-2000:], sep="\n")
        raise SystemExit(f"snakemake -n failed (exit {result.returncode})")
    counts = dict(re.findall(r"^(\w+)\s+(\d+)$", result.stdout.split("Job stats:")[-1], flags=re.M))
    what = "data rules + stub shards" if args.stub_shards else "whole DAG"
    dump = f"the dump in {args.parts} parts" if args.parts else "the dump as one file"
    print(f"snakemake -n {args.target}, {args.training_shards:,} training + {args.test_shards:,} test shards,"
          f" {dump} ({what}):")
    print(f"  {seconds:.1f} s wall, {cpu:.1f} s CPU (target < 15 s; on a busy machine the CPU time is the fair figure)"
          f" {'OK' if min(seconds, cpu) < 15 else 'MISSED'}")
    print("  jobs: " + ", ".join(f"{rule} {count}" for rule, count in counts.items()))
    phase2 = "encoded_seq512" in result.stdout
    print(f"  phase-2 (seq 512) jobs planned: {'YES (wrong)' if phase2 else 'none'}")


if __name__ == "__main__":
    main()
