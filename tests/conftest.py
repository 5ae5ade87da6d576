"""Shared pytest helpers: a scratch copy of the workflow to run Snakemake in, the official SQuAD v1.1 metric, what a
Snakemake report embeds, and a real loopback HTTP server (with Range support and a one-shot connection cut)."""
import base64
import collections
import inspect
import os
import re
import shutil
import socket
import string
import sys
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "sample"
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# The cluster tests' fixtures, defined once here for every module (tests/fixtures/slurm_cluster.py).
from tests.fixtures.slurm_cluster import cluster, demo_data, new_run  # noqa: E402, F401

# The tests that use the Slurm test cluster: `make test` (pytest-xdist) runs them all in one worker, one after the
# other, so that none meets another's jobs (a node is taken down under one). By nodeid prefix under tests/.
CLUSTER_TESTS = ("test_slurm.py::", "test_multinode.py::", "test_scaling.py::test_scaling_on_slurm",
                 "test_pretrain.py::test_srun_tasks_join", "test_export_race.py::test_an_export_slower")


def is_cluster_test(nodeid: str) -> bool:
    return nodeid.removeprefix("tests/").startswith(CLUSTER_TESTS)


def pytest_xdist_make_scheduler(config, log):
    """xdist's load scheduling with the cluster tests as one unit of work (its `xdist_group` mark cannot do this
    under pytest 9: it renames the test's `_nodeid`, which pytest 9 no longer reads)."""
    from xdist.scheduler import LoadGroupScheduling

    class ClusterTestsTogether(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "cluster" if is_cluster_test(nodeid) else nodeid

    return ClusterTestsTogether(config, log)


# The suite's kinds, each test marked at collection (`pytest -m "not dag and not cluster"`: the unit tests alone).
MARKERS = {
    "dag": "runs Snakemake (the real DAG or a dry run), in the test or in a fixture it uses",
    "cluster": "needs the Slurm test cluster (docs/test-cluster.md; CLUSTER_TESTS)",
    "gpu": "needs a CUDA device (skipped without one)",
    "slow": "over 20 s alone on the 2-core development machine (SLOW_TESTS)",
}
# By nodeid prefix under tests/, as measured by `make test`'s --durations (2026-11-28: each over 20 s).
SLOW_TESTS = ("test_learning_parity.py::test_snakebert_and", "test_learning_parity.py::test_modernbert_and",
              "test_demo_dag.py::", "test_multinode.py::", "test_long_context.py::", "test_modernbert_dag.py::",
              "test_glue_rules.py::", "test_squad_rules.py::", "test_slurm.py::", "test_scaling.py::",
              "test_documents.py::", "test_corpora.py::", "test_tasks.py::", "test_modernbert_resume.py::",
              "test_modernbert_heads.py::test_squad_and_glue_run_through", "test_roberta.py::test_both_phases",
              "test_roberta_heads.py::test_squad_and_glue_run_through",
              "test_roberta.py::test_the_dags", "test_benchmarks.py::test_gpu_mode_on_cpu",
              "test_benchmarks.py::test_modernbert_gpu_mode_on_cpu", "test_pretrain.py::test_a_run_checkpointed_on_2",
              "test_shard.py::test_snakemake_runs_stages", "test_export_race.py::test_an_export_slower",
              "test_squad_finetune.py::test_sigterm", "test_model.py::test_the_mlm_head_at_real_slots_only_trains")
RUNS_SNAKEMAKE = re.compile(r"""["']snakemake["']|\bsnakemake\w*\(""")


def pytest_configure(config):
    for name, meaning in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {meaning}")


def runs_snakemake(item) -> bool:
    """Whether the test's function or a fixture it uses calls Snakemake."""
    functions = [item.function] + [definition.func for definitions in item._fixtureinfo.name2fixturedefs.values()
                                   for definition in definitions]
    for function in functions:
        try:
            source = inspect.getsource(function)
        except (OSError, TypeError):
            continue
        if RUNS_SNAKEMAKE.search(source):
            return True
    return False


def needs_cuda(item) -> bool:
    return any("CUDA" in str(mark.kwargs.get("reason", "")) for mark in item.iter_markers("skipif"))


def pytest_collection_modifyitems(items):
    strays = [item.nodeid for item in items if "cluster" in item.fixturenames and not is_cluster_test(item.nodeid)]
    if strays:
        raise pytest.UsageError(f"tests using the Slurm cluster but not in tests/conftest.py CLUSTER_TESTS: {strays}")
    for item in items:
        nodeid = item.nodeid.removeprefix("tests/")
        kinds = {"cluster": is_cluster_test(item.nodeid), "dag": runs_snakemake(item), "gpu": needs_cuda(item),
                 "slow": nodeid.startswith(SLOW_TESTS)}
        for kind in (kind for kind, applies in kinds.items() if applies):
            item.add_marker(getattr(pytest.mark, kind))


# The workflow's sources: what a user's checkout holds before any run (`slurm` is the bare-name profile link).
WORKFLOW_TREE = ("Snakefile", "config.yaml", "config.schema.yaml", "rules", "envs", "workflow", "profiles", "report",
                 "recipes", "sample", "slurm")


def copy_workflow(destination: Path) -> Path:
    """Copy the workflow's sources to `destination` and return it: tests run Snakemake there, never in the checkout,
    whose data/, results/, runs/, logs/ and .snakemake/ (a finished `make demo`, say) would change what it plans."""
    destination = Path(destination)
    destination.mkdir(parents=True, exist_ok=True)
    for name in WORKFLOW_TREE:
        source = REPO / name
        if source.is_symlink():
            (destination / name).symlink_to(os.readlink(source))
        elif source.is_dir():
            shutil.copytree(source, destination / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, destination / name)
    return destination


def snakemake_env(**extra: str) -> dict:
    """This environment with the test's Python first on PATH (rules call `python -m workflow...`)."""
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", **extra}


def embedded_in_report(html: str, path: Path) -> bool:
    """Whether a `snakemake --report` HTML holds this file's bytes (it embeds each as a base64 data URI)."""
    return f"filename={path.name};base64,{base64.b64encode(path.read_bytes()).decode()}" in html


def official_squad_v11(dataset: dict, predictions: dict[str, str]) -> dict[str, float]:
    """EM and F1 as the official evaluate-v1.1.py computes them (its functions, restated): a reference that shares
    no code with workflow.squad.evaluate."""
    def normalize_answer(s):
        s = s.lower()
        s = "".join(ch for ch in s if ch not in set(string.punctuation))
        s = re.sub(r"\b(a|an|the)\b", " ", s)
        return " ".join(s.split())

    def f1(prediction, ground_truth):
        prediction_tokens = normalize_answer(prediction).split()
        ground_truth_tokens = normalize_answer(ground_truth).split()
        num_same = sum((collections.Counter(prediction_tokens) & collections.Counter(ground_truth_tokens)).values())
        if num_same == 0:
            return 0
        precision, recall = num_same / len(prediction_tokens), num_same / len(ground_truth_tokens)
        return (2 * precision * recall) / (precision + recall)

    exact_match = f1_total = total = 0
    for article in dataset["data"]:
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                total += 1
                if qa["id"] not in predictions:
                    continue
                truths = [answer["text"] for answer in qa["answers"]]
                prediction = predictions[qa["id"]]
                exact_match += max(normalize_answer(prediction) == normalize_answer(t) for t in truths)
                f1_total += max(f1(prediction, t) for t in truths)
    return {"exact_match": 100.0 * exact_match / total, "f1": 100.0 * f1_total / total}


class LoopbackServer:
    """A real `http.server` on 127.0.0.1 serving one directory.

    - honours `Range: bytes=N-` / `bytes=N-M` requests (206 + Content-Range), like dumps.wikimedia.org;
    - `cut_once(name, after_bytes)` makes the next GET of `/name` announce the full length but close
      the connection after `after_bytes` body bytes (a dropped download);
    - `requests` records `(path, range_header_or_None)` of every GET, in order.
    """

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.requests: list[tuple[str, str | None]] = []
        self._cuts: dict[str, int] = {}
        self._lock = threading.Lock()
        server = self

        class Handler(SimpleHTTPRequestHandler):
            def log_message(self, *args):  # keep test output quiet
                pass

            def do_GET(self):
                name = self.path.split("?", 1)[0].lstrip("/")
                range_header = self.headers.get("Range")
                with server._lock:
                    server.requests.append(("/" + name, range_header))
                    cut = server._cuts.pop(name, None)
                path = server.directory / name
                if not path.is_file():
                    self.send_error(404)
                    return
                data = path.read_bytes()
                start, end = 0, len(data) - 1
                status = 200
                if range_header:
                    match = re.fullmatch(r"bytes=(\d+)-(\d*)", range_header.strip())
                    if not match:
                        self.send_error(400)
                        return
                    start = int(match.group(1))
                    end = int(match.group(2)) if match.group(2) else len(data) - 1
                    if start >= len(data):
                        self.send_response(416)
                        self.send_header("Content-Range", f"bytes */{len(data)}")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    end = min(end, len(data) - 1)
                    status = 206
                body = data[start : end + 1]
                self.send_response(status)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Content-Length", str(len(body)))
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
                self.end_headers()
                if cut is not None:
                    self.wfile.write(body[:cut])
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                    return
                self.wfile.write(body)

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    def cut_once(self, name: str, after_bytes: int) -> None:
        """The next GET of `name` sends only `after_bytes` body bytes, then drops the connection."""
        with self._lock:
            self._cuts[name] = after_bytes

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


@pytest.fixture
def http_server(tmp_path):
    """Factory: `http_server(directory)` -> a running LoopbackServer (stopped after the test)."""
    servers = []

    def start(directory=tmp_path):
        server = LoopbackServer(directory)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


@pytest.fixture
def workflow_copy(tmp_path):
    """A scratch copy of the workflow (see copy_workflow) under this test's tmp_path."""
    return copy_workflow(tmp_path / "workflow")


@pytest.fixture(scope="session")
def sample_dir():
    """The bundled sample data (read-only: copy before modifying)."""
    return SAMPLE


@pytest.fixture(scope="session")
def repo_env():
    """Environment for subprocesses running `python -m workflow.<stage>` from anywhere."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture
def one_torch_thread():
    """One torch thread: on a busy 2-core machine two spinning OpenMP threads make these runs ~10x slower."""
    import torch  # here, not at the top: most test files never load torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
