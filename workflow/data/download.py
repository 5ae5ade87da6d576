"""Stage 1, download: fetch a file (http(s)://, file:// or a local path) with resume and checksum checks.

`fetch(url, destination, checksum_url=None)` is the reusable entry point (Wikipedia dump, SQuAD JSON, books):
bytes go to `<destination>.part`, an interrupted transfer resumes from there with an HTTP Range request,
and the file is renamed to `destination` only after its size and checksum are verified.

A Wikipedia dump is also published in parts (`enwiki-YYYYMMDD-pages-articlesN.xml-pFIRSTpLAST.bz2`, listed in the
dump's md5sums file): `dump_parts` reads that list before any job runs, so each part is its own download job.
`dump_date` finds the day the dump was taken (its name, wikipedia.date, or a `latest` dump's list), which every
part is extracted with.
"""
import argparse
import datetime
import hashlib
import http.client
import logging
import os
import re
import shutil
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from tqdm import tqdm

from workflow.atomic import atomic_path, write_text
from workflow.cli import UserError, run
from workflow.data.extract import check_mediawiki_export, date_in_name, parse_dump_date

log = logging.getLogger("download")

CHUNK = 1 << 20
HASH_BY_HEX_LENGTH = {32: "md5", 40: "sha1", 64: "sha256"}
USER_AGENT = "snakebert"
# dumps.wikimedia.org's names: the whole dump, and its parts (N-th file, pages with ids FIRST..LAST)
DUMP_NAME = re.compile(r"(?P<prefix>.+)-pages-articles\.xml\.bz2")
PART_SUFFIX = r"-pages-articles(?P<number>[0-9]+)\.xml-p(?P<first>[0-9]+)p(?P<last>[0-9]+)\.bz2"
WHOLE = "whole"  # the part name of a dump processed as one file
DUMP_SITE = "https://dumps.wikimedia.org"


def wikipedia_dump_url(language: str) -> str:
    """The latest pages-articles dump of the `language` Wikipedia (de, zh, zh-yue) on the dump site, laid out as
    enwiki's: its md5 list (checksum_list_beside) and its parts follow from this name."""
    wiki = language.replace("-", "_") + "wiki"  # the dump site's database names: zh_yuewiki
    return f"{DUMP_SITE}/{wiki}/latest/{wiki}-latest-pages-articles.xml.bz2"


def _is_remote(url: str) -> bool:
    return urllib.parse.urlsplit(url).scheme in ("http", "https")


