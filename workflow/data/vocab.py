"""Stage vocab: validate and copy a given vocab (a WordPiece vocab.txt or a byte-level BPE tokenizer.json, config
vocab.type), or train one on the training shards. workflow.data.tokenizer reads either for the later stages.

A trained vocab is a function of the shards and the settings: the same corpus gives the same file byte for byte.
Left alone, the `tokenizers` WordPiece trainer is not (three runs, three vocabs, whatever PYTHONHASHSEED or
TOKENIZERS_PARALLELISM): it meets the words in the order of a Rust hash map, seeded at random in each process,
numbers the `##x` continuation characters in that order and breaks ties between equally frequent merges by those
numbers; when `limit_alphabet` cuts, equally frequent characters are dropped in hash order too. So the alphabet is
chosen here, by (count, character), and handed to the trainer whole (`initial_alphabet`, `limit_alphabet`), with
every `##x` numbered in advance, in character order, through the trainer's `special_tokens` (which it numbers
first, in the order given). Cost: one extra pass over the shards (a character histogram), and a `##x` for each alphabet
character.

A trained byte-level BPE needs no such help: its alphabet is the 256 byte characters (`initial_alphabet`), which
the BPE trainer numbers in character order itself, and it breaks ties between equally frequent merges by those
numbers (tests/test_bpe.py trains in fresh processes). Its specials are numbered first, as WordPiece's: [PAD] 0,
[UNK] 1, [CLS] 2, [SEP] 3, [MASK] 4, padding at id 0 as in BERT's vocab (the data half pads with the pad role's id,
whatever it is: workflow.data.hdf5.pad_attributes).

Speed: the trainer counts words (normalize, pre-tokenize: ~3 MB/s per core, most of its time) and updates its merges
on `threads` rayon threads, and the character histogram runs in `threads` processes, one shard each; all are sums or
fully ordered, so the file does not depend on the number of threads (tests/test_vocab.py trains in fresh processes
with 1 to 4). What stays serial is the trainer's merge loop on the main thread (~10% of its CPU).
"""
import argparse
import collections
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from workflow.atomic import atomic_path
from workflow.cli import UserError, run
from workflow.pool import forked_pool

log = logging.getLogger(__name__)

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")  # BERT's, in the order of ROLES
ROLES = ("pad", "unk", "cls", "sep", "mask")
# Each role's token as BERT names it, then as RoBERTa's and XLM-R's tokenizer.json do
ROLE_TOKENS = {role: (bert, other) for role, bert, other in zip(ROLES, SPECIAL_TOKENS,
                                                                ("<pad>", "<unk>", "<s>", "</s>", "<mask>"))}
VOCAB_FILES = {"wordpiece": "vocab.txt", "bpe": "tokenizer.json"}  # config vocab.type -> the file stage vocab writes


@dataclass(frozen=True)
class Normalization:
    """What BERT's normaliser does before WordPiece (config vocab.lowercase, vocab.strip_accents,
    vocab.tokenize_chinese_chars): the vocab is trained, every shard tokenized and the export's tokenizer configured
    with the same three, so AutoTokenizer gives the ids pretraining saw."""

    lowercase: bool = True
    strip_accents: bool | None = None  # None: as lowercase (Google's BERT rule; BertNormalizer's and HF's too)
    tokenize_chinese_chars: bool = True  # spaces around each CJK ideograph: one word each

    def bert_normalizer(self):
        """`tokenizers`' BertNormalizer with these settings (and clean_text: control characters out)."""
        from tokenizers.normalizers import BertNormalizer

        return BertNormalizer(clean_text=True, handle_chinese_chars=self.tokenize_chinese_chars,
                              strip_accents=self.strip_accents, lowercase=self.lowercase)

    def flags(self) -> str:
        """The command-line flags that give these settings (add_arguments)."""
        accents = "" if self.strip_accents is None else \
            " --strip-accents" if self.strip_accents else " --no-strip-accents"
        chinese = "" if self.tokenize_chinese_chars else " --no-tokenize-chinese-chars"
        return ("--lowercase" if self.lowercase else "--no-lowercase") + accents + chinese

    @classmethod
    def from_config(cls, vocab: dict) -> "Normalization":
        """From config section `vocab`."""
        return cls(vocab["lowercase"], vocab["strip_accents"], vocab["tokenize_chinese_chars"])

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "Normalization":
        return cls(args.lowercase, args.strip_accents, args.tokenize_chinese_chars)

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--lowercase", action=argparse.BooleanOptionalAction, default=True)
        parser.add_argument("--strip-accents", action=argparse.BooleanOptionalAction, default=None,
                            help="strip accents (default: as --lowercase)")
        parser.add_argument("--tokenize-chinese-chars", action=argparse.BooleanOptionalAction, default=True,
                            help="each CJK ideograph its own word")


