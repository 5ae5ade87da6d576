"""snakebert: one module per pipeline stage, each runnable as `python -m workflow.<stage>`."""
