"""Data half: download, extract, format, shard, vocab, tokenize, encode to HDF5."""
