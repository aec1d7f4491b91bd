"""The reference engine: a small vLLM-like loop with prefix caching, real KV tensors and real copies.

Used by the tests, the demo and the benchmarks. Needs the ``torch`` extra.
"""
