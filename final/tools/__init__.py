"""Tool calling with veRL's tool classes: tools.yaml loading, hermes/qwen25 call parsing, guarded execution."""
