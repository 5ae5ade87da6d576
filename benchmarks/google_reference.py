"""The pure-Python route to pretraining HDF5: Google's create_pretraining_data.py as NVIDIA DLE runs it.

A straightforward per-instance port (token strings, Python `random`, one instance at a time) of Google's
create_training_instances / create_instances_from_document / truncate_seq_pair / create_masked_lm_predictions,
with Google's FullTokenizer (BasicTokenizer + WordpieceTokenizer, taken from transformers' Python
`BertTokenizerLegacy`: transformers 5's `BertTokenizer` is the Rust one) and NVIDIA's HDF5 writer
(create_pretraining_data.py of DeepLearningExamples/PyTorch/LanguageModeling/BERT: int32/int8 arrays, gzip).

It is the baseline of benchmarks/encode_throughput.py and the reference the encode tests compare statistics with.

    python benchmarks/google_reference.py --text shard.txt --vocab vocab.txt --output out.hdf5 --max-seq-length 128

prints, as one JSON line on stdout, the instance count and the CPU seconds of each phase (tokenize, create, write).
"""
import argparse
import collections
import json
import random
import time

import h5py
import numpy as np

MaskedLmInstance = collections.namedtuple("MaskedLmInstance", ["index", "label"])
TrainingInstance = collections.namedtuple(
    "TrainingInstance", ["tokens", "segment_ids", "masked_lm_positions", "masked_lm_labels", "is_random_next"]
)


class FullTokenizer:
    """Google's tokenization.FullTokenizer: basic tokenization (clean, CJK, lowercase + strip accents, punctuation)
    then greedy longest-match WordPiece, all in Python."""

    def __init__(self, vocab_file: str, do_lower_case: bool = True):
        from transformers.models.bert.tokenization_bert_legacy import BertTokenizerLegacy

        python_tokenizer = BertTokenizerLegacy(vocab_file, do_lower_case=do_lower_case)
        self.vocab = python_tokenizer.vocab
        self.basic_tokenizer = python_tokenizer.basic_tokenizer
        self.wordpiece_tokenizer = python_tokenizer.wordpiece_tokenizer

    def tokenize(self, text: str) -> list[str]:
        return [piece for token in self.basic_tokenizer.tokenize(text) for piece in self.wordpiece_tokenizer.tokenize(token)]

    def convert_tokens_to_ids(self, tokens) -> list[int]:
        return [self.vocab[token] for token in tokens]


def read_documents(text_file: str, tokenizer: FullTokenizer) -> list[list[list[str]]]:
    """Google's reader: one sentence per line, blank lines between documents; empty documents dropped."""
    all_documents: list[list[list[str]]] = [[]]
    with open(text_file, encoding="utf-8") as reader:
        for line in reader:
            line = line.strip()
            if not line:
                all_documents.append([])
            tokens = tokenizer.tokenize(line)
            if tokens:
                all_documents[-1].append(tokens)
    return [document for document in all_documents if document]


def create_training_instances(all_documents, vocab_words, rng, max_seq_length=128, dupe_factor=5,
                              short_seq_prob=0.1, masked_lm_prob=0.15, max_predictions_per_seq=20,
                              do_whole_word_mask=False) -> list[TrainingInstance]:
    """Google's create_training_instances after reading: documents shuffled, dupe_factor passes, instances shuffled."""
    rng.shuffle(all_documents)
    instances = []
    for _ in range(dupe_factor):
        for document_index in range(len(all_documents)):
            instances.extend(create_instances_from_document(
                all_documents, document_index, max_seq_length, short_seq_prob, masked_lm_prob,
                max_predictions_per_seq, vocab_words, rng, do_whole_word_mask))
    rng.shuffle(instances)
    return instances


