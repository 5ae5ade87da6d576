"""Real-shaped English Wikipedia pages for the benchmarks: articles, redirects, template pages and other namespaces
in the proportions of the full dump, generated (seeded, deterministic) instead of replicating the small sample.

Matched figures (enwiki-20241001 pages-articles; dumps.wikimedia.org sizes, Special:Statistics and the issue's
measurements; each is what a `dump()` of any size reproduces per page):
- ~100 GB of XML -> ~16-18 GB of extracted text: XML->text ratio ~0.18 (measured on the output: `--check`);
- per article: ~11 KB of XML (~80 GB of the XML in 7.0 M articles), an infobox, ~15 citation templates in
  `<ref>` tags (cite web/book/news, some `<ref name=.../>` reuses), ~6 inline templates ({{convert}}, {{lang}},
  {{nowrap}}), a navbox and {{Authority control}} at the end, categories, a few interlanguage links; a third have a
  wikitable, most have lists, images, external links; ~3% of prose lines wrap mid-sentence;
- per article, ~1.6 redirects (~11 M in the dump) and ~0.4 pages of other namespaces (categories, files,
  Wikipedia:), which wikiextractor reads and skips;
- template pages: ~900k in the dump (~1.5-2 GB, ~2 KB each on average): mostly small formatting templates with
  parser functions ({{#if}}, {{#switch}}) and <noinclude> documentation, some that nest 2-4 others, infoboxes of
  ~20 rows and navboxes of 50-200 links (`template_page`).
wikiextractor's own rate on these pages is measured by the benchmarks (1-2 MB of XML per second per core is what
is reported for the real dump with template expansion).
"""
import bz2
import itertools
import random
from html import escape
from pathlib import Path

HEAD = """<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/" version="0.10" xml:lang="en">
  <siteinfo>
    <sitename>Wikipedia</sitename>
    <dbname>enwiki</dbname>
    <base>https://en.wikipedia.org/wiki/Main_Page</base>
    <generator>MediaWiki 1.43.0-wmf.24</generator>
    <case>first-letter</case>
    <namespaces>
      <namespace key="0" case="first-letter" />
      <namespace key="4" case="first-letter">Wikipedia</namespace>
      <namespace key="6" case="first-letter">File</namespace>
      <namespace key="10" case="first-letter">Template</namespace>
      <namespace key="14" case="first-letter">Category</namespace>
      <namespace key="828" case="first-letter">Module</namespace>
    </namespaces>
  </siteinfo>
"""
TAIL = "</mediawiki>\n"
WORDS = """the of and in to a was is for on as by with at from his that it an were which are this be also has had
first one their its after new who they two her she been other when time during all into school there more city
year years world war national state known may university between over later such would only under team most
season government part where then than under since river music film album series league county village built
population north south east west church history company early called later became held several members area
railway station district council century government people family born american british french german town
park line road bridge valley lake island mountain market mill harbour record single band football club""".split()
CAPITALS = """Alder Marrow Ellery Kestrel Hale Ashdown Brennan Lowe Varga Okafor Lindqvist Moreau Fairbanks Holloway
Harwell Marsh Pound Eliot Yeats Lincoln Arthur Thomas Helen Ruth Mary Victoria Edward Albert George""".split()
TEMPLATES_PER_ARTICLE = {"cite": 15, "inline": 6}
SMALL, NESTING, INFOBOX, NAVBOX = "small", "nesting", "infobox", "navbox"
TEMPLATE_KINDS = ((SMALL, 0.62), (NESTING, 0.28), (INFOBOX, 0.06), (NAVBOX, 0.04))
# Templates that call a Lua module on enwiki (hatnotes, metadata, reference lists): wikiextractor runs no Lua, so
# they leave no text, as here
MODULE_CALLS = {"Reflist", "Authority control", "Short description", "Use dmy dates", "Main", "Citation needed"}
NAMED = ["Cite web", "Cite book", "Cite news", "Convert", "Lang", "Nowrap", "Reflist", "Authority control",
         "Short description", "Use dmy dates", "Infobox settlement", "Infobox person", "Main", "Citation needed"]


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def sentence(rng: random.Random, links: bool = True) -> str:
    parts = [rng.choice(CAPITALS)] + [rng.choice(WORDS) for _ in range(rng.randint(8, 20))]
    if links:
        for i in rng.sample(range(1, len(parts)), k=min(len(parts) - 1, rng.randint(1, 4))):
            parts[i] = f"[[{rng.choice(CAPITALS)} {parts[i].title()}|{parts[i]}]]"
    return " ".join(parts) + "."


