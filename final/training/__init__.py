"""Training cartridges: applications of InferenceEngine that sit above it.

synth (self-study conversations), convs (their JSONL rows), train (off-policy distillation into a trainable KV
prefix), distill (the on-policy loop), evaluate (held-out KL to the full-document teacher), and the `final
cartridge` command line. final/cartridges/ below stays the format and serving library that inf.py uses.
"""
