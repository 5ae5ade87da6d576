"""Sentence (pair) classification features: a row is `[CLS] a [SEP] (b [SEP])` (RoBERTa's vocab: `<s> a </s>(</s> b
</s>)`, workflow.data.layout), `max_seq_length` tokens, the longer of a/b truncated first (Google's run_classifier).
"""
import numpy as np

from workflow.data.layout import SequenceLayout


def _truncate_pair(a: list, b: list, max_tokens: int) -> None:
    """Pop from the longer list until both fit (run_classifier's _truncate_seq_pair)."""
    while len(a) + len(b) > max_tokens:
        (a if len(a) > len(b) else b).pop()


def featurize(pairs: list[tuple[str, str | None]], labels: np.ndarray, tokenizer, max_seq_length: int = 128) -> dict:
    """input_ids, token_type_ids, attention_mask [N, max_seq_length] (int32/int8) and labels [N]."""
    layout = SequenceLayout.of(tokenizer)
    encoded_a = tokenizer.encode_batch([a for a, _ in pairs], add_special_tokens=False)
    paired = pairs[0][1] is not None
    encoded_b = tokenizer.encode_batch([b for _, b in pairs], add_special_tokens=False) if paired else None
    n = len(pairs)
    input_ids = np.full((n, max_seq_length), layout.pad, dtype=np.int32)
    token_type_ids = np.zeros((n, max_seq_length), dtype=np.int8)
    attention_mask = np.zeros((n, max_seq_length), dtype=np.int8)
    for row in range(n):
        a = list(encoded_a[row].ids)
        b = list(encoded_b[row].ids) if paired else []
        _truncate_pair(a, b, max_seq_length - layout.specials(paired))
        ids = layout.row(a, b if paired else None)
        input_ids[row, :len(ids)] = ids
        if paired:
            token_type_ids[row, layout.second_start(len(a)):len(ids)] = layout.second_type
        attention_mask[row, :len(ids)] = 1
    return {"input_ids": input_ids, "token_type_ids": token_type_ids, "attention_mask": attention_mask,
            "labels": labels}
