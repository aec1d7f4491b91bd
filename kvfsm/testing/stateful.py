"""Placeholder while the tier kit is written."""

from __future__ import annotations

from hypothesis.stateful import RuleBasedStateMachine

__all__ = ["SecondaryTierStateMachine"]


class SecondaryTierStateMachine(RuleBasedStateMachine):
    pass
