"""Command-line plumbing shared by every stage: logging to the rule's log and one-line errors."""
from __future__ import annotations  # also runs on PyPy 3.9 (the extract rule)

import argparse
import json
import logging
import os
import signal
import sys
from typing import Callable, Sequence


class UserError(Exception):
    """Bad input, config or environment. The message names the file/key/line at fault."""


def phase_directory(text: str) -> tuple[str, str]:
    """argparse type for `PHASE=DIRECTORY` (e.g. `phase1=results/pretrain/phase1`)."""
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected PHASE=DIRECTORY, got {text!r}")
    phase, directory = text.split("=", 1)
    return phase, directory


def config_sections(text: str) -> dict:
    """argparse type for `--config`: the JSON of the config sections a rule hands over whole."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON ({error})") from None


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # unwinds `atomic_path` blocks: a cancelled job leaves no temporary behind


# The one line format of every stage's log (logs/): time, level, module, message. Errors are `error: ...` lines.
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(*own_loggers: str) -> None:
    """INFO and above to stderr (the rule's log) in LOG_FORMAT; `own_loggers`: a library's loggers that keep a
    handler they find (wikiextractor's) and never reach ours, each given one in LOG_FORMAT."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, stream=sys.stderr)
    for name in own_loggers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        logging.getLogger(name).addHandler(handler)


def run(main: Callable[[Sequence[str] | None], None], argv: Sequence[str] | None = None) -> None:
    """Run a stage's `main`; a UserError becomes `error: <message>` on stderr and exit status 1."""
    configure_logging()
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # scancel, Snakemake's shutdown
    # A forked child dies on SIGTERM, never unwinds the parent's blocks; pools also block it across the fork (pool.py).
    os.register_at_fork(after_in_child=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))
    try:
        main(argv)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)
