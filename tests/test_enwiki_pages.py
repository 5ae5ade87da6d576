"""benchmarks/enwiki_pages.py: generated pages go through real wikiextractor in the proportions it promises."""
import json

from benchmarks.enwiki_pages import dump
from workflow.data.extract import extract


def test_generated_pages_extract_at_the_real_dumps_xml_to_text_ratio_with_templates_expanded(tmp_path):
    info = dump(2, tmp_path / "pages.xml")
    assert info["redirects"] > info["articles"] > info["other"] > 0 and info["templates"] >= 20
    assert 9_000 < info["xml_bytes"] / info["articles"] < 13_000  # enwiki: ~11 KB of XML per article
    assert extract(tmp_path / "pages.xml", tmp_path / "pages.jsonl") == info["articles"]
    texts = [json.loads(line)["text"] for line in (tmp_path / "pages.jsonl").read_text(encoding="utf-8").splitlines()]
    assert 0.15 < sum(len(text.encode()) for text in texts) / info["xml_bytes"] < 0.23  # enwiki: ~0.18
    assert not any("{{" in text or "<ref" in text or "[[" in text for text in texts)
    assert sum("\xa0km" in text for text in texts) > 0.5 * len(texts)  # {{Convert}} expanded (a nested template)
