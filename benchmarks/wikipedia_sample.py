"""Benchmark inputs from the bundled real export, and stage runs measured like a cluster job sees them (a dump of
any size: benchmarks/enwiki_pages.py).

- real_text: Wikipedia text in shard format (one sentence per line, blank line between documents) of about N MB,
  made by the real extract and format stages from that sample, documents repeated in a shuffled order.
- with_novel_words: that text with a fraction of its words made new (letters shuffled), as a real shard keeps
  meeting new words while the repeated sample does not.
- run_stage: one command in its own process; wall seconds, CPU seconds (its own and its waited-for children's,
  e.g. wikiextractor's workers) and peak RSS from wait4's rusage.
- pypy_python: the PyPy interpreter with wikiextractor installed that the extract rule's env provides
  (envs/extract.yaml), here: $SNAKEBERT_PYPY, or .venv-pypy/bin/python (`make setup` makes it where `pypy3` is
  installed); None if there is none.
"""
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SAMPLE_XML = ROOT / "sample" / "enwiki-sample-pages-articles.xml"
PYPY_VENV_PYTHON = ROOT / ".venv-pypy" / "bin" / "python"


@dataclass(frozen=True)
class Measured:
    wall: float  # seconds
    cpu: float  # user + system seconds of the process and its waited-for children
    rss_mb: float  # peak resident set of the largest of them
    stdout: str


def run_stage(command: list, env: dict | None = None) -> Measured:
    """Run `command` (cwd: the repository) and measure it; a failure stops the benchmark with its stderr."""
    environment = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    with tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as stderr:
        start = time.perf_counter()
        process = subprocess.Popen([str(part) for part in command], cwd=ROOT, env=environment, stdout=stdout,
                                   stderr=stderr)
        _, status, usage = os.wait4(process.pid, 0)  # reaped here, so Popen never sees the rusage
        wall = time.perf_counter() - start
        process.returncode = os.waitstatus_to_exitcode(status)
        stdout.seek(0)
        stderr.seek(0)
        if process.returncode:
            message = stderr.read().decode(errors="replace")[-2000:]
            raise SystemExit(f"{' '.join(map(str, command))} failed ({process.returncode}):\n{message}")
        return Measured(wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, stdout.read().decode())


def pypy_python() -> Path | None:
    """The PyPy interpreter (with wikiextractor) to run the extract stage on, or None."""
    candidate = Path(os.environ.get("SNAKEBERT_PYPY") or PYPY_VENV_PYTHON)
    if not candidate.exists():
        return None
    probe = subprocess.run([str(candidate), "-c", "import platform, wikiextractor; print(platform.python_implementation())"],
                           capture_output=True, text=True)
    return candidate if probe.returncode == 0 and probe.stdout.strip() == "PyPy" else None


def real_text(megabytes: float, output: Path, seed: int = 0) -> Path:
    """About `megabytes` MB of shard-format text from the sample through the real extract and format stages."""
    work = output.parent
    extracted, formatted = work / "sample.jsonl", work / "sample.txt"
    python = sys.executable
    run_stage([python, "-m", "workflow.data.extract", "--input", str(SAMPLE_XML), "--output", str(extracted)])
    run_stage([python, "-m", "workflow.data.format", "--input", str(extracted), "--output", str(formatted)])
    documents = [d.strip("\n") + "\n" for d in formatted.read_text(encoding="utf-8").split("\n\n") if d.strip()]
    rng = random.Random(seed)
    out, size = [], 0
    while size < megabytes * 1e6:
        rng.shuffle(documents)
        for document in documents:
            out.append(document)
            size += len(document.encode("utf-8")) + 1
            if size >= megabytes * 1e6:
                break
    output.write_text("\n".join(out), encoding="utf-8")
    return output


def with_novel_words(text: str, fraction: float, seed: int = 0) -> str:
    """`text` with about `fraction` of its space-separated chunks made new by shuffling their letters."""
    rng = random.Random(seed)
    chunks = text.split(" ")
    long = [i for i, chunk in enumerate(chunks) if len(chunk) >= 6 and "\n" not in chunk]
    for i in rng.sample(long, min(len(long), round(fraction * len(chunks)))):
        letters = list(chunks[i])
        rng.shuffle(letters)
        chunks[i] = "".join(letters)
    return " ".join(chunks)
