"""kvfsm's conformance kit: Hypothesis state machines that check an implementation against spec/.

In the manner of ``zarr.testing.stateful``, the machines ship with the library so that other tiers and
copy backends are tested by exactly the machines kvfsm tests its own with. Subclass one, supply a
factory, and let pytest collect its ``TestCase``::

    from kvfsm.testing import SecondaryTierStateMachine

    class MyTierMachine(SecondaryTierStateMachine):
        def make_tier(self, slot_io):
            return MyTier("/tmp/kv", slot_io=slot_io)  # it copies primary slots through slot_io

    TestMyTier = MyTierMachine.TestCase

A tier whose jobs finish only when told can also override ``pending_jobs(tier)`` and
``complete(tier, job_id, success)``, and the machine then decides when each job finishes and whether it
fails.

Contents:

* :class:`SecondaryTierStateMachine` (:mod:`kvfsm.testing.stateful`): any
  :class:`~kvfsm.control.manager.SecondaryTier` behind a :class:`~kvfsm.control.tiering.TieringManager`,
  against the job and slot machines and the invariants. No torch.
* :class:`CopyBackendStateMachine` and :class:`ManualCopyBackend` (:mod:`kvfsm.testing.backend`): any
  :class:`~kvfsm.data.backend.CopyBackend`, byte for byte. Needs torch, which is imported only when one of
  these two names is first used.
* :mod:`kvfsm.testing.system`, :mod:`kvfsm.testing.engine` (torch) and :mod:`kvfsm.testing.control` (no
  torch): kvfsm's own whole-system machine, generated from spec/, over the reference engine with real
  copies and over the control plane alone. :mod:`kvfsm.testing.abstraction` projects their states and
  the model checker's onto one coarse protocol state, to measure coverage;
  :mod:`kvfsm.testing.paths` drives the real control plane along the model checker's paths, at its
  granularity (a lookup, a step, one rank's report are separate events).
* :mod:`kvfsm.testing.coverage`: :func:`covers` / :func:`spec_covered`, which fail a machine class whose
  rules do not drive every event of the spec, and :class:`TransitionLog`, which records what ran.

This package needs ``hypothesis`` (the ``test`` extra); ``import kvfsm`` does not import it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvfsm.testing.coverage import (
    SpecCoverage,
    SpecCoverageError,
    TransitionLog,
    covers,
    spec_coverage,
    spec_covered,
    spec_events,
)
from kvfsm.testing.stateful import SecondaryTierStateMachine

if TYPE_CHECKING:
    from kvfsm.testing.backend import CopyBackendStateMachine, ManualCopyBackend

__all__ = [
    "CopyBackendStateMachine",
    "ManualCopyBackend",
    "SecondaryTierStateMachine",
    "SpecCoverage",
    "SpecCoverageError",
    "TransitionLog",
    "covers",
    "spec_coverage",
    "spec_covered",
    "spec_events",
]

_TORCH_NAMES = frozenset({"CopyBackendStateMachine", "ManualCopyBackend"})


def __getattr__(name: str) -> Any:
    """Import the torch half (:mod:`kvfsm.testing.backend`) only when one of its names is used."""
    if name in _TORCH_NAMES:
        from kvfsm.testing import backend

        return getattr(backend, name)
    raise AttributeError(f"module 'kvfsm.testing' has no attribute {name!r}")
