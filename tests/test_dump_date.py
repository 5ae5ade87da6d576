"""Magic words take the dump's date, never the clock: {{CURRENTYEAR}} and the templates built on it read the same
whatever day a part is extracted; the date comes from the dump's name, wikipedia.date, or a latest dump's list."""
import bz2
import datetime
import hashlib
import json
import shutil
import subprocess
import sys

import pytest

from benchmarks.wikipedia_sample import pypy_python
from tests.conftest import REPO, snakemake_env
from workflow.cli import UserError
from workflow.data.download import dump_date, record_dump_date
from workflow.data.extract import date_magic_words, extract

SAMPLE_XML = "enwiki-sample-pages-articles.xml"
# An article that reads the clock directly and through a template, as {{age}} and {{birth date and age}} do
CLOCK_PAGES = """  <page>
    <title>Template:Age</title>
    <ns>10</ns>
    <id>2001</id>
    <revision><id>20011</id><timestamp>2024-01-01T00:00:00Z</timestamp>
      <text xml:space="preserve">{{#expr: {{CURRENTYEAR}} - {{{1}}} }}</text>
    </revision>
  </page>
  <page>
    <title>Clockwork Museum</title>
    <ns>0</ns>
    <id>2002</id>
    <revision><id>20021</id><timestamp>2024-01-02T00:00:00Z</timestamp>
      <text xml:space="preserve">The Clockwork Museum, founded in 1990, is {{Age|1990}} years old. Its prices are given in {{CURRENTYEAR}} dollars, as of {{CURRENTDAY}} {{CURRENTMONTHNAME}} {{CURRENTYEAR}} at {{CURRENTTIME}} ({{CURRENTDAYNAME}}, {{CURRENTTIMESTAMP}}).</text>
    </revision>
  </page>
</mediawiki>"""
MUSEUM = ("The Clockwork Museum, founded in 1990, is 34 years old. Its prices are given in 2024 dollars, as of 1 "
          "October 2024 at 00:00 (Tuesday, 20241001000000).")


@pytest.fixture
def clock_dump(tmp_path, sample_dir):
    """The sample dump of 2024-10-01 with a template and an article that read the clock."""
    path = tmp_path / "enwiki-20241001-pages-articles.xml"
    path.write_text((sample_dir / SAMPLE_XML).read_text(encoding="utf-8").replace("</mediawiki>", CLOCK_PAGES),
                    encoding="utf-8")
    return path


def museum(path):
    return next(json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines()
                if json.loads(line)["title"] == "Clockwork Museum")


def test_a_dated_dump_writes_its_own_year_and_day(tmp_path, clock_dump):
    dump = clock_dump
    extract(dump, tmp_path / "dated.jsonl")
    assert museum(tmp_path / "dated.jsonl") == MUSEUM
    # the date given wins over an undated name (as the workflow passes wikipedia.date)
    undated = shutil.copy(dump, tmp_path / "export.xml")
    extract(undated, tmp_path / "given.jsonl", date=datetime.date(2031, 6, 15))
    assert museum(tmp_path / "given.jsonl") == ("The Clockwork Museum, founded in 1990, is 41 years old. Its prices "
                                                "are given in 2031 dollars, as of 15 June 2031 at 00:00 (Sunday, "
                                                "20310615000000).")


PYPY = pypy_python()


@pytest.mark.skipif(shutil.which("faketime") is None, reason="no libfaketime here (Debian: apt install faketime)")
@pytest.mark.parametrize("python", [  # and the extract rule's PyPy
    pytest.param(sys.executable, id="cpython"),
    pytest.param(PYPY, id="pypy", marks=pytest.mark.skipif(PYPY is None, reason="no PyPy"))])
def test_the_sample_extracted_under_two_clocks_is_byte_identical(tmp_path, clock_dump, repo_env, python):
    dump = clock_dump
    outputs = []
    for clock in ("2026-12-31 23:59:58", "2027-01-01 08:30:01"):  # a year apart, and seconds
        output = tmp_path / f"{clock[:4]}.jsonl"
        # libfaketime moves the clock of the command and of every process it starts (wikiextractor's workers)
        result = subprocess.run(["faketime", clock, str(python), "-c", "import time; print(time.strftime('%Y'))"],
                                capture_output=True, text=True, check=True)
        assert result.stdout.strip() == clock[:4]
        subprocess.run(["faketime", clock, str(python), "-m", "workflow.data.extract", "--input", str(dump),
                        "--output", str(output), "--processes", "2"], capture_output=True, text=True, check=True,
                       env=repo_env)
        outputs.append(output.read_bytes())
    assert outputs[0] == outputs[1]
    assert museum(output) == MUSEUM


def test_magic_words_are_mediawikis_at_midnight_utc():
    words = date_magic_words(datetime.date(2024, 1, 7))
    assert {name: words[name] for name in ("currentyear", "currentmonth", "currentmonth1", "currentday",
                                           "currentday2", "currentdow", "currentweek", "currenttime", "localhour",
                                           "localmonthabbrev")} == {
        "currentyear": "2024", "currentmonth": "01", "currentmonth1": "1", "currentday": "7", "currentday2": "07",
        "currentdow": "0", "currentweek": "1", "currenttime": "00:00", "localhour": "00", "localmonthabbrev": "Jan"}


