"""Stage 4: balanced, deterministic, complete shards; and stages 1-4 run for real by snakemake on the sample."""
import collections
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

import workflow.data.shard
from workflow.cli import UserError
from workflow.data.extract import extract
from workflow.data.format import format_corpus
from workflow.data.shard import assign, shard_corpus

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def formatted(tmp_path_factory, sample_dir):
    """The sample, formatted like the demo: Wikipedia articles and the two books, sentences style."""
    root = tmp_path_factory.mktemp("formatted")
    extract(sample_dir / "enwiki-sample-pages-articles.xml.bz2", root / "wikipedia.jsonl", processes=2)
    format_corpus(root / "wikipedia.jsonl", root / "wikipedia.txt", min_article_chars=100)
    format_corpus(sample_dir / "books", root / "bookcorpus.txt", min_article_chars=100)
    return [root / "wikipedia.txt", root / "bookcorpus.txt"]


def documents_of(path: Path) -> list[str]:
    return [block for block in path.read_text(encoding="utf-8").split("\n\n") if block.strip()]


def make_shards(formatted, root: Path, n_training=4, n_test=1, seed=12345, **options):
    report = shard_corpus(formatted, root / "training", root / "test", n_training, n_test, seed=seed, **options)
    files = sorted((root / "training").glob("shard_*.txt")) + sorted((root / "test").glob("shard_*.txt"))
    return report, files


def test_every_document_lands_in_exactly_one_shard(formatted, tmp_path):
    _, files = make_shards(formatted, tmp_path)
    assert [f.name for f in files] == ["shard_0.txt", "shard_1.txt", "shard_2.txt", "shard_3.txt", "shard_0.txt"]
    sharded = collections.Counter(doc for f in files for doc in documents_of(f))
    corpus = collections.Counter(doc for path in formatted for doc in documents_of(path))
    assert sharded == corpus and sum(corpus.values()) == 43
    for f in files:  # the layout tokenize reads: sentence lines, one blank line after each document
        text = f.read_text(encoding="utf-8")
        assert text and text.endswith("\n\n") and "\n\n\n" not in text and not text.startswith("\n")


def test_shards_are_balanced_by_size(formatted, tmp_path):
    report, files = make_shards(formatted[:1], tmp_path, n_training=8, n_test=2)
    sizes = [f.stat().st_size for f in files[:8]]
    assert sizes == report["training"]
    ratio = max(sizes) / min(sizes)
    largest_document = max(len(doc.encode()) + 2 for doc in documents_of(formatted[0]))
    print(f"8 training shards of the sample's Wikipedia: {min(sizes)}..{max(sizes)} bytes, max/min {ratio:.3f}")
    assert max(sizes) - min(sizes) <= largest_document  # the LPT bound
    assert ratio < 1.15


def test_assignment_of_a_large_synthetic_corpus_is_tightly_balanced():
    sizes = np.random.default_rng(0).lognormal(8, 1.2, size=200_000).astype(np.int64) + 1  # Wikipedia-like tail
    shard_of = assign(sizes, 256, 256, 0.1, seed=12345)
    loads = np.bincount(shard_of, weights=sizes, minlength=512)
    training, test = loads[:256], loads[256:]
    print(f"200k documents -> 256+256 shards: max/min training {training.max() / training.min():.5f}, "
          f"test {test.max() / test.min():.5f}")
    assert training.max() / training.min() < 1.01 and test.max() / test.min() < 1.05
    assert abs((shard_of >= 256).mean() - 0.1) < 1e-3


def test_same_seed_gives_identical_bytes_and_another_seed_another_assignment(formatted, tmp_path):
    _, first = make_shards(formatted, tmp_path / "a", seed=7)
    _, again = make_shards(formatted, tmp_path / "b", seed=7)
    _, other = make_shards(formatted, tmp_path / "c", seed=8)
    assert [f.read_bytes() for f in first] == [f.read_bytes() for f in again]
    assert [f.read_bytes() for f in first] != [f.read_bytes() for f in other]
    assert set(documents_of(first[-1])) != set(documents_of(other[-1]))  # a different test set


def test_small_write_buffers_give_the_same_shards(formatted, tmp_path, monkeypatch):
    _, reference = make_shards(formatted, tmp_path / "a")
    monkeypatch.setattr(workflow.data.shard, "BUFFER_BYTES", 512)  # flush every few documents: the streaming path
    _, streamed = make_shards(formatted, tmp_path / "b")
    assert [f.read_bytes() for f in reference] == [f.read_bytes() for f in streamed]