def create_instances_from_document(all_documents, document_index, max_seq_length, short_seq_prob, masked_lm_prob,
                                   max_predictions_per_seq, vocab_words, rng, do_whole_word_mask=False):
    """Google's: chunks of sentences up to a target length, split into A/B; B is random half of the time."""
    document = all_documents[document_index]
    max_num_tokens = max_seq_length - 3
    target_seq_length = max_num_tokens
    if rng.random() < short_seq_prob:
        target_seq_length = rng.randint(2, max_num_tokens)
    instances = []
    current_chunk = []
    current_length = 0
    i = 0
    while i < len(document):
        segment = document[i]
        current_chunk.append(segment)
        current_length += len(segment)
        if i == len(document) - 1 or current_length >= target_seq_length:
            if current_chunk:
                a_end = 1
                if len(current_chunk) >= 2:
                    a_end = rng.randint(1, len(current_chunk) - 1)
                tokens_a = []
                for j in range(a_end):
                    tokens_a.extend(current_chunk[j])
                tokens_b = []
                if len(current_chunk) == 1 or rng.random() < 0.5:
                    is_random_next = True
                    target_b_length = target_seq_length - len(tokens_a)
                    for _ in range(10):
                        random_document_index = rng.randint(0, len(all_documents) - 1)
                        if random_document_index != document_index:
                            break
                    random_document = all_documents[random_document_index]
                    random_start = rng.randint(0, len(random_document) - 1)
                    for j in range(random_start, len(random_document)):
                        tokens_b.extend(random_document[j])
                        if len(tokens_b) >= target_b_length:
                            break
                    # The chunk's unused sentences go back for the next instance.
                    num_unused_segments = len(current_chunk) - a_end
                    i -= num_unused_segments
                else:
                    is_random_next = False
                    for j in range(a_end, len(current_chunk)):
                        tokens_b.extend(current_chunk[j])
                truncate_seq_pair(tokens_a, tokens_b, max_num_tokens, rng)
                tokens = ["[CLS]", *tokens_a, "[SEP]", *tokens_b, "[SEP]"]
                segment_ids = [0] * (len(tokens_a) + 2) + [1] * (len(tokens_b) + 1)
                tokens, masked_lm_positions, masked_lm_labels = create_masked_lm_predictions(
                    tokens, masked_lm_prob, max_predictions_per_seq, vocab_words, rng, do_whole_word_mask)
                instances.append(TrainingInstance(tokens, segment_ids, masked_lm_positions, masked_lm_labels,
                                                  is_random_next))
            current_chunk = []
            current_length = 0
        i += 1
    return instances


def create_masked_lm_predictions(tokens, masked_lm_prob, max_predictions_per_seq, vocab_words, rng,
                                 do_whole_word_mask=False):
    """Google's: shuffled candidate (whole-word) positions, round(15%) of them, 80/10/10 [MASK]/keep/random."""
    cand_indexes = []
    for i, token in enumerate(tokens):
        if token == "[CLS]" or token == "[SEP]":
            continue
        if do_whole_word_mask and len(cand_indexes) >= 1 and token.startswith("##"):
            cand_indexes[-1].append(i)
        else:
            cand_indexes.append([i])
    rng.shuffle(cand_indexes)
    output_tokens = list(tokens)
    num_to_predict = min(max_predictions_per_seq, max(1, int(round(len(tokens) * masked_lm_prob))))
    masked_lms = []
    covered_indexes = set()
    for index_set in cand_indexes:
        if len(masked_lms) >= num_to_predict:
            break
        if len(masked_lms) + len(index_set) > num_to_predict:
            continue
        if any(index in covered_indexes for index in index_set):
            continue
        for index in index_set:
            covered_indexes.add(index)
            if rng.random() < 0.8:
                masked_token = "[MASK]"
            elif rng.random() < 0.5:
                masked_token = tokens[index]
            else:
                masked_token = vocab_words[rng.randint(0, len(vocab_words) - 1)]
            output_tokens[index] = masked_token
            masked_lms.append(MaskedLmInstance(index=index, label=tokens[index]))
    masked_lms.sort(key=lambda x: x.index)
    return output_tokens, [p.index for p in masked_lms], [p.label for p in masked_lms]


