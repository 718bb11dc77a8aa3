"""Tokasaurus' HTTP protocol, spoken by both `final serve` and the tokasaurus backend (core: below both).

bodies.py       the request bodies (pydantic, field for field from tokasaurus/server/types.py)
fingerprint.py  the `system_fingerprint` side channel that carries completion ids and logprobs
http.py         POST with retries: what is retried (connection errors, timeouts, 5xx) and what is not (4xx)
"""
