"""Stage 3a, punkt: the model trained on the first pages of the dump, extracted there, is the model trained on the
parts' whole extracts (so format need not wait for them), whether a prefix of the first part, the first part and a
prefix of the second, or every part whole (fewer characters than asked) is what it trains on."""
import logging

import pytest

from benchmarks.enwiki_pages import dump as generated_dump
from workflow.cli import UserError
from workflow.data.extract import extract
from workflow.data.template_pages import collect_template_pages
from workflow.data.format import prose_texts, read_documents
from workflow.data.punkt import train_from_dumps, train_model
from workflow.data.templates import compile_templates


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    work = tmp_path_factory.mktemp("punkt")
    dumps = [work / "part0.xml.bz2", work / "part1.xml.bz2"]
    generated_dump(2.0, dumps[0], n_templates=300, seed=1)  # template pages first: its first 0.3 MB has no article
    generated_dump(1.0, dumps[1], n_templates=100, seed=2)
    pages = [collect_template_pages(d, work / f"{d.name}.templates.xml") and work / f"{d.name}.templates.xml" for d in dumps]
    compile_templates(pages, work / "templates.bin")
    extracted = [work / f"part{index}.jsonl" for index in range(2)]
    for dump, articles in zip(dumps, extracted):
        extract(dump, articles, processes=2, templates=work / "templates.bin")
    chars = [sum(map(len, prose_texts(read_documents(path)))) for path in extracted]
    return dict(work=work, dumps=dumps, templates=work / "templates.bin", extracted=extracted, chars=chars)


def model_files(directory):
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


@pytest.mark.parametrize("case", ["prefix of part 0", "part 0 and a prefix of part 1", "every part, too few"])
def test_punkt_from_the_first_pages_equals_punkt_from_the_whole_extracts(parts, tmp_path, caplog, case):
    first, second = parts["chars"]
    train_chars = {"prefix of part 0": first // 10, "part 0 and a prefix of part 1": first + second // 10,
                   "every part, too few": 10 * (first + second)}[case]
    expected = train_model(parts["extracted"], tmp_path / "from_extracts", train_chars)
    with caplog.at_level(logging.INFO, logger="punkt"):
        model = train_from_dumps(parts["dumps"], parts["templates"], tmp_path / "from_dumps", processes=2,
                                 train_chars=train_chars, prefix_mb=(0.3, 1.0))
    assert model_files(model) == model_files(expected) != {}
    read = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "characters of prose" in r.getMessage()]
    assert [line.split(": ")[1].split(",")[0].split()[0] for line in read] == {  # "whole" or "first N MB of XML"
        "prefix of part 0": ["first"], "part 0 and a prefix of part 1": ["whole", "first"],
        "every part, too few": ["whole", "whole"]}[case]
    assert not list(tmp_path.glob(".punkt-*"))  # its scratch extracts are gone


def test_a_truncated_first_part_is_a_one_line_error(parts, tmp_path):
    truncated = tmp_path / "truncated.xml.bz2"
    whole = parts["dumps"][0].read_bytes()
    truncated.write_bytes(whole[: len(whole) * 9 // 10])  # past the first MB, which the export check reads
    with pytest.raises(UserError, match=rf"^{truncated}: truncated or corrupt bz2 \(RuntimeError: "):
        train_from_dumps([truncated], parts["templates"], tmp_path / "model", train_chars=10**9, prefix_mb=(5.0,))
    assert not (tmp_path / "model").exists()
