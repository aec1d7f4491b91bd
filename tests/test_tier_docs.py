"""Every constructor parameter of the tier configs is documented (name, default) in its class docstring,
and every FaultRule field has a ``#:`` comment, so ``help()`` answers what a user would ask."""

from __future__ import annotations

import inspect
import re

import pytest

from kvfsm.tiers.blockfile import BlockIO
from kvfsm.tiers.faults import FaultPlan, FaultRule
from kvfsm.tiers.fs import FileSystemTier
from kvfsm.tiers.lookup import AsyncLookup
from kvfsm.tiers.memory import InMemoryTier
from kvfsm.tiers.pool import DualQueuePool


@pytest.mark.parametrize("cls", [FileSystemTier, InMemoryTier, DualQueuePool, AsyncLookup, BlockIO, FaultPlan])
def test_every_constructor_parameter_is_documented_with_its_default(cls: type) -> None:
    doc = inspect.getdoc(cls) or ""
    params = [p for p in inspect.signature(cls).parameters.values() if p.name != "self"]
    assert params
    for p in params:
        assert f"``{p.name}``" in doc, f"{cls.__name__}: parameter {p.name!r} is not documented"
        if p.default is not inspect.Parameter.empty:  # "``name`` (type; default ...)"
            stated = re.search(rf"``{p.name}`` \([^)]*default", doc)
            assert stated, f"{cls.__name__}.{p.name}: its default is not stated"


def test_file_system_tier_docs_name_the_lmcache_and_vllm_equivalents() -> None:
    doc = inspect.getdoc(FileSystemTier) or ""
    for name in ("local_disk", "max_local_disk_size", "shared_storage_path", "threads_per_gpu"):
        assert name in doc


def test_every_fault_rule_field_has_a_doc_comment() -> None:
    source = inspect.getsource(FaultRule)
    for name in FaultRule.__dataclass_fields__:
        assert re.search(rf"#: .*\n    {name}: ", source), f"FaultRule.{name} has no #: comment"
