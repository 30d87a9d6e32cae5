"""Experiments over runs: the paper's matrix and its report, evaluation of checkpoints."""
