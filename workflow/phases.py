"""The pretraining phases, in order (pretrain.<phase>, encode.<phase>, the {phase} wildcard, --phase): named once,
dependency-free, so that a data job's env need not carry the config's validator to know them."""
PHASES = ("phase1", "phase2")  # the schema's pretrain and encode sections name the same (tests/test_settings.py)
