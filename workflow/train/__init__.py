"""Pretraining: BERT model, LAMB, the training loop, its data loading, checkpoints, distributed launch."""