def tokenizer_config(normalization: Normalization, model_max_length: int) -> dict:
    """The tokenizer_config.json of an exported model: BERT's WordPiece tokenizer normalising as `normalization`
    (do_lower_case, strip_accents, tokenize_chinese_chars), so that AutoTokenizer gives our tokens."""
    return {"tokenizer_class": "BertTokenizer", "do_lower_case": normalization.lowercase,
            "strip_accents": normalization.strip_accents,
            "tokenize_chinese_chars": normalization.tokenize_chinese_chars, "model_max_length": model_max_length,
            "unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]", "cls_token": "[CLS]",
            "mask_token": "[MASK]"}


def read_vocab(path: str | os.PathLike) -> list[str]:
    """The tokens of a vocab.txt, one per line, in id order. Raises UserError if it is not a usable BERT vocab."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{path}: vocab file not found") from None
    except UnicodeDecodeError as error:
        raise UserError(f"{path}: not a UTF-8 text vocab ({error.reason} at byte {error.start})") from None
    except OSError as error:
        raise UserError(f"{path}: cannot read vocab ({error.strerror})") from None
    tokens = text.split("\n")
    if tokens and tokens[-1] == "":
        tokens.pop()
    tokens = [token.rstrip("\r") for token in tokens]
    seen: dict[str, int] = {}
    for line, token in enumerate(tokens, start=1):
        if not token.strip():
            raise UserError(f"{path}:{line}: empty token in vocab")
        if token in seen:
            raise UserError(f"{path}:{line}: duplicate token {token!r} (first on line {seen[token]})")
        seen[token] = line
    missing = [token for token in SPECIAL_TOKENS if token not in seen]
    if missing:
        raise UserError(f"{path}: vocab lacks the special token(s) {' '.join(missing)}")
    return tokens


def special_token_ids(tokens: Sequence[str]) -> dict[str, int]:
    """Ids of [PAD] [UNK] [CLS] [SEP] [MASK], found by name (Google's vocab puts them at 0/100/101/102/103)."""
    index = {token: i for i, token in enumerate(tokens)}
    return {token: index[token] for token in SPECIAL_TOKENS}


def vocab_file_type(path: str | os.PathLike) -> str:
    """"bpe" for a tokenizer.json (a JSON object), else "wordpiece" (a vocab.txt): what a file claims to be, by its
    first character, before it is read in full."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(4096).lstrip()
    except FileNotFoundError:
        raise UserError(f"{path}: vocab file not found") from None
    except OSError as error:
        raise UserError(f"{path}: cannot read vocab ({error.strerror})") from None
    return "bpe" if head.startswith(b"{") else "wordpiece"


def check_vocab_type(path: str | os.PathLike, vocab_type: str) -> None:
    """Raise UserError (naming config vocab.file and vocab.type) if `path` is not the kind `vocab_type` takes."""
    found = vocab_file_type(path)
    if found != vocab_type:
        kinds = {"wordpiece": "a WordPiece vocab.txt", "bpe": "a tokenizer.json"}
        raise UserError(f"config key 'vocab.file': {path} is {kinds[found]}, but vocab.type {vocab_type} takes "
                        f"{kinds[vocab_type]} (set vocab.type: {found}, or give {kinds[vocab_type]})")


def vocab_config_error(config: dict) -> str | None:
    """A vocab.file of the other vocab.type, as one line naming both keys; None when it fits or is absent (the vocab
    rule reports a missing file)."""
    path = config["vocab"]["file"]
    if not path or not Path(path).is_file():
        return None
    try:
        check_vocab_type(path, config["vocab"]["type"])
    except UserError as error:
        return str(error)
    return None


def pre_tokenizer_steps(data: dict) -> list[dict]:
    """The pre-tokenizers of a tokenizer.json's data, a Sequence's in order (the dicts themselves, to edit)."""
    step = data.get("pre_tokenizer") or {}
    return list(step.get("pretokenizers", [])) if step.get("type") == "Sequence" else [step]


def word_start(data: dict) -> tuple[str, bool] | None:
    """How a tokenizer.json's tokens mark a word's first piece: (the mark, whether a text's first word gets it too):
    a byte-level BPE's space "Ġ" (add_prefix_space), a SentencePiece model's "▁" (Metaspace's replacement; prepended
    unless prepend_scheme is never); None for neither."""
    for step in pre_tokenizer_steps(data):
        if step.get("type") == "ByteLevel":
            return "\u0120", bool(step.get("add_prefix_space", True))
        if step.get("type") == "Metaspace":
            prepend = step.get("prepend_scheme", "always" if step.get("add_prefix_space", True) else "never")
            return step.get("replacement", "\u2581"), prepend != "never"
    return None


def special_tokens(token_to_id, roles=tuple(ROLE_TOKENS)) -> dict[str, str | None]:
    """Each of `roles`' special token (ROLE_TOKENS: BERT's name, else RoBERTa's) as `token_to_id` knows it; None:
    none."""
    return {role: next((token for token in ROLE_TOKENS[role] if token_to_id(token) is not None), None)
            for role in roles}


def read_tokenizer_json(path: str | os.PathLike):
    """A `tokenizers.Tokenizer` from a tokenizer.json whose tokens mark where words start: a byte-level BPE (ours,
    ModernBERT's, RoBERTa's) or a SentencePiece model (BPE or Unigram with Metaspace: XLM-R's). Raises UserError if it
    is neither or lacks a role's special token (ROLE_TOKENS)."""
    from tokenizers import Tokenizer

    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        model, pre_tokenizer = data["model"]["type"], (data.get("pre_tokenizer") or {}).get("type")
    except FileNotFoundError:
        raise UserError(f"{path}: vocab file not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as error:
        raise UserError(f"{path}: not a tokenizer.json ({error})") from None
    if model not in ("BPE", "Unigram") or word_start(data) is None:
        raise UserError(f"{path}: a {model} tokenizer with pre-tokenizer {pre_tokenizer}, not a byte-level BPE (model "
                        "BPE, pre_tokenizer ByteLevel) or a SentencePiece model (BPE or Unigram, pre_tokenizer "
                        "Metaspace); a WordPiece model is read from its vocab.txt (vocab.type: wordpiece)")
    try:
        tokenizer = Tokenizer.from_str(json.dumps(data))
    except Exception as error:  # tokenizers raises a bare Exception for a malformed file
        raise UserError(f"{path}: cannot load the tokenizer ({error})") from None
    missing = [" or ".join(ROLE_TOKENS[role]) for role, token in special_tokens(tokenizer.token_to_id).items()
               if token is None]
    if missing:
        raise UserError(f"{path}: tokenizer lacks the special token(s) {', '.join(missing)}")
    return tokenizer


def copy_tokenizer(source: str | os.PathLike, output: str | os.PathLike) -> int:
    """Validate the tokenizer.json `source` and copy it byte for byte to `output`; returns its size (ids)."""
    size = max(read_tokenizer_json(source).get_vocab(with_added_tokens=True).values()) + 1
    _write(output, Path(source).read_bytes())
    return size


def copy_vocab(source: str | os.PathLike, output: str | os.PathLike) -> int:
    """Validate `source` and copy it byte for byte to `output`; returns the vocab size."""
    tokens = read_vocab(source)
    data = Path(source).read_bytes()
    _write(output, data)
    return len(tokens)


def _code_point_histogram(shard: str | os.PathLike):
    """Occurrences of each code point in `shard` (a C-speed pass, ~50 M characters/s)."""
    import numpy as np

    histogram = np.zeros(0x110000, dtype=np.int64)
    try:
        with open(shard, encoding="utf-8") as handle:
            while block := handle.read(1 << 22):
                code_points = np.frombuffer(block.encode("utf-32-le"), dtype=np.uint32)
                histogram += np.bincount(code_points, minlength=len(histogram))
    except UnicodeDecodeError as error:
        raise UserError(f"{shard}: not UTF-8 text ({error.reason})") from None
    return histogram


def character_counts(shards: Sequence[str | os.PathLike], normalizer, processes: int = 1) -> collections.Counter:
    """How often each character occurs in `shards` once `normalizer` has run (whitespace left out). The normalizer
    must work character by character, as BertNormalizer does (clean-up, accent stripping, lowercasing).
    `processes`: shards counted in parallel (a sum: the same counts for any number)."""
    if processes > 1 and len(shards) > 1:
        with forked_pool(min(processes, len(shards))) as pool:
            histograms = pool.imap_unordered(_code_point_histogram, shards)
            histogram = next(histograms)
            for other in histograms:
                histogram += other
    else:
        histogram = sum(_code_point_histogram(shard) for shard in shards)
    import numpy as np

    counts: collections.Counter = collections.Counter()
    for code_point in np.flatnonzero(histogram):  # each distinct character normalized once, not each occurrence
        for char in normalizer.normalize_str(chr(code_point)):
            if not char.isspace():
                counts[char] += int(histogram[code_point])
    return counts


def choose_alphabet(counts: collections.Counter, limit: int) -> list[str]:
    """The `limit` most frequent characters, ties broken by character, in character order."""
    return sorted(sorted(counts, key=lambda char: (-counts[char], char))[:limit])


def train_vocab(shards: Sequence[str | os.PathLike], output: str | os.PathLike, size: int, lowercase: bool = True,
                limit_alphabet: int = 1000, threads: int = 1, normalization: Normalization | None = None) -> int:
    """Train a BERT WordPiece vocab of `size` tokens on text `shards`, the same file for the same input; returns
    the size reached (more than `size` only if the specials and the alphabet with its `##x` alone exceed it).

    `threads`: processes for the character histogram. The trainer's threads are rayon's (RAYON_NUM_THREADS, read
    once per process when tokenizers first runs in parallel: the CLI sets it from --threads). `normalization`: the
    normaliser's settings (default: `lowercase`, accents as lowercase, CJK characters apart)."""
    from tokenizers import BertWordPieceTokenizer

    _check_shards(shards)
    tokenizer = BertWordPieceTokenizer(clean_text=True)
    tokenizer.normalizer = (normalization or Normalization(lowercase)).bert_normalizer()
    alphabet = choose_alphabet(character_counts(shards, tokenizer.normalizer, threads), limit_alphabet)
    tokenizer.train(
        [str(shard) for shard in shards],
        vocab_size=size,
        min_frequency=2,
        # exactly this alphabet: initial characters rank above every counted one, so the limit drops all the others
        limit_alphabet=len(alphabet),
        initial_alphabet=alphabet,
        # numbered first and in this order: fixed ids for `##x`, hence a fixed order of tied merges
        special_tokens=[*SPECIAL_TOKENS, *(f"##{char}" for char in alphabet)],
        wordpieces_prefix="##",
        show_progress=False,
    )
    with tempfile.TemporaryDirectory() as directory:
        saved = tokenizer.save_model(directory)[0]
        data = Path(saved).read_bytes()
    _write(output, data)
    n_tokens = len(read_vocab(output))
    log.info("trained a WordPiece vocab of %d tokens (asked %d; alphabet %d characters) on %d shard(s)", n_tokens,
             size, len(alphabet), len(shards))
    return n_tokens


def train_bpe(shards: Sequence[str | os.PathLike], output: str | os.PathLike, size: int) -> int:
    """Train a byte-level BPE tokenizer.json of `size` ids on text `shards`, the same file for the same input:
    BERT's special tokens first (SPECIAL_TOKENS), the 256 byte characters, then the merges; no normaliser (cased,
    every text round-trips), a space before each text (add_prefix_space: a sentence tokenizes as inside its
    document), `[CLS] A [SEP]` and `[CLS] A [SEP] B [SEP]` added on request. Returns the size reached. Threads:
    rayon's, as for train_vocab."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    _check_shards(shards)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train([str(shard) for shard in shards], trainer)
    cls, sep = ((token, tokenizer.token_to_id(token)) for token in ("[CLS]", "[SEP]"))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[cls, sep])
    _write(output, (tokenizer.to_str(pretty=True) + "\n").encode("utf-8"))
    n_ids = tokenizer.get_vocab_size(with_added_tokens=True)
    log.info("trained a byte-level BPE of %d ids (asked %d) on %d shard(s)", n_ids, size, len(shards))
    return n_ids


def _check_shards(shards: Sequence[str | os.PathLike]) -> None:
    for shard in shards:
        if not Path(shard).is_file():
            raise UserError(f"{shard}: training shard not found")
    if not any(Path(shard).stat().st_size for shard in shards):
        raise UserError(f"{shards[0]}: training shards are empty, nothing to train a vocab on")


def _write(output: str | os.PathLike, data: bytes) -> None:
    try:
        with atomic_path(output) as temporary:
            temporary.write_bytes(data)
    except OSError as error:
        raise UserError(f"{output}: cannot write ({error.strerror})") from None


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True, help="vocab.txt (wordpiece) or tokenizer.json (bpe) to write")
    parser.add_argument("--type", choices=tuple(VOCAB_FILES), default="wordpiece", help="the vocab's type")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--vocab-file", help="an existing vocab of --type (vocab.txt, tokenizer.json) to copy")
    source.add_argument("--shard-dir", help="directory of training text shards shard_0.txt ... to train a vocab on")
    parser.add_argument("--n-shards", type=int, help="number of shards in --shard-dir")
    parser.add_argument("--size", type=int, default=30522, help="size of a trained vocab")
    Normalization.add_arguments(parser)
    parser.add_argument("--threads", type=int, default=1, help="trainer threads (the same vocab for any number)")
    args = parser.parse_args(argv)
    if args.vocab_file:
        check_vocab_type(args.vocab_file, args.type)
        n_tokens = (copy_tokenizer if args.type == "bpe" else copy_vocab)(args.vocab_file, args.output)
        log.info("copied %s (%d tokens) to %s", args.vocab_file, n_tokens, args.output)
    else:
        if not args.n_shards:
            parser.error("--shard-dir needs --n-shards")
        shards = [Path(args.shard_dir) / f"shard_{index}.txt" for index in range(args.n_shards)]
        # before tokenizers first runs in parallel: rayon sizes its pool once, from this variable
        os.environ["RAYON_NUM_THREADS"] = str(args.threads)
        os.environ["TOKENIZERS_PARALLELISM"] = "true" if args.threads > 1 else "false"
        if args.type == "bpe":
            train_bpe(shards, args.output, args.size)
        else:
            train_vocab(shards, args.output, args.size, threads=args.threads,
                        normalization=Normalization.from_args(args))


if __name__ == "__main__":
    run(main)
