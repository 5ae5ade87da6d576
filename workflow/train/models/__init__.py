"""The model families (HF's models/<name>/): each family's model and its HF import/export, their registry
(family.py), the attention kernels (flash_varlen.py) and NVIDIA DLE checkpoints (dle_checkpoint.py)."""
