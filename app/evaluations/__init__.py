"""Evaluation jobs: a fixed step of a model sampled on examples, each answer scored."""