def template_name(index: int) -> str:
    return NAMED[index] if index < len(NAMED) else f"T{index}"


def template_page(index: int, n_templates: int, rng: random.Random) -> str:
    """Wikitext of template `index` of a set of `n_templates`: its kind drawn by TEMPLATE_KINDS (the named ones
    of NAMED are small or infoboxes), nesting templates call 2-4 lower-numbered ones."""
    name = template_name(index)
    kind = rng.choices([k for k, _ in TEMPLATE_KINDS], [w for _, w in TEMPLATE_KINDS])[0]
    if name.startswith("Infobox"):
        kind = INFOBOX
    elif name.startswith("Cite") and index >= 4:
        kind = NESTING  # the citation templates nest others (the real ones run a Lua module wikiextractor skips)
    elif index < len(NAMED) or index < 4:
        kind = SMALL
    doc = "<noinclude>\n{{Documentation}}\n" + "\n".join(sentence(rng, False) for _ in range(rng.randint(1, 12))) \
        + "\n[[Category:Templates]]\n</noinclude>"
    if name in MODULE_CALLS:
        body = f"<includeonly>{{{{#invoke:{name.replace(' ', '_')}|main}}}}</includeonly>"
    elif kind == SMALL:
        body = (f"<includeonly>{{{{#if:{{{{{{1|}}}}}}|<span class=\"{name.lower()}\">{{{{{{1}}}}}}"
                f"{{{{#if:{{{{{{2|}}}}}}|&nbsp;{{{{{{2}}}}}}}}}}</span>|{{{{{{default|}}}}}}}}}}"
                f"{{{{#switch:{{{{{{mode|}}}}}}|a={words(rng, 2)}|b={words(rng, 3)}|#default=}}}}</includeonly>")
    elif kind == NESTING:
        calls = "".join(f"{{{{{template_name(rng.randrange(max(1, index)))}|{{{{{{{k + 1}|}}}}}}|mode=a}}}}"
                        for k in range(rng.randint(2, 4)))
        body = f"<includeonly>{{{{#if:{{{{{{1|}}}}}}|{calls}|}}}}</includeonly>"
    elif kind == INFOBOX:
        rows = "".join(f"\n|-\n{{{{#if:{{{{{{field{k}|}}}}}}|\n! {words(rng, 2).title()}\n| "
                       f"{{{{{template_name(rng.randrange(min(index, 4)))}|{{{{{{field{k}}}}}}}}}}}}}}}"
                       for k in range(rng.randint(40, 100)))
        body = f"<includeonly>{{| class=\"infobox\"\n|+ {{{{{{name|{{{{PAGENAME}}}}}}}}}}{rows}\n|}}</includeonly>"
    else:
        links = " · ".join(f"[[{rng.choice(CAPITALS)} {words(rng, 2).title()}]]" for _ in range(rng.randint(50, 200)))
        body = (f"<includeonly>{{| class=\"navbox\"\n! {name}\n|-\n| {links}\n|}}</includeonly>")
    return body + doc


def citation(rng: random.Random, n: int) -> str:
    kind = rng.choice(["Cite web", "Cite book", "Cite news"])
    return (f"<ref name=\"r{n}\">{{{{{kind} |url=https://www.example.org/{words(rng, 3).replace(' ', '/')}.html "
            f"|title={words(rng, 6).title()} |website={rng.choice(CAPITALS)} {rng.choice(WORDS).title()} "
            f"|date={rng.randint(1, 28)} May {rng.randint(1990, 2024)} |access-date=1 June 2024"
            f"{' |last=' + rng.choice(CAPITALS) + ' |first=' + rng.choice(CAPITALS) if rng.random() < 0.6 else ''}"
            f"}}}}</ref>")


