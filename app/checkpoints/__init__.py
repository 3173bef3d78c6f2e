"""The checkpoint registry: a model's checkpoints as its backend keeps them on disk, joined
with the jobs that made them; aliases, retention, export."""
