"""The spec machines: the loader of spec/*.toml (:mod:`.loader`), the state, event and effect names
(:mod:`.names`), the compiled tables and the tracer registry (:mod:`.compiled`), and the guards bound to each
machine (:mod:`.guards`). The rules behind every table are argued in ``spec/README.md``.
"""

from __future__ import annotations

from kvfsm.machines.guards import engine_machine, job_machine, request_machine, slot_machine

__all__ = ["engine_machine", "job_machine", "request_machine", "slot_machine"]
