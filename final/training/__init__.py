"""Cartridge training: every way to make a cartridge (a trained KV cache) know something, and to judge it.

An application of InferenceEngine (final/inf.py) above the cartridge library (final/cartridges/), organised by the
nouns of a training run:

  document/   a text -> its sentences (Markdown read by a parser) -> fact rows (quote and cloze questions)
  teacher     the model with the document as its system turn: what every cartridge is trained toward and judged by
  rows        training rows on disk (JSONL: the student's tokens and the teacher's top-k per target)
  start/      the KV a training starts from: the first P tokens, or the document's own KV cut to P (select, match)
  student     the frozen model with a trainable KV prefix; trainer: Adam and checkpoints; losses; hidden
  train       the off-policy trainer over rows; compose: training for cartridges served together
  evaluate/   QA accuracy against the baselines, and two cartridges composed
  onpolicy/   the on-policy loop (seed 000): the student samples (in-process or through veRL), final teaches
  traces      tool-use rows from the multi-turn path
  learn       the recipe (`final cartridge learn`); commands, run, inputs, settings: the command line

Research variants that did not become the recipe are in experiments/ (not in the wheel).
"""
