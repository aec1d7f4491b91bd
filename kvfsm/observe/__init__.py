"""Observability: the NDJSON transition trace and its verifier (:mod:`.trace`), Prometheus metrics
(:mod:`.metrics`), the engine-state timeline picture (:mod:`.timeline`), the Mermaid diagrams generated from the
machines (:mod:`.diagrams`) and the one progress display that ``kvfsm bench`` and ``kvfsm check`` share
(:mod:`.progress`). Nothing here is on the engine's path unless installed as a tracer.
"""
