"""Pure decisions of the engine loop, shared by the engine, the model checker and the replay harness.

Each function maps what the loop knows to the event it fires next, so that every loop that models the
engine (:class:`kvfsm.engine.loop.EngineLoop`, the model checker's step in :mod:`kvfsm.check.model`, the
replay :class:`kvfsm.check.replay.Harness`) decides the same way.
"""

from __future__ import annotations

from kvfsm.machines.names import EngineEvent, EngineState

__all__ = ["settle_event"]


def settle_event(state: EngineState, has_unfinished: bool) -> EngineEvent | None:
    """The engine machine's event at the end of a step (None: nothing to fire).

    With unfinished requests the engine is (or becomes) running; a running engine whose requests all
    finished is finishing; a finishing or draining one settles (the machine's guards pick draining or
    idle from has_pending_push_work()).
    """
    if has_unfinished:
        return None if state is EngineState.RUNNING else EngineEvent.ADMIT
    if state is EngineState.RUNNING:
        return EngineEvent.ALL_FINISHED
    if state in (EngineState.FINISHING, EngineState.DRAINING):
        return EngineEvent.SETTLE
    return None
