"""Rollout jobs' building blocks: graders that score answers, a pooled sampling client."""
