from __future__ import annotations
from hypothesis.stateful import RuleBasedStateMachine, rule
CONTROL_EXEMPT: dict[str, str] = {}
class ControlPlaneStateMachine(RuleBasedStateMachine):
    @rule()
    def noop(self) -> None:
        pass