def test_the_date_comes_from_the_name_the_key_or_a_latest_dumps_list(tmp_path):
    assert dump_date("https://x/enwiki-20241001-pages-articles.xml.bz2", None, None) == datetime.date(2024, 10, 1)
    assert dump_date("export.xml", None, "2023-05-02") == datetime.date(2023, 5, 2)
    site = tmp_path / "latest"
    site.mkdir()
    (site / "enwiki-latest-md5sums.txt").write_text(f"{0:032x}  enwiki-20240920-pages-articles.xml.bz2\n"
                                                    f"{1:032x}  enwiki-20240920-pages-articles1.xml-p1p9.bz2\n")
    record_dump_date(str(site / "enwiki-latest-pages-articles.xml.bz2"), None, None, tmp_path / "dump_date.txt")
    assert (tmp_path / "dump_date.txt").read_text() == "2024-09-20\n"


def test_a_dump_nothing_dates_stops_with_one_line_naming_the_key(tmp_path):
    with pytest.raises(UserError) as error:
        dump_date(str(tmp_path / "export.xml.bz2"), None, None)
    assert str(error.value) == (
        "config key 'wikipedia.date': not set, and the dump export.xml.bz2 has no date in its name "
        "(<wiki>-YYYYMMDD-pages-articles...); set wikipedia.date: YYYY-MM-DD, the day the dump was taken (its "
        "{{CURRENTYEAR}} and the like are filled from it)")
    with pytest.raises(UserError) as error:
        dump_date("https://x/enwiki-20241001-pages-articles.xml.bz2", None, "2024-10-02")
    assert str(error.value) == ("config key 'wikipedia.date': 2024-10-02, but the dump "
                                "enwiki-20241001-pages-articles.xml.bz2 is of 2024-10-01; remove the key (the dump's "
                                "name dates it)")


def snakemake(work, *args):
    return subprocess.run([sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"), "--cores", "1",
                           *args, "--configfile", "config.yaml"], cwd=work, env=snakemake_env(), capture_output=True,
                          text=True, timeout=300)


def test_an_undated_export_without_wikipedia_date_stops_the_plan_in_one_line(tmp_path):
    (tmp_path / "config.yaml").write_text("wikipedia: {url: exports/export.xml.bz2, parts: single}\n")
    result = snakemake(tmp_path, "-n", "data/extracted/wikipedia/whole.jsonl")
    output = result.stdout + result.stderr
    assert result.returncode == 1
    assert [line for line in output.splitlines() if "error" in line.lower()] == [
        "error: config key 'wikipedia.date': not set, and the dump export.xml.bz2 has no date in its name "
        "(<wiki>-YYYYMMDD-pages-articles...); set wikipedia.date: YYYY-MM-DD, the day the dump was taken (its "
        "{{CURRENTYEAR}} and the like are filled from it)"], output[-3000:]


def publish(site, date):
    """A dump of `date` in two parts on the dump site: its dated directory and `latest/` list, as dumps.wikimedia.org
    lays them out."""
    (site / date).mkdir(parents=True)
    lines = []
    for number, pages in ((1, "p1p9"), (2, "p10p19")):
        name = f"enwiki-{date}-pages-articles{number}.xml-{pages}.bz2"
        export = f'<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.11/"><!-- part {number} of {date} -->'
        (site / date / name).write_bytes(data := bz2.compress(export.encode()))
        lines.append(f"{hashlib.md5(data).hexdigest()}  {name}\n")
    (site / "latest").mkdir(exist_ok=True)
    (site / "latest" / "enwiki-latest-md5sums.txt").write_text("".join(lines))


def test_a_latest_dump_is_dated_by_the_list_its_parts_come_from(tmp_path, http_server):
    site, work = tmp_path / "site", tmp_path / "work"
    publish(site, "20240920")
    server = http_server(site)
    work.mkdir()
    latest = f"{server.url}/latest/enwiki-latest-pages-articles.xml.bz2"
    (work / "config.yaml").write_text(f"wikipedia: {{url: '{latest}'}}\n")
    date = work / "data/download/wikipedia/dump_date.txt"
    assert snakemake(work, str(date.relative_to(work))).returncode == 0
    assert date.read_text() == "2024-09-20\n"
    # a newer dump published since: the parts and the date stay those of the list kept beside the dump ...
    publish(site, "20241001")
    result = snakemake(work, "-n", str(date.relative_to(work)))
    assert result.returncode == 0 and "Nothing to be done" in result.stdout + result.stderr, result.stderr[-3000:]
    # ... until that list is deleted: then the newer dump's parts are downloaded and dated
    (work / "data/download/wikipedia/enwiki-latest-md5sums.txt").unlink()
    assert snakemake(work, str(date.relative_to(work))).returncode == 0
    assert date.read_text() == "2024-10-01\n"
    assert b"part 1 of 20241001" in bz2.decompress((work / "data/download/wikipedia/p1p9.xml.bz2").read_bytes())
