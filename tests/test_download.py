"""Stage 1: downloads over real HTTP (127.0.0.1) and file://, resumed with Range, verified before promotion."""
import hashlib
import shutil
import subprocess
import sys

import pytest

from workflow.cli import UserError
from workflow.data.download import fetch, fetch_books

DUMP = "enwiki-sample-pages-articles.xml.bz2"


@pytest.fixture
def served(tmp_path, sample_dir, http_server):
    """A loopback server over a copy of the sample dump, its md5sums list and a books URL list."""
    root = tmp_path / "site"
    root.mkdir()
    shutil.copy(sample_dir / DUMP, root)
    shutil.copy(sample_dir / "enwiki-sample-md5sums.txt", root)
    return http_server(root)


def test_http_download_verifies_md5_and_promotes(served, sample_dir, tmp_path):
    destination = tmp_path / "out" / "wikipedia.xml.bz2"
    fetch(f"{served.url}/{DUMP}", destination, f"{served.url}/enwiki-sample-md5sums.txt")
    assert destination.read_bytes() == (sample_dir / DUMP).read_bytes()
    assert not destination.with_name("wikipedia.xml.bz2.part").exists()


def test_file_url_and_plain_path_both_work(sample_dir, tmp_path):
    expected = (sample_dir / DUMP).read_bytes()
    by_url = fetch((sample_dir / DUMP).as_uri(), tmp_path / "a.bz2", (sample_dir / "enwiki-sample-md5sums.txt").as_uri())
    by_path = fetch(str(sample_dir / DUMP), tmp_path / "b.bz2", str(sample_dir / "enwiki-sample-md5sums.txt"))
    assert by_url.read_bytes() == expected and by_path.read_bytes() == expected


def test_dropped_connection_is_resumed_with_a_range_request(served, sample_dir, tmp_path):
    served.cut_once(DUMP, 10_000)
    destination = tmp_path / "wikipedia.xml.bz2"
    fetch(f"{served.url}/{DUMP}", destination, f"{served.url}/enwiki-sample-md5sums.txt")
    assert destination.read_bytes() == (sample_dir / DUMP).read_bytes()
    gets = [request for request in served.requests if request[0] == f"/{DUMP}"]
    assert gets == [(f"/{DUMP}", None), (f"/{DUMP}", "bytes=10000-")]


def test_interrupted_run_leaves_part_and_next_run_resumes_it(served, sample_dir, tmp_path):
    served.cut_once(DUMP, 7_000)
    destination = tmp_path / "wikipedia.xml.bz2"
    part = tmp_path / "wikipedia.xml.bz2.part"
    with pytest.raises(UserError, match=r"download interrupted after 7000 bytes.*rerun to resume"):
        fetch(f"{served.url}/{DUMP}", destination, retries=0)
    assert not destination.exists() and part.stat().st_size == 7_000
    fetch(f"{served.url}/{DUMP}", destination, f"{served.url}/enwiki-sample-md5sums.txt")
    assert destination.read_bytes() == (sample_dir / DUMP).read_bytes()
    assert served.requests[-1] == (f"/{DUMP}", "bytes=7000-")


def test_bad_checksum_is_rejected_and_nothing_promoted(served, tmp_path):
    (served.directory / "bad-md5sums.txt").write_text(f"{'0' * 32}  {DUMP}\n")
    destination = tmp_path / "wikipedia.xml.bz2"
    with pytest.raises(UserError, match=r"md5 mismatch \(expected 0{32}, got [0-9a-f]{32}\); nothing kept"):
        fetch(f"{served.url}/{DUMP}", destination, f"{served.url}/bad-md5sums.txt")
    assert list(tmp_path.glob("wikipedia*")) == []


def test_sha1_list_is_accepted(served, sample_dir, tmp_path):
    sha1 = hashlib.sha1((sample_dir / DUMP).read_bytes()).hexdigest()
    (served.directory / "sha1sums.txt").write_text(f"{'1' * 40}  other.xml.bz2\n{sha1}  {DUMP}\n")
    destination = fetch(f"{served.url}/{DUMP}", tmp_path / "w.bz2", f"{served.url}/sha1sums.txt")
    assert hashlib.sha1(destination.read_bytes()).hexdigest() == sha1


def test_checksum_list_not_naming_the_file_is_an_error(served, tmp_path):
    (served.directory / "other-md5sums.txt").write_text(f"{'0' * 32}  something-else.xml.bz2\n")
    with pytest.raises(UserError, match=f"no md5/sha1 checksum line for '{DUMP}'"):
        fetch(f"{served.url}/{DUMP}", tmp_path / "w.bz2", f"{served.url}/other-md5sums.txt")
    assert list(tmp_path.glob("w.bz2*")) == []