def test_articles_style_input_still_gives_one_sentence_per_line(formatted, tmp_path):
    articles = tmp_path / "articles.txt"
    articles.write_text("".join(" ".join(doc.split("\n")) + "\n" for doc in documents_of(formatted[0])), encoding="utf-8")
    _, files = make_shards([articles], tmp_path / "shards", n_training=2, n_test=1, style="articles")
    sentences = [line for f in files for doc in documents_of(f) for line in doc.split("\n")]
    reference = [line for doc in documents_of(formatted[0]) for line in doc.split("\n")]
    assert len(sentences) > 0.95 * len(reference)
    assert collections.Counter(sentences).most_common(1)[0][1] < 20  # not one giant line per document
    assert sum(map(len, documents_of(files[0]))) > 0


def test_too_many_shards_for_the_corpus_is_a_one_line_error_with_no_output(formatted, tmp_path, repo_env):
    command = [sys.executable, "-m", "workflow.data.shard", "--input", *map(str, formatted),
               "--output-dir", str(tmp_path / "shards"), "--n-training-shards", "40", "--n-test-shards", "4"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, env=repo_env)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "error: corpus too small: 43 documents cannot fill 40 training + 4 test shards "
        "(test_fraction 0.1 puts 4 in test); use fewer shards or more text"
    )
    assert list(tmp_path.iterdir()) == []  # nothing promoted, no temporary left behind


def test_missing_input_is_an_error(tmp_path):
    with pytest.raises(UserError, match="nothing.txt: no such file"):
        shard_corpus([tmp_path / "nothing.txt"], tmp_path / "a", tmp_path / "b", 1, 1)


def run_data_rules(work: Path, wikipedia: dict, cores: int, env: dict) -> subprocess.CompletedProcess:
    """`snakemake data/shards` in `work` on the real rule files, the sample config with `wikipedia` overriding."""
    work.mkdir()
    # only the data-prep rules (the other stages are not under test here), from the real rule files
    (work / "Snakefile").write_text(
        f'configfile: "{REPO}/config.yaml"\n'
        + "".join(f'include: "{REPO}/rules/{name}.smk"\n' for name in ("common", "download", "extract", "format", "shard"))
    )
    config = yaml.safe_load((REPO / "sample" / "config.yaml").read_text())
    config = {key: config[key] for key in ("wikipedia", "bookcorpus", "format", "shard")}
    config["wikipedia"] = {"date": config["wikipedia"]["date"], **wikipedia}  # the sample's name carries none
    config["bookcorpus"]["source"] = str(REPO / "sample" / "books")
    (work / "config.yaml").write_text(yaml.safe_dump(config))
    return subprocess.run([sys.executable, "-m", "snakemake", "data/shards", "--cores", str(cores), "--configfile",
                           "config.yaml"], cwd=work, capture_output=True, text=True, env=env)


def shard_bytes(work: Path) -> dict[str, bytes]:
    return {str(path.relative_to(work)): path.read_bytes() for path in sorted((work / "data/shards").glob("*/*"))}