def article(title: str, n_templates: int, rng: random.Random) -> str:
    """Wikitext of one article: ~11 KB of XML, ~20% of it left as text."""
    infobox = rng.choice(["Infobox settlement", "Infobox person"])
    fields = "".join(f"\n| field{k} = {words(rng, rng.randint(1, 5))}" for k in range(rng.randint(12, 24)))
    refs, out = [0], [f"{{{{Short description|{words(rng, 5)}}}}}\n{{{{Use dmy dates|date=May 2024}}}}\n"
                      f"{{{{{infobox}\n| name = {title}{fields}\n}}}}"]

    def paragraph() -> str:
        text = []
        for _ in range(rng.randint(2, 4)):
            s = sentence(rng)
            if rng.random() < 0.25:
                s = s[:-1] + f" {{{{Convert|{rng.randint(2, 900)}|km}}}}."
            if rng.random() < 0.1:
                s = s[:-1] + f" ({{{{Lang|fr|{words(rng, 2)}}}}})."
            if rng.random() < 0.8:
                refs[0] += 1
                s += citation(rng, refs[0]) if rng.random() < 0.85 or refs[0] < 3 else \
                    f"<ref name=\"r{rng.randint(1, refs[0] - 1)}\" />"
            text.append(s)
        joined = " ".join(text)
        if rng.random() < 0.1:  # a sentence wrapped over two lines, as editors leave them
            cut = joined.find(" ", len(joined) // 2)
            joined = joined[:cut] + "\n" + joined[cut + 1:]
        return joined

    out.append(f"'''{title}''' " + paragraph())
    for _ in range(rng.randint(2, 6)):
        out.append(f"== {words(rng, 2).title()} ==")
        if rng.random() < 0.3:
            out.append(f"{{{{Main|{rng.choice(CAPITALS)} {words(rng, 1).title()}}}}}")
        if rng.random() < 0.3:
            out.append(f"[[File:{rng.choice(CAPITALS)} {rng.randint(1, 999)}.jpg|thumb|{sentence(rng, False)}]]")
        for _ in range(rng.randint(1, 2)):
            out.append(paragraph())
        if rng.random() < 0.4:
            out.append("\n".join(f"* {sentence(rng)}" for _ in range(rng.randint(2, 6))))
        if rng.random() < 0.12:
            rows = "\n".join(f"|-\n| {rng.randint(1900, 2024)} || {words(rng, 3)} || {rng.randint(1, 99999)}"
                             for _ in range(rng.randint(4, 15)))
            out.append(f"{{| class=\"wikitable\"\n! Year !! Event !! Figure\n{rows}\n|}}")
    out.append("== References ==\n{{Reflist}}")
    out.append("== External links ==\n" + "\n".join(f"* [https://www.example.org/{rng.randint(1, 10**6)} "
                                                     f"{words(rng, 3).title()}]" for _ in range(rng.randint(1, 4))))
    navbox = template_name(rng.randrange(n_templates))
    out.append(f"{{{{{navbox}}}}}\n{{{{Authority control}}}}")
    out.append("\n".join(f"[[Category:{words(rng, 2).title()}]]" for _ in range(rng.randint(3, 9))))
    languages = rng.sample(["de", "fr", "es", "it", "nl", "pl"], k=rng.randint(0, 3))  # interlanguage links
    out.append("\n".join(f"[[{lang}:{title}]]" for lang in languages))
    return "\n\n".join(out)


def page_xml(page_id: int, title: str, ns: int, text: str, redirect: str | None = None) -> str:
    body = escape(text, quote=False)
    redirect_tag = f'    <redirect title="{escape(redirect)}" />\n' if redirect else ""
    return (f"  <page>\n    <title>{escape(title)}</title>\n    <ns>{ns}</ns>\n    <id>{page_id}</id>\n{redirect_tag}"
            f"    <revision>\n      <id>{page_id * 10 + 7}</id>\n      <parentid>{page_id * 10 + 3}</parentid>\n"
            f"      <timestamp>2024-09-30T12:00:00Z</timestamp>\n      <contributor>\n        <username>Editor"
            f"{page_id % 9973}</username>\n        <id>{page_id % 99991}</id>\n      </contributor>\n"
            f"      <comment>{words(random.Random(page_id), 4)}</comment>\n      <origin>{page_id * 10 + 7}</origin>\n"
            f"      <model>wikitext</model>\n      <format>text/x-wiki</format>\n"
            f"      <text bytes=\"{len(text.encode())}\" sha1=\"{page_id:031x}\" xml:space=\"preserve\">{body}</text>\n"
            f"      <sha1>{page_id:031x}</sha1>\n    </revision>\n  </page>\n")


def template_set(n_templates: int, seed: int = 0):
    """The page XML of `n_templates` template pages."""
    rng = random.Random(seed)
    for index in range(n_templates):
        text = template_page(index, n_templates, rng)
        yield page_xml(10_000_000 + index, f"Template:{template_name(index)}", 10, text)


TEMPLATE_SHARE = 0.017  # of the dump's XML: ~1.7 GB of template pages in ~100 GB
PART_IDS = 5_000_000  # article page ids of part k start at 4 * k * PART_IDS (templates: 10,000,000 + index)


def default_templates(megabytes: float) -> int:
    """Template pages of a dump of `megabytes` MB of XML: TEMPLATE_SHARE of it, ~1.8 KB each."""
    return max(len(NAMED) + 10, round(megabytes * 1e6 * TEMPLATE_SHARE / 1800))


def dump(megabytes: float, output: Path, n_templates: int | None = None, seed: int = 0, part: int = 0,
         parts: int = 1) -> dict:
    """A bz2 (or plain, by suffix) dump of about `megabytes` MB of XML: its template pages first (by default
    TEMPLATE_SHARE of it), then articles, each followed by its share of redirects and other-namespace pages.
    Part `part` of a dump in `parts` parts (as Wikimedia splits one): every parts-th page of the dump's template
    set (`n_templates`, by default TEMPLATE_SHARE of all parts), its own articles and page ids.
    Returns its sizes and counts."""
    rng = random.Random(seed + 1_000_003 * part)
    n_templates = n_templates or default_templates(megabytes * parts)
    opener = bz2.open if output.suffix == ".bz2" else open
    counts = {"articles": 0, "redirects": 0, "templates": len(range(part, n_templates, parts)), "other": 0}
    written = 0
    with opener(output, "wt", encoding="utf-8") as out:
        for chunk in [HEAD, *itertools.islice(template_set(n_templates, seed), part, None, parts)]:
            out.write(chunk)
            written += len(chunk.encode())
        page_id = first_id = PART_IDS * part
        while written < megabytes * 1e6:
            page_id += 1
            title = f"{rng.choice(CAPITALS)} {words(rng, 2).title()} {page_id}"
            pages = [page_xml(page_id * 4, title, 0, article(title, n_templates, rng))]
            counts["articles"] += 1
            for k in range(1 + (rng.random() < 0.6)):  # ~1.6 redirects per article
                pages.append(page_xml(page_id * 4 + 1 + k, f"{title} ({k})", 0, f"#REDIRECT [[{title}]]", title))
                counts["redirects"] += 1
            if rng.random() < 0.4:  # a category, file or project page
                ns, prefix = rng.choice([(14, "Category"), (6, "File"), (4, "Wikipedia")])
                pages.append(page_xml(page_id * 4 + 3, f"{prefix}:{title}", ns, paragraph_only(rng)))
                counts["other"] += 1
            for page in pages:
                out.write(page)
                written += len(page.encode())
        out.write(TAIL)
    return {"xml_bytes": written + len(TAIL), "bytes": output.stat().st_size, "first_id": first_id * 4 + 4,
            "last_id": page_id * 4 + 3, **counts}


def paragraph_only(rng: random.Random) -> str:
    return " ".join(sentence(rng) for _ in range(rng.randint(1, 4))) + "\n[[Category:Wikipedia]]"


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=20.0)
    parser.add_argument("--templates", type=int, default=None)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    print(dump(args.mb, args.output, args.templates))
