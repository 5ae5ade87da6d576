"""SQuAD: featurize, fine-tune, predict, evaluate with the official metric."""
