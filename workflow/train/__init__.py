"""Pretraining and the fine-tuning driver: BERT model, LAMB, the training engine, its data loading, checkpoints, the
process group of a rank."""
