"""Stage 2: real wikiextractor on the sample dump; its quirks handled; bad dumps fail in one line with no output, on
CPython and on PyPy (the extract rule's interpreter, envs/extract.yaml), whose extracts are equal byte for byte."""
import bz2
import codecs
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.wikipedia_sample import pypy_python
from workflow.data.extract import HEADING_MARK, PAGES_LOG, extract

DUMP = "enwiki-sample-pages-articles.xml.bz2"
PYPY = pypy_python()
NO_PYPY = "no PyPy with wikiextractor here (Debian: apt install pypy3 pypy3-venv, then `make setup`)"
INTERPRETERS = [pytest.param(sys.executable, id="cpython"),
                pytest.param(PYPY, id="pypy", marks=pytest.mark.skipif(PYPY is None, reason=NO_PYPY))]


@pytest.fixture(scope="module")
def articles(tmp_path_factory, sample_dir):
    output = tmp_path_factory.mktemp("extract") / "wikipedia.jsonl"
    count = extract(sample_dir / DUMP, output, processes=2)
    records = [json.loads(line) for line in output.read_text(encoding="utf-8").splitlines()]
    assert count == len(records)
    return {record["title"]: record for record in records}


def run_cli(dump, output, env, python=sys.executable, templates=None):
    """The extract rule's command: the dump's date from the file the workflow writes (tests/test_dump_date.py)."""
    date = output.parent.parent / f"{output.parent.name}-dump_date.txt"
    date.write_text("2024-09-16\n")
    return subprocess.run(
        [str(python), "-m", "workflow.data.extract", "--input", str(dump), "--output", str(output), "--processes", "2",
         "--date-file", str(date)] + ([] if templates is None else ["--templates", str(templates)]),
        capture_output=True, text=True, env=env,
    )


def assert_one_line_error(result, dump, output, pattern):
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.fullmatch(f"error: {re.escape(str(dump))}: {pattern}", errors[0]), result.stderr
    assert "Traceback" not in result.stderr
    assert list(output.parent.iterdir()) == [dump] or not output.exists()
    assert not output.exists() and [p for p in output.parent.iterdir() if p.name.startswith(".")] == []


def test_every_article_and_only_articles_are_extracted(articles):
    assert len(articles) == 41  # 40 generated articles + "Telephone exchange"
    assert {"Alderbrook", "Marsh piper", "Telephone exchange", "Harwell & Sons Ltd."} <= set(articles)
    assert "Alderbrook, England" not in articles  # the redirect
    assert not any(":" in title for title in articles)  # Talk:, User:, Category:, File:, Template:
    text = "\n".join(record["text"] for record in articles.values())
    for marker in ("TALKPAGEMARKER", "USERPAGEMARKER", "CATEGORYMARKER", "FILEPAGEMARKER", "Converts units"):
        assert marker not in text


def test_records_are_id_title_text_without_the_wrong_revid(articles):
    record = articles["Alderbrook"]
    assert set(record) == {"id", "title", "text"}
    assert record["id"] == "1001"


def test_text_is_not_html_escaped(articles):
    telephone = articles["Telephone exchange"]["text"]
    assert "Companies such as AT&T and the General Post Office" in telephone
    assert '"R&D" labs' in telephone
    assert "&amp;" not in "".join(r["text"] + r["title"] for r in articles.values())


def test_markup_is_gone_and_templates_expanded(articles):
    text = "\n".join(record["text"] for record in articles.values())
    for markup in ("[[", "]]", "{{", "}}", "<ref", "</ref>", "{|", "|}", "'''", "thumb|", "Category:", "Infobox"):
        assert markup not in text, markup
    # {{convert|16|km|mi|abbr=on}} expands through the dump's own Template:Convert
    assert re.search(r"\bAlderbrook lies \d+ km south-east of Port Ellery", articles["Alderbrook"]["text"])
    assert "Vale of Marrow district" in articles["Alderbrook"]["text"]  # [[target|label]] -> label


