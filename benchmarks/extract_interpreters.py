"""Benchmark: the extract stage (wikiextractor with template expansion) on CPython vs on PyPy, the same part.

    python benchmarks/extract_interpreters.py [--mb 40] [--processes 2]

Generates --mb MB of real-shaped enwiki XML (benchmarks/enwiki_pages.py: templates with parameters and parser
functions, citations, infoboxes, tables), collects and compiles its template pages as the workflow does, then runs
`python -m workflow.data.extract --templates ...` on it, each run in its own process (CPU s of the process and
its wikiextractor processes, wall s, peak RSS: wait4), with:
- CPython: this interpreter (the dev/test venv; envs/data.yaml's Python);
- PyPy: the extract rule's interpreter (envs/extract.yaml), here $SNAKEBERT_PYPY or .venv-pypy/bin/python.
Both sides do the same work, from the same compiled templates: one wikiextractor worker (all the CPU is the
extraction, its reader and writer included), then --processes workers (wall). The JSON files must be equal.
"""
import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from enwiki_pages import dump as enwiki_dump  # noqa: E402
from wikipedia_sample import pypy_python, run_stage  # noqa: E402

PYTHON = sys.executable


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=40.0, help="MB of generated XML")
    parser.add_argument("--processes", type=int, default=2, help="wikiextractor workers of the second runs")
    parser.add_argument("--workdir", help="where the generated files go (default: a temporary directory)")
    args = parser.parse_args()
    pypy = pypy_python()
    if pypy is None:
        raise SystemExit("no PyPy with wikiextractor: install pypy3 (Debian: pypy3 pypy3-venv) and run `make setup`, "
                         "or set SNAKEBERT_PYPY")
    with tempfile.TemporaryDirectory(dir=args.workdir) as work:
        work = Path(work)
        dump = work / "part.xml.bz2"
        sizes = enwiki_dump(args.mb, dump)
        run_stage([PYTHON, "-m", "workflow.data.template_pages", "--input", dump, "--output", work / "t.xml"])
        run_stage([PYTHON, "-m", "workflow.data.templates", "--input", work / "t.xml", "--output", work / "t.bin"])
        xml_mb = sizes["xml_bytes"] / 1e6
        print(f"part: {xml_mb:.0f} MB XML, {sizes['articles']:,} articles, {sizes['templates']:,} templates")
        version = run_stage([pypy, "-c", "import sys; print(sys.version.split()[0], sys.pypy_version_info[:3])"])
        print(f"CPython {sys.version.split()[0]} ({PYTHON}) vs PyPy {version.stdout.strip()} ({pypy})")
        runs, outputs = {}, {}
        for processes in (1, args.processes):
            for name, interpreter in (("CPython", PYTHON), ("PyPy", pypy)):
                output = work / f"{name}{processes}.jsonl"
                runs[name, processes] = run_stage([interpreter, "-m", "workflow.data.extract", "--input", dump,
                                                   "--output", output, "--processes", processes,
                                                   "--templates", work / "t.bin"])
                outputs[name, processes] = output.read_bytes()
        equal = len(set(outputs.values())) == 1
        print(f"JSON: {'EQUAL' if equal else 'DIFFERENT'} on every side ({len(outputs[('CPython', 1)]) / 1e6:.1f} MB)")
        print(f"{'':28s} {'CPU s':>7s} {'wall s':>7s} {'MB XML/CPU s':>13s} {'peak RSS MB':>12s}")
        for (name, processes), m in runs.items():
            print(f"{f'{name}, {processes} worker(s)':28s} {m.cpu:7.1f} {m.wall:7.1f} {xml_mb / m.cpu:13.2f} "
                  f"{m.rss_mb:12.0f}")
        cpython, pypy_run = runs["CPython", 1], runs["PyPy", 1]
        print(f"PyPy vs CPython, one worker: {cpython.cpu / pypy_run.cpu:.2f}x less CPU, {cpython.wall / pypy_run.wall:.2f}x "
              f"less wall; {args.processes} workers: {runs['CPython', args.processes].wall / runs['PyPy', args.processes].wall:.2f}x "
              f"less wall")
        if not equal:
            raise SystemExit("the interpreters' extracts differ")


if __name__ == "__main__":
    main()