def test_cli_error_is_one_line_naming_the_url(served, tmp_path, repo_env):
    url = f"{served.url}/missing.xml.bz2"
    result = subprocess.run(
        [sys.executable, "-m", "workflow.data.download", "file", "--url", url, "--checksum-url=", "--output", str(tmp_path / "x")],
        capture_output=True, text=True, env=repo_env,
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == f"error: {url}: HTTP 404 Not Found"
    assert "Traceback" not in result.stderr and not (tmp_path / "x").exists()


def test_books_from_a_directory_and_from_a_url_list(served, sample_dir, tmp_path):
    books = sorted(sample_dir.glob("books/*.txt"))
    copied = fetch_books(str(sample_dir / "books"), tmp_path / "from-dir")
    assert sorted(p.name for p in copied.iterdir()) == [b.name for b in books]
    lines = []
    for book in books:
        shutil.copy(book, served.directory)
        lines.append(f"{served.url}/{book.name}  {hashlib.md5(book.read_bytes()).hexdigest()}")
    (served.directory / "books.txt").write_text("# BookCorpus sample\n" + "\n".join(lines) + "\n")
    served.cut_once(books[0].name, 500)
    fetched = fetch_books(f"{served.url}/books.txt", tmp_path / "from-urls")
    for book in books:
        assert (fetched / book.name).read_bytes() == book.read_bytes()
    assert not (tmp_path / "from-urls.part").exists()


def test_a_complete_part_left_before_the_rename_is_verified_and_promoted(served, sample_dir, tmp_path):
    (tmp_path / "wikipedia.xml.bz2.part").write_bytes((sample_dir / DUMP).read_bytes())
    destination = fetch(f"{served.url}/{DUMP}", tmp_path / "wikipedia.xml.bz2", f"{served.url}/enwiki-sample-md5sums.txt")
    assert destination.read_bytes() == (sample_dir / DUMP).read_bytes()
    size = (sample_dir / DUMP).stat().st_size
    assert served.requests[-1] == (f"/{DUMP}", f"bytes={size}-")  # answered 416: nothing left to send


def test_latest_name_is_checked_against_the_dated_line_of_the_dump_sites_list(served, sample_dir, tmp_path):
    # dumps.wikimedia.org's enwiki-latest-md5sums.txt names enwiki-YYYYMMDD-..., never enwiki-latest-...
    latest = "enwiki-latest-pages-articles.xml.bz2"
    shutil.copy(sample_dir / DUMP, served.directory / latest)
    md5 = hashlib.md5((sample_dir / DUMP).read_bytes()).hexdigest()
    (served.directory / "enwiki-latest-md5sums.txt").write_text(
        f"{'0' * 32}  enwiki-20240601-pages-articles-multistream.xml.bz2\n{md5}  enwiki-20240601-pages-articles.xml.bz2\n"
    )
    destination = fetch(f"{served.url}/{latest}", tmp_path / "w.bz2", f"{served.url}/enwiki-latest-md5sums.txt")
    assert hashlib.md5(destination.read_bytes()).hexdigest() == md5
    (served.directory / "bad-latest-md5sums.txt").write_text(f"{'0' * 32}  enwiki-20240601-pages-articles.xml.bz2\n")
    with pytest.raises(UserError, match="md5 mismatch"):
        fetch(f"{served.url}/{latest}", tmp_path / "v.bz2", f"{served.url}/bad-latest-md5sums.txt")


def test_a_503_from_an_overloaded_mirror_is_retried(served, sample_dir, tmp_path, monkeypatch):
    import urllib.error
    import urllib.request

    real_urlopen, calls = urllib.request.urlopen, []

    def flaky_urlopen(request, *args, **kwargs):
        if isinstance(request, urllib.request.Request):  # the dump, not the checksum list
            calls.append(request)
            if len(calls) == 1:
                raise urllib.error.HTTPError(request.full_url, 503, "Service Unavailable", {}, None)
        return real_urlopen(request, *args, **kwargs)

    monkeypatch.setattr(urllib.request, "urlopen", flaky_urlopen)
    destination = fetch(f"{served.url}/{DUMP}", tmp_path / "w.bz2", f"{served.url}/enwiki-sample-md5sums.txt")
    assert destination.read_bytes() == (sample_dir / DUMP).read_bytes()
    assert len(calls) >= 2


# --- a local dump (checksum_url left null): the md5sums list beside it, if any ---


def run_dump_cli(url, output, env, checksum_url=""):
    return subprocess.run(
        [sys.executable, "-m", "workflow.data.download", "dump", "--url", str(url), f"--checksum-url={checksum_url}",
         "--output", str(output)], capture_output=True, text=True, env=env,
    )


def test_a_local_dump_is_verified_against_the_md5sums_list_beside_it(sample_dir, tmp_path, repo_env):
    local = tmp_path / "export"
    local.mkdir()
    shutil.copy(sample_dir / DUMP, local)
    shutil.copy(sample_dir / "enwiki-sample-md5sums.txt", local)
    result = run_dump_cli(local / DUMP, tmp_path / "w.bz2", repo_env)
    assert result.returncode == 0, result.stderr
    assert "md5 verified" in result.stderr and "nothing verified" not in result.stderr
    assert (tmp_path / "w.bz2").read_bytes() == (sample_dir / DUMP).read_bytes()
    # the list beside it is really used: a wrong digest there rejects the dump
    (local / "enwiki-sample-md5sums.txt").write_text(f"{'0' * 32}  {DUMP}\n")
    result = run_dump_cli(local / DUMP, tmp_path / "v.bz2", repo_env)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 1 and len(errors) == 1 and "md5 mismatch" in errors[0]
    assert not (tmp_path / "v.bz2").exists() and not (tmp_path / "v.bz2.part").exists()


def test_a_local_dump_with_no_list_beside_it_is_copied_and_the_log_says_nothing_was_verified(sample_dir, tmp_path, repo_env):
    local = tmp_path / "export"
    local.mkdir()
    shutil.copy(sample_dir / DUMP, local)
    result = run_dump_cli(local / DUMP, tmp_path / "w.bz2", repo_env)
    assert result.returncode == 0, result.stderr
    assert f"{local / DUMP}: nothing verified: wikipedia.checksum_url is not set and no enwiki-sample-md5sums.txt" \
        in result.stderr
    assert "error" not in result.stderr and "verified (" not in result.stderr
    assert (tmp_path / "w.bz2").read_bytes() == (sample_dir / DUMP).read_bytes()


def test_a_remote_dump_is_verified_against_the_list_beside_it_on_the_dump_site(served, sample_dir, tmp_path, repo_env):
    result = run_dump_cli(f"{served.url}/{DUMP}", tmp_path / "w.bz2", repo_env)
    assert result.returncode == 0 and "md5 verified" in result.stderr, result.stderr
    assert ("/enwiki-sample-md5sums.txt", None) in served.requests


# --- the dump in parts: the part list comes from the dump's md5sums list ---

LISTING = """\
{0}  enwiki-20240601-pages-articles-multistream2.xml-p41243p151573.bz2
{1}  enwiki-20240601-pages-articles2.xml-p41243p151573.bz2
{2}  enwiki-20240601-pages-articles.xml.bz2
{3}  enwiki-20240601-pages-articles10.xml-p4045403p5399366.bz2
{4}  enwiki-20240601-pages-articles1.xml-p1p41242.bz2
{5}  enwiki-20240601-stub-articles1.xml-p1p41242.gz
""".format(*(f"{i:032x}" for i in range(6)))


def test_parts_are_the_pages_articles_files_of_the_list_in_page_id_order():
    from workflow.data.download import listed_parts

    parts = listed_parts("https://mirror.example/enwiki/20240601/enwiki-20240601-pages-articles.xml.bz2", "md5s", LISTING)
    assert [part.name for part in parts] == ["p1p41242", "p41243p151573", "p4045403p5399366"]
    assert [part.url for part in parts] == [
        "https://mirror.example/enwiki/20240601/enwiki-20240601-pages-articles1.xml-p1p41242.bz2",
        "https://mirror.example/enwiki/20240601/enwiki-20240601-pages-articles2.xml-p41243p151573.bz2",
        "https://mirror.example/enwiki/20240601/enwiki-20240601-pages-articles10.xml-p4045403p5399366.bz2",
    ]
    assert {part.checksum_url for part in parts} == {"md5s"}


def test_parts_of_a_latest_dump_are_fetched_from_its_dated_directory():
    from workflow.data.download import listed_parts

    parts = listed_parts("https://dumps.wikimedia.org/enwiki/latest/enwiki-latest-pages-articles.xml.bz2", "m", LISTING)
    assert parts[0].url == "https://dumps.wikimedia.org/enwiki/20240601/enwiki-20240601-pages-articles1.xml-p1p41242.bz2"
    elsewhere = listed_parts("/data/dumps/enwiki-latest-pages-articles.xml.bz2", "m", LISTING)
    assert elsewhere[0].url == "/data/dumps/enwiki-latest-pages-articles1.xml-p1p41242.bz2"


def test_overlapping_parts_are_an_error_naming_both():
    from workflow.data.download import listed_parts

    listing = f"{'0' * 32}  enwiki-x-pages-articles1.xml-p1p100.bz2\n{'1' * 32}  enwiki-x-pages-articles2.xml-p90p200.bz2\n"
    with pytest.raises(UserError, match="parts enwiki-x-pages-articles1.xml-p1p100.bz2 and enwiki-x-pages-articles2"):
        listed_parts("enwiki-x-pages-articles.xml.bz2", "list", listing)


def test_the_remote_part_list_is_fetched_once_and_every_part_is_checked_against_that_copy(http_server, tmp_path, sample_dir):
    from workflow.data.download import dump_parts, fetch_dump

    served = http_server(sample_dir / "parts")
    url = f"{served.url}/enwiki-sample-pages-articles.xml.bz2"
    cache = tmp_path / "cache"
    first = dump_parts(url, None, "auto", cache)
    second = dump_parts(url, None, "auto", cache)
    assert first == second
    assert [part.name for part in first] == ["p1001p1016", "p1017p1032", "p1033p1048"]
    assert served.requests == [("/enwiki-sample-md5sums.txt", None)]  # the second DAG build reads the copy
    assert {part.checksum_url for part in first} == {str(cache / "enwiki-sample-md5sums.txt")}
    for part in first:
        destination = fetch_dump(part.url, tmp_path / f"{part.name}.xml.bz2", part.checksum_url)
        assert destination.read_bytes() == (sample_dir / "parts" / part.url.rsplit("/", 1)[1]).read_bytes()
    assert [path for path, _ in served.requests].count("/enwiki-sample-md5sums.txt") == 1


def test_single_or_no_listed_parts_mean_the_one_file(sample_dir, tmp_path, http_server):
    from workflow.data.download import dump_parts

    whole = str(sample_dir / DUMP)
    assert [(p.name, p.url) for p in dump_parts(whole, None, "auto", tmp_path)] == [("whole", whole)]  # lists no parts
    parts_url = str(sample_dir / "parts" / DUMP)
    assert [p.name for p in dump_parts(parts_url, None, "single", tmp_path)] == ["whole"]
    assert len(dump_parts(parts_url, None, "auto", tmp_path)) == 3
    nothing = http_server(tmp_path)  # serves no md5sums list: the one file, verified by nobody (logged when fetched)
    assert [p.name for p in dump_parts(f"{nothing.url}/{DUMP}", None, "auto", tmp_path / "c")] == ["whole"]
    with pytest.raises(UserError, match="HTTP 404"):  # a list the user names must exist
        dump_parts(f"{nothing.url}/{DUMP}", f"{nothing.url}/md5sums.txt", "auto", tmp_path / "c")


@pytest.mark.parametrize("content, reason", [
    ("utf-16", r"not UTF-8 \(UTF-16\); .* bzcat enwiki-20240601-pages-articles\.xml\.bz2 \| iconv -f UTF-16 -t UTF-8 .*"),
    ("html", r"not a MediaWiki XML export \(root element: <html>\)"),  # a proxy's or mirror's error page
    ("gzip", r"not a bz2 file \(bad magic number b'\\x1f\\x8b\\x08'\); .* compress a plain XML export with bzip2"),
    ("xml", r"not a bz2 file \(bad magic number b'<me'\); .*"),  # Special:Export's .xml, even named so
])
def test_a_dump_that_is_not_a_utf8_mediawiki_export_stops_its_download_naming_the_url(http_server, sample_dir,
                                                                                      tmp_path, content, reason):
    """Refused where it is downloaded, naming the URL the user gave, with nothing kept to look like a dump."""
    import bz2
    import gzip
    import re

    from workflow.data.download import fetch_dump

    xml = (sample_dir / "enwiki-sample-pages-articles.xml").read_text(encoding="utf-8")
    data = {"utf-16": lambda: bz2.compress(xml.encode("utf-16")), "gzip": lambda: gzip.compress(xml.encode()),
            "html": lambda: bz2.compress(b"<!DOCTYPE html><html><body>Service unavailable</body></html>"),
            "xml": lambda: xml.encode()}[content]()
    name = "enwiki-20240601-pages-articles.xml" + ("" if content == "xml" else ".bz2")
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / name).write_bytes(data)
    url = f"{http_server(tmp_path / 'site').url}/{name}"
    with pytest.raises(UserError) as error:
        fetch_dump(url, tmp_path / "out" / "whole.xml.bz2")
    assert re.fullmatch(f"{re.escape(url)}: {reason}", str(error.value)), error.value
    assert list((tmp_path / "out").iterdir()) == []