def test_snakemake_runs_stages_1_to_4_over_http_on_the_dump_as_one_file_or_in_parts_with_identical_shards(
    tmp_path, sample_dir, http_server, repo_env
):
    # the dump site: the whole dump, its three parts and the md5sums list naming them all, as dumps.wikimedia.org
    site = tmp_path / "site"
    shutil.copytree(sample_dir / "parts", site)
    shutil.copy(sample_dir / "enwiki-sample-pages-articles.xml.bz2", site)
    server = http_server(site)
    dump_url = f"{server.url}/enwiki-sample-pages-articles.xml.bz2"
    single = tmp_path / "single"
    result = run_data_rules(single, {"url": dump_url, "checksum_url": f"{server.url}/enwiki-sample-md5sums.txt",
                                     "parts": "single"}, 2, repo_env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    shard_files = [f"data/shards/training/shard_{i}.txt" for i in range(4)] + ["data/shards/test/shard_0.txt"]
    assert sorted(shard_bytes(single)) == sorted(shard_files)
    sharded = collections.Counter(doc for f in shard_files for doc in documents_of(single / f))
    corpus = collections.Counter(doc for name in ("wikipedia/whole", "bookcorpus")
                                 for doc in documents_of(single / "data" / "formatted" / f"{name}.txt"))
    assert sharded == corpus and len(corpus) == 43
    assert (single / "data/download/wikipedia/whole.xml.bz2").read_bytes() == \
        (sample_dir / "enwiki-sample-pages-articles.xml.bz2").read_bytes()
    assert "md5 verified" in (single / "logs/download_wikipedia/whole.log").read_text()
    assert "max/min" in (single / "logs/shard/shard.log").read_text()
    # nothing left to do: the outputs are complete and up to date
    dry = subprocess.run([sys.executable, "-m", "snakemake", "data/shards", "-n", "--configfile", "config.yaml"],
                         cwd=single, capture_output=True, text=True, env=repo_env)
    assert dry.returncode == 0 and "Nothing to be done" in dry.stdout + dry.stderr

    # the same dump in parts (wikipedia.parts: auto, the md5sums list beside the dump), with 1 and with 2 cores
    server.requests.clear()
    parts = {"p1001p1016": 1, "p1017p1032": 2, "p1033p1048": 3}
    cut = "enwiki-sample-pages-articles2.xml-p1017p1032.bz2"
    server.cut_once(cut, 5_000)  # the connection drops mid-part: the download job resumes it
    for cores in (1, 2):
        work = tmp_path / f"parts-{cores}"
        result = run_data_rules(work, {"url": dump_url}, cores, repo_env)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        for part, number in parts.items():
            name = f"enwiki-sample-pages-articles{number}.xml-{part}.bz2"
            assert (work / f"data/download/wikipedia/{part}.xml.bz2").read_bytes() == (site / name).read_bytes()
            assert "md5 verified" in (work / f"logs/download_wikipedia/{part}.log").read_text()
        formatted = work / "data/formatted/wikipedia"
        assert sorted(p.name for p in formatted.glob("*.txt")) == [f"{p}.txt" for p in parts]
        # the parts' drop counts add up to the one-file run's
        whole = json.loads((single / "data/formatted/wikipedia/whole.summary.json").read_text())
        for unit in ("documents", "paragraphs", "characters"):
            summaries = [json.loads((formatted / f"{part}.summary.json").read_text())[unit] for part in parts]
            assert sum(s["kept"] for s in summaries) == whole[unit]["kept"], unit
            assert {r: sum(s["dropped"][r] for s in summaries) for r in whole[unit]["dropped"]} == whole[unit]["dropped"]
        # a part's articles use templates defined in another part ({{convert}} is in the last one)
        assert "Alderbrook lies 16 km south-east" in (work / "data/extracted/wikipedia/p1001p1016.jsonl").read_text()
        assert shard_bytes(work) == shard_bytes(single)
    gets = [path for path, _ in server.requests]
    assert sorted(set(gets)) == sorted(f"/{name}" for name in [*(p.name for p in site.glob("*.xml-p*.bz2")),
                                                              "enwiki-sample-md5sums.txt"])
    assert gets.count("/enwiki-sample-md5sums.txt") == 2  # once per working directory (then its cached copy)
    assert "/enwiki-sample-pages-articles.xml.bz2" not in gets  # the whole file is not downloaded as well
    assert [request for request in server.requests if request[0] == f"/{cut}"] == [
        (f"/{cut}", None), (f"/{cut}", "bytes=5000-"), (f"/{cut}", None)]  # cut, resumed; then the 2-core run


def test_measuring_the_parts_in_parallel_gives_the_same_shards(formatted, tmp_path):
    parts = []
    for number, path in enumerate(formatted):  # more inputs than processes, in a fixed order
        documents = documents_of(path)
        for half, chunk in enumerate((documents[: len(documents) // 2], documents[len(documents) // 2 :])):
            part = tmp_path / f"part{number}{half}.txt"
            part.write_text("".join(doc + "\n\n" for doc in chunk), encoding="utf-8")
            parts.append(part)
    _, reference = make_shards(formatted, tmp_path / "a")
    _, parallel = make_shards(parts, tmp_path / "b", processes=3)
    assert [f.read_bytes() for f in parallel] == [f.read_bytes() for f in reference]


def test_a_part_failing_its_checksum_stops_the_run_with_one_error_line_and_nothing_promoted(
    tmp_path, sample_dir, http_server, repo_env
):
    site = tmp_path / "site"
    shutil.copytree(sample_dir / "parts", site)
    listing = site / "enwiki-sample-md5sums.txt"
    bad = "enwiki-sample-pages-articles2.xml-p1017p1032.bz2"
    listing.write_text("".join(f"{'0' * 32}  {bad}\n" if line.endswith(f"  {bad}") else line + "\n"
                               for line in listing.read_text().splitlines()))
    server = http_server(site)
    work = tmp_path / "work"
    result = run_data_rules(work, {"url": f"{server.url}/enwiki-sample-pages-articles.xml.bz2"}, 2, repo_env)
    assert result.returncode != 0
    log = (work / "logs/download_wikipedia/p1017p1032.log").read_text()
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {server.url}/{bad}: md5 mismatch (expected {'0' * 32}, "
                      f"got {hashlib.md5((site / bad).read_bytes()).hexdigest()}); nothing kept"]
    assert "Traceback" not in log
    assert not list((work / "data/download/wikipedia").glob("*p1017p1032*"))  # neither the file nor its .part
    assert not (work / "data/shards").exists()
