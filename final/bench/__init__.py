"""Benchmarks of the embedded engine against the references a user would otherwise reach for (`final bench`).

P1 throughput vs HF generate (throughput.py), P2 cartridge TTFT vs prefill (ttft.py), P3 KV memory of rows
sharing a cartridge (memory.py), P4 InferenceEngine overhead over the bare rollout (overhead.py); cli.py runs
them and prints the table or JSON. Results and the machine they came from are recorded in bench/RESULTS.md.
"""
