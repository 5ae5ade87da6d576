"""Benchmark: `snakemake -n data/hdf5_seq128` with thousands of shards answers in < 15 s.

    python benchmarks/dag_dry_run.py [--training-shards 4096] [--test-shards 4096]

Runs the real Snakefile in an empty temporary working directory (so the whole DAG, download to HDF5, is
planned), prints the wall time and the jobs per rule, and checks that no phase-2 (seq 512) job is planned.
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
    parser.add_argument("--stub-shards", action="store_true", help="only vocab/tokenize/encode/hdf5_dir + a stub")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as name:
        workdir = Path(name)
        shutil.copyfile(ROOT / "config.yaml", workdir / "config.yaml")
        (workdir / "shards.yaml").write_text(
            f"shard:\n  n_training_shards: {args.training_shards}\n  n_test_shards: {args.test_shards}\n"
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
    print(f"snakemake -n {args.target}, {args.training_shards:,} training + {args.test_shards:,} test shards ({what}):")
    print(f"  {seconds:.1f} s wall, {cpu:.1f} s CPU (target < 15 s; on a busy machine the CPU time is the fair figure)"
          f" {'OK' if min(seconds, cpu) < 15 else 'MISSED'}")
    print("  jobs: " + ", ".join(f"{rule} {count}" for rule, count in counts.items()))
    phase2 = "encoded_seq512" in result.stdout
    print(f"  phase-2 (seq 512) jobs planned: {'YES (wrong)' if phase2 else 'none'}")


if __name__ == "__main__":
    main()
