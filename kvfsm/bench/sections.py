"""The sections of ``kvfsm bench``, by name: the ones a plain run takes and the ones only ``--only`` runs.

Kept apart from :mod:`kvfsm.bench.suite` (which runs them) so that the command line can offer them as choices
without importing the benchmarks.
"""

from __future__ import annotations

__all__ = ["OPT_IN_SECTIONS", "SECTIONS"]

#: The sections a plain ``kvfsm bench`` runs, in order.
SECTIONS: tuple[str, ...] = (
    "drain",
    "control",
    "lifecycle",
    "transfers",
    "verification",
    "redis",
    "vllm",
    "vllm-scheduler",
)
#: Sections only ``--only`` runs (a serving engine per setup, or vLLM's tiering with a Redis server: minutes).
OPT_IN_SECTIONS: tuple[str, ...] = ("e2e", "vllm-tiers")