@pytest.mark.parametrize("python", INTERPRETERS)
def test_truncated_bz2_is_a_one_line_error_and_no_output(tmp_path, sample_dir, repo_env, python):
    dump = tmp_path / "truncated.xml.bz2"
    data = (sample_dir / DUMP).read_bytes()
    dump.write_bytes(data[: len(data) // 2])
    output = tmp_path / "out.jsonl"
    assert_one_line_error(run_cli(dump, output, repo_env, python), dump, output, r"truncated bz2 \(.*end-of-stream.*\)")


@pytest.mark.parametrize("python", INTERPRETERS)
def test_truncation_past_the_first_megabyte_is_caught_from_wikiextractor(tmp_path, sample_dir, repo_env, python):
    # a multistream bz2 (as Wikimedia publishes) whose first stream is intact and > 1 MB, the second cut short
    xml = (sample_dir / "enwiki-sample-pages-articles.xml").read_text(encoding="utf-8")
    head, pages = xml.split("</siteinfo>\n", 1)
    pages = pages.replace("</mediawiki>\n", "")
    first = bz2.compress((head + "</siteinfo>\n" + pages * 12).encode())
    second = bz2.compress((pages + "</mediawiki>\n").encode())
    dump = tmp_path / "multistream.xml.bz2"
    dump.write_bytes(first + second[: len(second) // 2])
    output = tmp_path / "out.jsonl"
    assert_one_line_error(run_cli(dump, output, repo_env, python), dump, output, r"truncated or corrupt bz2 \(EOFError: .*\)")


@pytest.mark.parametrize("python", INTERPRETERS)
def test_corrupt_bz2_is_a_one_line_error(tmp_path, sample_dir, repo_env, python):
    data = bytearray((sample_dir / DUMP).read_bytes())
    data[5000] ^= 0xFF
    dump = tmp_path / "corrupt.xml.bz2"
    dump.write_bytes(bytes(data))
    output = tmp_path / "out.jsonl"
    assert_one_line_error(run_cli(dump, output, repo_env, python), dump, output, r"corrupt bz2 \([Ii]nvalid data stream\)")  # PyPy: lower case


@pytest.mark.parametrize(
    "xml, reason",
    [
        ('<?xml version="1.0"?>\n<rss version="2.0"><channel><title>news</title></channel></rss>\n', r"root element: <rss>"),
        ("<mediawiki><page><title>No namespace</title></page></mediawiki>\n", r"root element: <mediawiki>"),
        ("this is plain text, not XML at all\n", r"XML error: syntax error: line 1, column 0"),
    ],
)
@pytest.mark.parametrize("python", INTERPRETERS)
def test_xml_that_is_not_a_mediawiki_export_is_a_one_line_error(tmp_path, repo_env, xml, reason, python):
    dump = tmp_path / "other.xml.bz2"
    dump.write_bytes(bz2.compress(xml.encode()))
    output = tmp_path / "out.jsonl"
    assert_one_line_error(run_cli(dump, output, repo_env, python), dump, output, rf"not a MediaWiki XML export \({reason}\)")


@pytest.mark.parametrize("python", INTERPRETERS)
def test_an_export_without_siteinfo_is_a_one_line_error_not_zero_articles(tmp_path, sample_dir, repo_env, python):
    """gensim's enwiki-table-markup test dump has none: wikiextractor reads up to a </siteinfo> that never comes."""
    xml = (sample_dir / "enwiki-sample-pages-articles.xml").read_text(encoding="utf-8")
    xml = re.sub(r"\s*<siteinfo>.*?</siteinfo>", "", xml, count=1, flags=re.DOTALL)
    dump = tmp_path / "no-siteinfo.xml.bz2"
    dump.write_bytes(bz2.compress(xml.encode()))
    output = tmp_path / "out.jsonl"
    assert_one_line_error(run_cli(dump, output, repo_env, python), dump, output,
                          r"a MediaWiki XML export without <siteinfo> \(its first element is <page>\): .*")


@pytest.mark.parametrize("encoding", ["utf-16", "utf-32", "latin-1"])  # gensim's bgwiki test dump is UTF-16
@pytest.mark.parametrize("python", INTERPRETERS)
def test_an_export_not_in_utf8_is_a_one_line_error_naming_its_encoding(tmp_path, sample_dir, repo_env, encoding,
                                                                        python):
    """An XML parser reads these, wikiextractor does not: refused before any stage reads on."""
    xml = (sample_dir / "enwiki-sample-pages-articles.xml").read_text(encoding="utf-8").encode(encoding, "replace")
    dump = tmp_path / "other.xml.bz2"
    dump.write_bytes(bz2.compress(xml))
    if encoding == "latin-1":  # no mark: the first byte that is not UTF-8
        first = next(i for i, byte in enumerate(xml) if byte >= 0x80)
        reason = re.escape(f"byte {first} is {xml[first:first + 1]!r});") + ".* iconv -f <its encoding> -t UTF-8 .*"
    else:
        name = encoding.upper()
        reason = rf"{name}\); .* iconv -f {name} -t UTF-8 .*"
    output = tmp_path / "out.jsonl"
    assert_one_line_error(run_cli(dump, output, repo_env, python), dump, output, rf"not UTF-8 \({reason}")


def test_an_export_with_a_utf8_byte_order_mark_extracts_as_without(tmp_path, sample_dir, repo_env):
    xml = (sample_dir / "enwiki-sample-pages-articles.xml").read_bytes()
    outputs = []
    for name, data in (("plain", xml), ("bom", codecs.BOM_UTF8 + xml)):
        dump = tmp_path / f"{name}.xml.bz2"
        dump.write_bytes(bz2.compress(data))
        outputs.append(tmp_path / name / "out.jsonl")
        outputs[-1].parent.mkdir()
        assert run_cli(dump, outputs[-1], repo_env).returncode == 0
    assert outputs[0].read_bytes() == outputs[1].read_bytes()


@pytest.mark.parametrize("python", INTERPRETERS)
def test_export_without_articles_is_an_error(tmp_path, sample_dir, repo_env, python):
    xml = (sample_dir / "enwiki-sample-pages-articles.xml").read_text(encoding="utf-8")
    head = xml.split("</siteinfo>\n", 1)[0]
    dump = tmp_path / "empty.xml.bz2"
    dump.write_bytes(bz2.compress((head + "</siteinfo>\n</mediawiki>\n").encode()))
    output = tmp_path / "out.jsonl"
    assert_one_line_error(run_cli(dump, output, repo_env, python), dump, output, r"no articles \(namespace 0\) in this MediaWiki export")


def test_section_titles_come_out_marked_as_headings_and_empty_sections_not_at_all(articles):
    lines = articles["Alderbrook"]["text"].split("\n")
    headings = [line for line in lines if line.startswith(HEADING_MARK)]
    # wikiextractor's own titles ("History."), marked by its mark_headers; "Statistics" holds only a table
    assert headings == ["## History.", "## Geography.", "## Economy.", "## Culture."]
    assert lines[lines.index("## History.") + 1].startswith("The decline of the textile trade after 1926")


def test_pages_skipped_by_wikiextractor_are_counted_by_reason_in_the_log(tmp_path, sample_dir, repo_env):
    result = run_cli(sample_dir / DUMP, tmp_path / "out.jsonl", repo_env)
    assert result.returncode == 0, result.stderr
    # 48 pages: 42 in namespace 0, one of them "Alderbrook, England" (a redirect); Talk, User, File, Template x2, Category
    assert f"INFO extract: {PAGES_LOG} 48 read: 41 articles, 1 redirects and 6 pages of other namespaces skipped" in result.stderr


def one_article_export(path, title, text):
    """A MediaWiki export at `path` (the real-shaped fixture's siteinfo) of one article: `title`, wikitext `text`
    (XML-escaped, as a dump holds it)."""
    fixture = (Path(__file__).parent / "fixtures" / "enwiki-real-shaped-pages-articles.xml").read_text(encoding="utf-8")
    head = fixture[: fixture.index("</siteinfo>") + len("</siteinfo>")]
    path.write_text(f"{head}\n  <page>\n    <title>{title}</title>\n    <ns>0</ns>\n    <id>1</id>\n    <revision>\n"
                    f'      <text xml:space="preserve">{text}</text>\n    </revision>\n  </page>\n</mediawiki>\n',
                    encoding="utf-8")
    return path


def test_a_paragraph_wrapped_over_lines_comes_out_on_one_line_and_paragraphs_stay_apart(tmp_path, repo_env):
    text = ("'''Ellery''' is a town on the\nwest coast.&lt;ref&gt;{{cite web |title=Ports}}&lt;/ref&gt; Its harbour was\n"
            "dredged in 1890.\n\n\n[[File:Harbour.jpg|thumb|The harbour]]\nThe town grew around\nthe market\n"
            "* a list item\nand a new paragraph after it\n&lt;blockquote&gt;A quote.&lt;/blockquote&gt;\nAfter the quote.")
    extract(one_article_export(tmp_path / "wrapped.xml", "Ellery", text), tmp_path / "out.jsonl")
    record = json.loads((tmp_path / "out.jsonl").read_text(encoding="utf-8"))
    assert record["text"].split("\n") == [
        "Ellery is a town on the west coast. Its harbour was dredged in 1890.",
        "The town grew around the market",
        "and a new paragraph after it",
        "A quote.",
        "After the quote.",
    ]


def test_an_articles_onlyinclude_tags_are_gone_and_the_prose_they_enclose_kept(tmp_path):
    """As gensim's real enwiki test dump's "Agricultural science" has them (for "Agriculture" to include its lead)."""
    text = ("&lt;onlyinclude&gt;\n'''Agricultural science''' is a broad field of biology.\n&lt;/onlyinclude&gt;\n"
            "The three terms are often confused. &lt; ONLYINCLUDE &gt;Soil&lt;/onlyinclude &gt; is studied too.")
    extract(one_article_export(tmp_path / "onlyinclude.xml", "Agricultural science", text), tmp_path / "out.jsonl")
    assert json.loads((tmp_path / "out.jsonl").read_text(encoding="utf-8"))["text"].split("\n") == [
        "Agricultural science is a broad field of biology.",
        "The three terms are often confused. Soil is studied too.",
    ]


def test_parts_extracted_with_the_compiled_templates_of_all_parts_read_as_the_whole_dump(tmp_path, sample_dir):
    from workflow.data.template_pages import collect_template_pages
    from workflow.data.templates import compile_templates

    parts = sorted((sample_dir / "parts").glob("*.xml-p*.bz2"))
    pages = [tmp_path / f"{part.name}.templates.xml" for part in parts]
    counts = [collect_template_pages(part, page) for part, page in zip(parts, pages)]
    assert compile_templates(pages, tmp_path / "templates.bin") == sum(counts) == 2
    extracted = []
    for part in parts:
        extract(part, tmp_path / "part.jsonl", templates=tmp_path / "templates.bin")
        extracted += (tmp_path / "part.jsonl").read_text(encoding="utf-8").splitlines()
    extract(sample_dir / DUMP, tmp_path / "whole.jsonl")  # wikiextractor's own parse of the dump's templates
    assert extracted == (tmp_path / "whole.jsonl").read_text(encoding="utf-8").splitlines()
    assert "Alderbrook lies 16 km south-east" in extracted[0]  # {{convert}} is defined in the last part


@pytest.mark.skipif(PYPY is None, reason=NO_PYPY)
def test_pypy_extracts_equal_cpython_byte_for_byte(tmp_path, sample_dir, repo_env):
    # the real sample (wikiextractor's own template parse) and a generated real-shaped part (compiled templates:
    # parser functions, nested templates, citations, infoboxes, tables), both with 2 worker processes
    from benchmarks.enwiki_pages import dump as generated_dump
    from workflow.data.template_pages import collect_template_pages
    from workflow.data.templates import compile_templates

    generated = tmp_path / "generated.xml.bz2"
    generated_dump(3, generated, seed=5)
    collect_template_pages(generated, tmp_path / "templates.xml")
    compile_templates([tmp_path / "templates.xml"], tmp_path / "templates.bin")
    for dump, templates, articles in ((sample_dir / DUMP, None, 41), (generated, tmp_path / "templates.bin", 279)):
        outputs = {}
        for name, python in (("cpython", sys.executable), ("pypy", PYPY)):
            output = tmp_path / f"{name}.jsonl"
            result = run_cli(dump, output, repo_env, python, templates)
            assert result.returncode == 0, result.stderr
            outputs[name] = (output.read_bytes(), [line.partition(PAGES_LOG)[2] for line in result.stderr.splitlines()
                                                  if PAGES_LOG in line])  # (after the log line's time)
        assert outputs["pypy"] == outputs["cpython"]
        assert outputs["pypy"][0].count(b"\n") == articles


@pytest.mark.parametrize("block", [4096, 100_003, 1 << 24])
def test_template_pages_by_block_search_equal_a_line_by_line_reading(tmp_path, sample_dir, monkeypatch, block):
    from benchmarks.enwiki_pages import dump as generated_dump
    from benchmarks.template_scan import line_scan_template_pages
    from workflow.data import template_pages as scan_module

    monkeypatch.setattr(scan_module, "SCAN_BLOCK", block)  # pages cut across blocks, or whole in one
    generated = tmp_path / "generated.xml.bz2"
    generated_dump(1.5, generated, n_templates=400, seed=3)
    for dump, threads in ((generated, 2), (generated, 1), (sample_dir / DUMP, 2)):
        output = tmp_path / "templates.xml"
        count = scan_module.collect_template_pages(dump, output, threads)
        expected = line_scan_template_pages(dump)
        assert output.read_bytes() == expected and count == expected.count(b"<ns>10</ns>") > 0


def test_template_pages_of_a_truncated_bz2_are_a_one_line_error(tmp_path, repo_env):
    from benchmarks.enwiki_pages import dump as generated_dump

    generated_dump(4, tmp_path / "whole.xml.bz2", n_templates=100)
    dump = tmp_path / "truncated.xml.bz2"
    whole = (tmp_path / "whole.xml.bz2").read_bytes()
    dump.write_bytes(whole[: len(whole) * 2 // 3])  # past the first MB, which the export check reads
    (tmp_path / "whole.xml.bz2").unlink()
    output = tmp_path / "templates.xml"
    result = subprocess.run([sys.executable, "-m", "workflow.data.template_pages", "--input", str(dump), "--output",
                             str(output), "--threads", "2"],
                            capture_output=True, text=True, env=repo_env)
    assert_one_line_error(result, dump, output, r"truncated or corrupt bz2 \(RuntimeError: .*\)")


def test_templates_compiled_in_parallel_are_the_blobs_of_one_pass(tmp_path):
    from benchmarks.enwiki_pages import template_set
    from workflow.data import templates as compiler

    pages = list(template_set(600, seed=4))
    pages[500] = pages[7]  # a title defined twice, in different files
    files = []
    for index, start in enumerate((0, 100, 250, 251, 420)):  # unequal files, one of a single page
        files.append(tmp_path / f"part{index}.templates.xml")
        files[-1].write_text("".join(pages[start:(0, 100, 250, 251, 420, 600)[index + 1]]), encoding="utf-8")
    expected = tmp_path / "one_pass.bin"
    one = compiler.compile_templates(files, expected, processes=1)
    for processes in (2, 4):
        output = tmp_path / f"parallel{processes}.bin"
        assert compiler.compile_templates(files, output, processes) == one == 600
        assert output.read_bytes() == expected.read_bytes()
    # the one-process path is wikiextractor's loader over the files chained, as before the parallel parse
    from wikiextractor.template_blob import StreamingTemplateBlobBuilder
    from wikiextractor.WikiExtractor import load_templates

    templates, redirects = StreamingTemplateBlobBuilder(), StreamingTemplateBlobBuilder()
    lines = (line for path in files for line in open(path, encoding="utf-8"))
    assert load_templates(lines, blob_builder=templates, redirects_blob_builder=redirects)[0] == 600
    count, compiled_templates, compiled_redirects = compiler.load_compiled(expected)
    assert (count, tuple(map(bytes, compiled_templates))) == (600, templates.finish())
    assert tuple(map(bytes, compiled_redirects)) == redirects.finish()


def test_a_bad_compiled_template_file_is_a_one_line_error(tmp_path, sample_dir, repo_env):
    templates = tmp_path / "templates.bin"
    templates.write_bytes(b"<page>not compiled</page>\n")
    output = tmp_path / "out.jsonl"
    result = subprocess.run([sys.executable, "-m", "workflow.data.extract", "--input", str(sample_dir / DUMP),
                             "--output", str(output), "--templates", str(templates)],
                            capture_output=True, text=True, env=repo_env)
    assert result.returncode == 1 and not output.exists()
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: {templates}: not a compiled template file (python -m workflow.data.templates writes them)")
