"""Optimizers (LAMB, AdamW, StableAdamW) and learning-rate schedules (poly, WSD, the batch ramp)."""