def _local_path(url: str) -> Path:
    """The filesystem path of a file:// URL or a plain path."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme == "file":
        return Path(urllib.parse.unquote(parts.path))
    return Path(url)


def basename(url: str) -> str:
    """The file name a URL or path ends with (how dump checksum lists name files)."""
    if _is_remote(url) or url.startswith("file:"):
        return Path(urllib.parse.unquote(urllib.parse.urlsplit(url).path)).name
    return Path(url).name


def read_small(url: str, timeout: float = 60, missing_ok: bool = False) -> str | None:
    """The whole text of a small resource (a checksum list, a URL list); None if absent (404) and `missing_ok`."""
    try:
        if _is_remote(url):
            with urllib.request.urlopen(url, timeout=timeout) as response:
                return response.read().decode("utf-8")
        return _local_path(url).read_text(encoding="utf-8")
    except urllib.error.HTTPError as error:
        if missing_ok and error.code == 404:
            return None
        raise UserError(f"{url}: cannot read (HTTP {error.code} {error.reason})") from error
    except FileNotFoundError as error:
        if missing_ok:
            return None
        raise UserError(f"{url}: no such file") from error
    except (OSError, urllib.error.URLError, UnicodeDecodeError) as error:
        raise UserError(f"{url}: cannot read ({error})") from error


def checksums_listed(text: str) -> dict[str, tuple[str, str]]:
    """{file name: (algorithm, hex digest)} of an md5sums/sha1sums list (`<hex>  <name>` lines)."""
    listed: dict[str, tuple[str, str]] = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) == 2:
            digest = fields[0].lower()
            algorithm = HASH_BY_HEX_LENGTH.get(len(digest))
            if algorithm and re.fullmatch(r"[0-9a-f]+", digest):
                listed.setdefault(fields[1].lstrip("*"), (algorithm, digest))
    return listed


def expected_checksum(checksum_url: str, name: str) -> tuple[str, str]:
    """(algorithm, hex digest) listed for file `name` in an md5sums/sha1sums list (`<hex>  <name>` lines).

    The dump site's `*-latest-md5sums.txt` names files by dump date (enwiki-20240601-pages-articles.xml.bz2),
    not as `latest`: a `-latest-` name falls back to the one dated name it stands for.
    """
    listed = checksums_listed(read_small(checksum_url))
    if name in listed:
        return listed[name]
    if "-latest-" in name:
        before, after = name.split("-latest-", 1)
        dated = re.compile(f"{re.escape(before)}-[0-9]{{8}}-{re.escape(after)}")
        matches = [digest for listed_name, digest in listed.items() if dated.fullmatch(listed_name)]
        if len(matches) == 1:
            return matches[0]
    raise UserError(f"{checksum_url}: no md5/sha1 checksum line for {name!r}")


def file_digest(path: Path, algorithm: str) -> str:
    digest = hashlib.new(algorithm)
    with open(path, "rb") as stream:
        for chunk in iter(lambda: stream.read(CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _copy_local(source: Path, part: Path, label: str) -> None:
    """Append the rest of local file `source` to `part` (resuming after what `part` already holds)."""
    if not source.is_file():
        raise UserError(f"{source}: no such file")
    total = source.stat().st_size
    offset = part.stat().st_size if part.exists() else 0
    if offset > total:
        part.unlink()
        offset = 0
    with open(source, "rb") as src, open(part, "ab") as dst, tqdm(
        total=total, initial=offset, unit="B", unit_scale=True, desc=label, disable=None
    ) as bar:
        src.seek(offset)
        for chunk in iter(lambda: src.read(CHUNK), b""):
            dst.write(chunk)
            bar.update(len(chunk))


def _http_attempt(url: str, part: Path, label: str, timeout: float) -> None:
    """One HTTP GET, resuming `part` with a Range request. Raises OSError/HTTPException if cut short."""
    offset = part.stat().st_size if part.exists() else 0
    request = urllib.request.Request(url, headers={"User-Agent": USER_AGENT})
    if offset:
        request.add_header("Range", f"bytes={offset}-")
    try:
        response = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as error:
        if error.code == 416 and offset:  # nothing left to send: .part is complete (or garbage: checksum decides)
            return
        if error.code >= 500 or error.code == 429:  # overloaded or rate-limiting mirror: retried with backoff
            raise
        raise UserError(f"{url}: HTTP {error.code} {error.reason}") from error
    except urllib.error.URLError as error:
        raise UserError(f"{url}: {error.reason}") from error
    with response:
        if offset and response.status == 200:  # server ignored the Range header: start over
            log.info("%s: server does not resume, restarting from byte 0", url)
            offset = 0
            part.unlink()
        length = response.headers.get("Content-Length")
        total = offset + int(length) if length is not None else None
        received = offset
        with open(part, "ab") as out, tqdm(total=total, initial=offset, unit="B", unit_scale=True, desc=label,
                                                 disable=None) as bar:
            while True:
                chunk = response.read(CHUNK)
                if not chunk:
                    break
                out.write(chunk)
                received += len(chunk)
                bar.update(len(chunk))
        if total is not None and received < total:
            raise http.client.IncompleteRead(b"", total - received)


def fetch(
    url: str,
    destination: str | os.PathLike,
    checksum_url: str | None = None,
    *,
    checksum: str | None = None,
    retries: int = 5,
    timeout: float = 60,
    check: Callable[[Path], None] | None = None,
) -> Path:
    """Download `url` to `destination`, resuming and verifying; return the destination path.

    `url` is http(s)://, file:// or a plain local path. Bytes accumulate in `<destination>.part`; a
    dropped connection is retried up to `retries` times with an HTTP Range request from where it
    stopped (and a later call resumes a `.part` left behind by an earlier one). If `checksum_url`
    is given, the md5/sha1 listed there for the URL's basename must match (`checksum`, a bare hex
    digest, may be given instead). Only a verified file is renamed to `destination`; a mismatch
    deletes the `.part` and raises UserError, so nothing unverified is ever promoted. `check(path)`, if given, then
    vets the contents (a dump's format) the same way: its UserError deletes the `.part` too.
    """
    destination = Path(destination)
    destination.parent.mkdir(parents=True, exist_ok=True)
    part = destination.with_name(destination.name + ".part")
    label = basename(url)
    expected = None
    if checksum_url:
        expected = expected_checksum(checksum_url, basename(url))
    elif checksum:
        algorithm = HASH_BY_HEX_LENGTH.get(len(checksum))
        if not algorithm:
            raise UserError(f"{url}: checksum {checksum!r} is not an md5, sha1 or sha256 hex digest")
        expected = (algorithm, checksum.lower())

    if _is_remote(url):
        for attempt in range(retries + 1):
            try:
                _http_attempt(url, part, label, timeout)
                break
            except (OSError, http.client.HTTPException) as error:
                if attempt == retries:
                    raise UserError(
                        f"{url}: download interrupted after {part.stat().st_size if part.exists() else 0} bytes "
                        f"({error!r}); rerun to resume from {part}"
                    ) from error
                log.warning("%s: connection lost (%r), resuming (attempt %d/%d)", url, error, attempt + 1, retries)
                time.sleep(min(2**attempt * 0.1, 10))
    else:
        _copy_local(_local_path(url), part, label)

    if expected:
        algorithm, digest = expected
        actual = file_digest(part, algorithm)
        if actual != digest:
            part.unlink()
            raise UserError(f"{url}: {algorithm} mismatch (expected {digest}, got {actual}); nothing kept")
        log.info("%s: %s verified (%s)", url, algorithm, digest)
    if check is not None:
        try:
            check(part)
        except UserError:
            part.unlink()
            raise
    os.replace(part, destination)
    return destination


def fetch_books(source: str, destination: str | os.PathLike) -> Path:
    """BookCorpus: copy a local directory of `*.txt` books, or fetch every book a URL list names, to `destination`.

    A URL list (local file or URL) has one book per line: `<url>` or `<url> <md5|sha1>`; `#` starts a comment.
    Books accumulate in `<destination>.part/` (each resumable, as `fetch`); the directory is renamed
    to `destination` only when every book is verified.
    """
    destination = Path(destination)
    if not source:
        raise UserError("bookcorpus.source: not set (a directory of .txt books, or a list of book URLs)")
    local = None if _is_remote(source) else _local_path(source)
    if local is not None and local.is_dir():
        books = sorted(local.glob("*.txt"))
        if not books:
            raise UserError(f"{local}: no *.txt books in this directory")
        with atomic_path(destination) as temporary:
            temporary.mkdir()
            for book in books:
                shutil.copyfile(book, temporary / book.name)
        return destination

    entries = []
    for number, line in enumerate(read_small(source).splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) > 2:
            raise UserError(f"{source}:{number}: expected '<url> [checksum]', got {line!r}")
        entries.append((fields[0], fields[1] if len(fields) == 2 else None))
    if not entries:
        raise UserError(f"{source}: lists no book URLs")
    staging = destination.with_name(destination.name + ".part")
    staging.mkdir(parents=True, exist_ok=True)
    names = set()
    for url, checksum in entries:
        name = basename(url)
        if name in names:
            raise UserError(f"{source}: two books are named {name!r}")
        names.add(name)
        if not (staging / name).exists():
            fetch(url, staging / name, checksum=checksum)
    if destination.exists():
        shutil.rmtree(destination)
    os.replace(staging, destination)
    return destination


def _sibling(url: str, name: str) -> str:
    """`name` (which may start with `../`) resolved beside `url`, a URL or a local path."""
    if _is_remote(url) or url.startswith("file:"):
        return urllib.parse.urljoin(url, name)
    return os.path.normpath(os.path.join(os.path.dirname(url), name))


def checksum_list_beside(url: str) -> str | None:
    """Where the dump site keeps the md5sums list of dump `url`: `<prefix>-md5sums.txt` beside it (None: no dump name)."""
    match = DUMP_NAME.fullmatch(basename(url))
    return _sibling(url, f"{match['prefix']}-md5sums.txt") if match else None


def fetch_dump(url: str, destination: str | os.PathLike, checksum_url: str | None = None) -> Path:
    """`fetch` a Wikipedia dump (or one part), verified against `checksum_url`, else against the md5sums list beside it.

    With neither (a local export with no list beside it), the file is copied and the log says it was not verified.
    """
    listing = checksum_url or checksum_list_beside(url)
    if not checksum_url and listing and read_small(listing, missing_ok=True) is None:
        listing = None
    if not listing:
        log.warning("%s: nothing verified: wikipedia.checksum_url is not set and no %s lies beside the dump",
                    url, basename(checksum_list_beside(url) or "<prefix>-md5sums.txt"))
    # kept as .xml.bz2, which the later stages read as bz2
    return fetch(url, destination, listing, check=lambda part: check_mediawiki_export(part, url, bz2_only=True))


@dataclass(frozen=True)
class DumpPart:
    """One file of a dump: `name` is its page-id range `pFIRSTpLAST` (`whole` for a one-file dump)."""

    name: str
    url: str
    checksum_url: str  # "" = the list beside the dump, looked up when it is downloaded


def listed_parts(url: str, listing: str, text: str) -> list[DumpPart]:
    """The parts of dump `url` named in checksum list `text` (read from `listing`), in page-id order.

    A `-latest-` dump's list names dated files: in the dump site's `latest/` directory these are fetched from the
    dated directory beside it (`../YYYYMMDD/`), so a dump that is replaced by a newer one mid-download stays whole.
    """
    prefix = DUMP_NAME.fullmatch(basename(url))["prefix"]
    pattern = re.escape(prefix)
    if "-latest" in prefix:
        pattern = pattern.replace("latest", "(?P<date>latest|[0-9]{8})", 1)
    pattern = re.compile(pattern + PART_SUFFIX)
    found = []
    for name in checksums_listed(text):
        match = pattern.fullmatch(name)
        if match:
            found.append((int(match["first"]), int(match["last"]), name, match.groupdict().get("date")))
    found.sort()
    dates = {date for *_, date in found}
    if len(dates) > 1:
        raise UserError(f"{listing}: lists parts of several dumps ({', '.join(sorted(dates))})")
    for (_, last, name, _), (first, _, other, _) in zip(found, found[1:]):
        if first <= last:
            raise UserError(f"{listing}: parts {name} and {other} overlap")
    in_latest_dir = Path(urllib.parse.urlsplit(url).path if _is_remote(url) else url).parent.name == "latest"
    parts = []
    for first, last, name, date in found:
        if date and date != "latest":
            name = f"../{date}/{name}" if in_latest_dir else name.replace(date, "latest", 1)
        parts.append(DumpPart(f"p{first}p{last}", _sibling(url, name), listing))
    return parts


def dump_parts(url: str, checksum_url: str | None, mode: str, cache_dir: str | os.PathLike) -> list[DumpPart]:
    """The files dump `url` is downloaded and processed as, known before any job runs (config `wikipedia.parts`).

    `single`: the one file. `auto`: the parts the dump's checksum list (`checksum_url`, else the md5sums list beside
    the dump) names, or the one file if it names none or there is no list. A remote list is fetched once and kept in
    `cache_dir`; every part is then verified against that copy.
    """
    whole = [DumpPart(WHOLE, url, checksum_url or "")]
    if mode == "single" or not DUMP_NAME.fullmatch(basename(url)):
        return whole
    listing = checksum_url or checksum_list_beside(url)
    if _is_remote(listing):
        cached = Path(cache_dir) / basename(listing)
        if not cached.is_file():
            text = read_small(listing, missing_ok=not checksum_url)
            if text is None:
                return whole
            write_text(cached, text)
        listing = str(cached)
    text = read_small(listing, missing_ok=not checksum_url)
    if text is None:
        return whole
    return listed_parts(url, listing, text) or [DumpPart(WHOLE, url, listing)]


def date_without_listing(url: str, date: str | None) -> datetime.date | None:
    """The day dump `url` was taken as its name or `date` (config wikipedia.date) gives it; None for a `latest` dump
    (its checksum list dates it: dump_date). Raises UserError, naming the key, for a dump nothing dates."""
    named = date_in_name(basename(url))
    if date is not None:
        given = parse_dump_date(date)
        if named is not None and given != named:
            raise UserError(f"config key 'wikipedia.date': {given}, but the dump {basename(url)} is of {named}; "
                            "remove the key (the dump's name dates it)")
        return given
    if named is None and not is_latest(url):
        raise UserError(f"config key 'wikipedia.date': not set, and the dump {basename(url)} has no date in its name "
                        "(<wiki>-YYYYMMDD-pages-articles...); set wikipedia.date: YYYY-MM-DD, the day the dump was "
                        "taken (its {{CURRENTYEAR}} and the like are filled from it)")
    return named


def is_latest(url: str) -> bool:
    match = DUMP_NAME.fullmatch(basename(url))
    return bool(match) and match["prefix"].endswith("-latest")


def dump_date(url: str, checksum_url: str | None, date: str | None) -> datetime.date:
    """The day dump `url` was taken, which every part's {{CURRENTYEAR}} and the like are filled from: the date in its
    name (enwiki-20241001-pages-articles.xml.bz2), else `date` (config wikipedia.date), else for a `latest` dump the
    date of the dated files its checksum list names (`checksum_url`, the list its parts were verified against: the
    copy dump_parts keeps, else the list beside the dump)."""
    known = date_without_listing(url, date)
    if known is not None:
        return known
    listing = checksum_url or checksum_list_beside(url)
    dated = re.compile(re.escape(DUMP_NAME.fullmatch(basename(url))["prefix"][: -len("latest")]) + "[0-9]{8}-")
    dates = {date_in_name(name) for name in checksums_listed(read_small(listing)) if dated.match(name)} - {None}
    if len(dates) != 1:
        found = ", ".join(sorted(map(str, dates))) or "none"
        raise UserError(f"config key 'wikipedia.date': not set, and {listing} gives the dump {basename(url)} "
                        f"{len(dates)} dates ({found}); set wikipedia.date: YYYY-MM-DD, the day the dump was taken")
    return dates.pop()


def record_dump_date(url: str, checksum_url: str | None, date: str | None, output: str | os.PathLike) -> None:
    """Write the dump's date (dump_date) to `output` (`YYYY-MM-DD`): resolved once, for every part's extract job."""
    day = dump_date(url, checksum_url, date)
    write_text(output, f"{day.isoformat()}\n")
    log.info("%s: dump of %s -> %s", url, day, output)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m workflow.data.download", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    one = commands.add_parser("file", help="one file (a Wikipedia dump, a SQuAD JSON)")
    one.add_argument("--url", required=True, help="http(s)://, file:// or local path")
    one.add_argument("--checksum-url", default=None, help="md5sums/sha1sums list naming the file by basename")
    one.add_argument("--output", required=True)
    dump = commands.add_parser("dump", help="a Wikipedia dump or one of its parts (checked against the list beside it)")
    dump.add_argument("--url", required=True, help="http(s)://, file:// or local path")
    dump.add_argument("--checksum-url", default=None, help="md5sums list (default: <prefix>-md5sums.txt beside the dump)")
    dump.add_argument("--output", required=True)
    date = commands.add_parser("date", help="the day a Wikipedia dump was taken (its magic words' date), to a file")
    date.add_argument("--url", required=True, help="the dump's URL or path (its name may carry the date)")
    date.add_argument("--checksum-url", default=None, help="the md5sums list its parts were verified against (default: "
                                                           "<prefix>-md5sums.txt beside the dump)")
    date.add_argument("--date", default=None, help="YYYY-MM-DD (config wikipedia.date); default: the dump's own")
    date.add_argument("--output", required=True)
    books = commands.add_parser("books", help="BookCorpus: a directory of .txt books or a list of book URLs")
    books.add_argument("--source", required=True)
    books.add_argument("--output", required=True, help="output directory")
    args = parser.parse_args(argv)
    if args.command == "file":
        fetch(args.url, args.output, args.checksum_url or None)
    elif args.command == "dump":
        fetch_dump(args.url, args.output, args.checksum_url or None)
    elif args.command == "date":
        record_dump_date(args.url, args.checksum_url or None, args.date or None, args.output)
    else:
        fetch_books(args.source, args.output)


if __name__ == "__main__":
    run(main)
