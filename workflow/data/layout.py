"""Where a fine-tuning row's special tokens go, as the vocab's own Hugging Face tokenizer puts them: one text is
`cls a sep`; a pair is `cls a sep b sep`, b's token type 1 (BERT's and ModernBERT's template), or `cls a sep sep b sep`,
every token type 0 (RoBERTa's and XLM-R's `<s> a </s></s> b </s>`: a vocab naming its special tokens as theirs,
vocab.ROLE_TOKENS). The ids are taken by role (vocab.ROLE_TOKENS), never by BERT's names alone. Used by the SQuAD, GLUE
and task features (no torch: the data env's).
"""
from dataclasses import dataclass

from workflow.cli import UserError
from workflow.data.vocab import ROLE_TOKENS, special_tokens


@dataclass(frozen=True)
class SequenceLayout:
    """A vocab's special-token ids and its pair template."""

    cls: int
    sep: int
    pad: int
    between: tuple      # the tokens between a pair's two texts: (sep,) or RoBERTa's (sep, sep)
    second_type: int    # the token type of a pair's second text and its closing sep: 1, or RoBERTa's 0

    @classmethod
    def of(cls, tokenizer) -> "SequenceLayout":
        """The layout of a `tokenizers.Tokenizer` (its token_to_id); a vocab without a cls, sep or pad token is a
        UserError."""
        # the roles a row uses (not all five: a vocab without [MASK] still fine-tunes)
        named = special_tokens(tokenizer.token_to_id, ("cls", "sep", "pad"))
        missing = [" or ".join(ROLE_TOKENS[role]) for role, token in named.items() if token is None]
        if missing:
            raise UserError(f"vocab lacks the special token(s) {', '.join(missing)}")
        ids = {role: tokenizer.token_to_id(token) for role, token in named.items()}
        roberta = named["cls"] == ROLE_TOKENS["cls"][1]
        return cls(ids["cls"], ids["sep"], ids["pad"], (ids["sep"],) * (2 if roberta else 1), 0 if roberta else 1)

    def specials(self, paired: bool) -> int:
        """How many special tokens a row of one text (or a pair) adds."""
        return 2 + len(self.between) if paired else 2

    def second_start(self, first_length: int) -> int:
        """Where a pair's second text starts, after `first_length` tokens of the first."""
        return 1 + first_length + len(self.between)

    def row(self, first: list, second: list | None = None) -> list:
        """The ids of one text, or of a pair."""
        if second is None:
            return [self.cls, *first, self.sep]
        return [self.cls, *first, *self.between, *second, self.sep]