def truncate_seq_pair(tokens_a, tokens_b, max_num_tokens, rng):
    """Google's: trim the longer segment one token at a time, from a random end, until the pair fits."""
    while len(tokens_a) + len(tokens_b) > max_num_tokens:
        trunc_tokens = tokens_a if len(tokens_a) > len(tokens_b) else tokens_b
        if rng.random() < 0.5:
            del trunc_tokens[0]
        else:
            trunc_tokens.pop()


def write_instances_to_hdf5(instances, tokenizer, max_seq_length, max_predictions_per_seq, output_file):
    """NVIDIA's write_instance_to_example_file: zero-padded int32/int8 arrays filled instance by instance, gzip."""
    n = len(instances)
    features = {
        "input_ids": np.zeros([n, max_seq_length], dtype="int32"),
        "input_mask": np.zeros([n, max_seq_length], dtype="int32"),
        "segment_ids": np.zeros([n, max_seq_length], dtype="int32"),
        "masked_lm_positions": np.zeros([n, max_predictions_per_seq], dtype="int32"),
        "masked_lm_ids": np.zeros([n, max_predictions_per_seq], dtype="int32"),
        "next_sentence_labels": np.zeros(n, dtype="int32"),
    }
    for index, instance in enumerate(instances):
        input_ids = tokenizer.convert_tokens_to_ids(instance.tokens)
        input_mask = [1] * len(input_ids)
        segment_ids = list(instance.segment_ids)
        while len(input_ids) < max_seq_length:
            input_ids.append(0)
            input_mask.append(0)
            segment_ids.append(0)
        masked_lm_positions = list(instance.masked_lm_positions)
        masked_lm_ids = tokenizer.convert_tokens_to_ids(instance.masked_lm_labels)
        while len(masked_lm_positions) < max_predictions_per_seq:
            masked_lm_positions.append(0)
            masked_lm_ids.append(0)
        features["input_ids"][index] = input_ids
        features["input_mask"][index] = input_mask
        features["segment_ids"][index] = segment_ids
        features["masked_lm_positions"][index] = masked_lm_positions
        features["masked_lm_ids"][index] = masked_lm_ids
        features["next_sentence_labels"][index] = 1 if instance.is_random_next else 0
    with h5py.File(output_file, "w") as handle:
        for name, dtype in (("input_ids", "i4"), ("input_mask", "i1"), ("segment_ids", "i1"),
                            ("masked_lm_positions", "i4"), ("masked_lm_ids", "i4"), ("next_sentence_labels", "i1")):
            handle.create_dataset(name, data=features[name], dtype=dtype, compression="gzip")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", required=True, help="one sentence per line, blank line between documents")
    parser.add_argument("--vocab", required=True)
    parser.add_argument("--output", required=True, help="HDF5 file to write")
    parser.add_argument("--max-seq-length", type=int, default=128)
    parser.add_argument("--max-predictions-per-seq", type=int, default=20)
    parser.add_argument("--dupe-factor", type=int, default=5)
    parser.add_argument("--masked-lm-prob", type=float, default=0.15)
    parser.add_argument("--short-seq-prob", type=float, default=0.1)
    parser.add_argument("--whole-word-masking", action="store_true")
    parser.add_argument("--lowercase", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--seed", type=int, default=12345)
    args = parser.parse_args()
    seconds = {}
    start = time.process_time()
    tokenizer = FullTokenizer(args.vocab, do_lower_case=args.lowercase)
    documents = read_documents(args.text, tokenizer)
    seconds["tokenize"] = time.process_time() - start
    start = time.process_time()
    instances = create_training_instances(
        documents, list(tokenizer.vocab.keys()), random.Random(args.seed), args.max_seq_length, args.dupe_factor,
        args.short_seq_prob, args.masked_lm_prob, args.max_predictions_per_seq, args.whole_word_masking)
    seconds["create"] = time.process_time() - start
    start = time.process_time()
    write_instances_to_hdf5(instances, tokenizer, args.max_seq_length, args.max_predictions_per_seq, args.output)
    seconds["write"] = time.process_time() - start
    print(json.dumps({"instances": len(instances), "tokens": sum(len(s) for d in documents for s in d),
                      "seconds": seconds}))


if __name__ == "__main__":
    main()
