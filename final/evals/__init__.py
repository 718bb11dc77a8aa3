"""Evaluations run through the rollout contract (GSM8K with and without tools)."""
