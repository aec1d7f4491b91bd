"""The reference engine: a small vLLM-like loop with prefix caching, real KV tensors and real copies.

Used by the tests, the demo and the benchmarks. :mod:`kvfsm.engine.loop` (the loop itself),
:mod:`kvfsm.engine.block_pool` and :mod:`kvfsm.engine.requests` need no torch; :mod:`kvfsm.engine.core`
(:class:`~kvfsm.engine.core.ReferenceEngine`) and :mod:`kvfsm.engine.tensor_memory` need the ``torch``
extra.
"""
