"""Benchmark: a chain of jobs through the real Slurm plugin and slurmctld, each job's start measured against the start
benchmarks/slurm_schedule.py gives it (the model full_dump_projection.py schedules the data half with).

    sudo tests/slurm/start_cluster.sh          # the test cluster (or any cluster: --partition)
    python benchmarks/slurm_polling.py [--seconds 3 25 1 70 1] [--first-check 5] [--partition cpu]

Runs a Snakefile of len(--seconds) rules, each `sleep` for its seconds and needing the one before, with
`--executor slurm`, profiles/slurm's status polling (squeue, the first check --first-check s after a submission),
one CPU each. From sacct: each job's Submit, Start and End. Both sides start from the first job's start. The model
side is given the measured per-job overhead (the job's Elapsed minus its sleep: the jobstep's Snakemake start, the
Slurm prolog) and --submit-s. It prints, per job, the measured and modelled start and the difference, and the
measured wait from one job's end to the next one's start beside the model's.
"""
import argparse
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from slurm_schedule import Policy, schedule  # noqa: E402

SNAKEFILE_RULE = """
rule step{index}:
    input: {input}
    output: "step{index}.done"
    resources: slurm_partition="{partition}", runtime=10, mem_mb=100
    shell: "sleep {seconds} && touch {{output}}"
"""


def write_workflow(directory: Path, seconds: list[float], partition: str) -> None:
    rules = "".join(SNAKEFILE_RULE.format(index=index, seconds=value, partition=partition,
                                          input=f'"step{index - 1}.done"' if index else "[]")
                    for index, value in enumerate(seconds))
    (directory / "Snakefile").write_text(f'rule all:\n    input: "step{len(seconds) - 1}.done"\n' + rules)


def sacct_times(job_ids: list[str]) -> dict[str, tuple[float, float, float]]:
    """Rule -> (Submit, Start, End) in epoch seconds (the plugin names a job's rule in its --comment)."""
    out = subprocess.run(["sacct", "-n", "-X", "-P", "-j", ",".join(job_ids), "--format", "Comment,Submit,Start,End"],
                         capture_output=True, text=True, check=True).stdout
    times = {}
    for line in out.splitlines():
        comment, *stamps = line.split("|")
        times[comment.removeprefix("rule_")] = tuple(datetime.fromisoformat(stamp).timestamp() for stamp in stamps)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, nargs="+", default=[3, 25, 1, 70, 1])
    parser.add_argument("--first-check", type=int, default=5, help="slurm-init-seconds-before-status-checks")
    parser.add_argument("--partition", default="cpu")
    parser.add_argument("--submit-s", type=float, default=2.0, help="the model's sbatch-to-pending time")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=Path.cwd(), prefix=".slurm-polling-") as work:
        write_workflow(Path(work), args.seconds, args.partition)
        started = time.time()
        run = subprocess.run([sys.executable, "-m", "snakemake", "--executor", "slurm", "--jobs", "1",
                              "--slurm-status-command", "squeue", "--slurm-init-seconds-before-status-checks",
                              str(args.first_check), "--latency-wait", "5", "--directory", work, "--snakefile", str(Path(work) / "Snakefile")],
                             capture_output=True, text=True)
        wall = time.time() - started
        if run.returncode != 0:
            raise SystemExit(f"snakemake failed:\n{run.stderr[-3000:]}")
        job_ids = re.findall(r"has been submitted with SLURM jobid (\d+)", run.stderr)
    times = sacct_times(job_ids)
    names = [f"step{index}" for index in range(len(args.seconds))]
    measured = [times[name] for name in names]
    overhead = [end - start - seconds for (_, start, end), seconds in zip(measured, args.seconds)]
    mean_overhead = sum(overhead) / len(overhead)
    jobs = [dict(stage=name, rule=name, seconds=seconds + mean_overhead, threads=1,
                 deps=[index - 1] if index else []) for index, (name, seconds) in enumerate(zip(names, args.seconds))]
    model = schedule(jobs, 1, 1, Policy(groups={}, components={}, group_cores=1, first_check_s=args.first_check,
                                        submit_s=args.submit_s))
    origin, model_origin = measured[0][1], model[names[0]][0]
    print(f"chain of {len(names)} jobs ({' -> '.join(f'{s:g} s' for s in args.seconds)}) through the Slurm plugin, "
          f"first status check {args.first_check} s after a submission; snakemake ran {wall:.0f} s; per-job "
          f"overhead (Elapsed - sleep: jobstep Snakemake, prolog) {min(overhead):.1f}-{max(overhead):.1f} s, "
          f"mean {mean_overhead:.1f} s (given to the model)")
    print(f"{'job':7s} {'sleep':>6s} {'start: measured':>16s} {'model':>7s} {'diff':>6s} "
          f"{'wait after the previous: measured':>34s} {'model':>7s}")
    for index, name in enumerate(names):
        start = measured[index][1] - origin
        modelled = model[name][0] - model_origin
        waits = ("", "")
        if index:
            waits = (f"{measured[index][1] - measured[index - 1][2]:.0f} s",
                     f"{model[name][0] - model[names[index - 1]][1]:.0f} s")
        print(f"{name:7s} {args.seconds[index]:5.0f}s {start:15.0f}s {modelled:6.0f}s {start - modelled:+5.0f}s "
              f"{waits[0]:>34s} {waits[1]:>7s}")


if __name__ == "__main__":
    main()
