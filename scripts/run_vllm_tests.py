#!/usr/bin/env python
"""Run vLLM 0.33's own offloading tests with kvfsm in place of vLLM's CPU manager and CPU spec.

    python scripts/run_vllm_tests.py --vllm-src DIR [--fetch] [--suite cpu|connector|all] [--native] [pytest args]

``--fetch`` first puts vLLM's tests under DIR: vLLM's wheel has none, so they come from the PyPI sdist of
the installed version (``pip download --no-binary :all: --no-clean`` unpacks it; building its metadata
then fails, which is expected, and the unpacked tree stays behind).

vLLM's test files are not edited. Before pytest imports any of them, the plugin in this file:

- replaces ``vllm.v1.kv_offload.cpu.manager.CPUOffloadingManager`` by kvfsm's adapter
  (``kvfsm.vllm.KvfsmCPUOffloadingManager``); every test module and vLLM module that imports the name
  afterwards (vLLM's tiering primary subclasses it) gets kvfsm's manager;
- registers ``KvfsmOffloadingSpec`` under vLLM's spec name ``CPUOffloadingSpec``, so a connector test that
  asks for the CPU spec gets kvfsm's;
- marks the tests of ``kvfsm/vllm/deliberate_differences.toml`` xfail (strict: one that starts passing fails
  the run), each with its written reason.

It also writes the offline Hugging Face config stub the tests need for their hard-coded model name (no
weights) and runs on CPU (``CUDA_VISIBLE_DEVICES=""``, ``VLLM_TARGET_DEVICE=cpu``, ``HF_HUB_OFFLINE=1``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DIFFERENCES = REPO / "kvfsm" / "vllm" / "deliberate_differences.toml"

SUITES = {
    # vLLM's CPU-manager and policy tests (the 87 of tests/v1/kv_offload/cpu that test the manager).
    "cpu": [
        "tests/v1/kv_offload/cpu/test_manager.py",
        "tests/v1/kv_offload/cpu/test_capacity.py",
        "tests/v1/kv_offload/cpu/policies",
    ],
    "connector": ["tests/v1/kv_connector/unit/offloading_connector"],
}

#: The one model name vLLM's test helpers hard-code; only its config is read.
_OPT_125M = {
    "_name_or_path": "facebook/opt-125m",
    "activation_dropout": 0.0,
    "activation_function": "relu",
    "architectures": ["OPTForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 2,
    "do_layer_norm_before": True,
    "dropout": 0.1,
    "eos_token_id": 2,
    "ffn_dim": 3072,
    "hidden_size": 768,
    "init_std": 0.02,
    "layerdrop": 0.0,
    "max_position_embeddings": 2048,
    "model_type": "opt",
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "pad_token_id": 1,
    "prefix": "</s>",
    "torch_dtype": "float16",
    "transformers_version": "4.21.0.dev0",
    "use_cache": True,
    "vocab_size": 50272,
    "word_embed_proj_dim": 768,
}


def write_hf_stub(home: Path) -> None:
    """An offline hub cache holding facebook/opt-125m's config.json only."""
    repo = home / "hub" / "models--facebook--opt-125m"
    commit = "0" * 40
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    (snap / "config.json").write_text(json.dumps(_OPT_125M))
    (snap / "generation_config.json").write_text(json.dumps({"bos_token_id": 2, "eos_token_id": 2}))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)


def load_differences() -> list[dict[str, str]]:
    with DIFFERENCES.open("rb") as f:
        data = tomllib.load(f)
    entries: list[dict[str, str]] = data.get("difference", [])
    for e in entries:
        missing = {"test", "category", "reason"} - set(e)
        if missing:
            raise SystemExit(f"{DIFFERENCES}: entry {e!r} lacks {sorted(missing)}")
    return entries


class KvfsmPlugin:
    """Puts kvfsm in vLLM's place at configure time (before any test module is imported)."""

    def __init__(self, differences: list[dict[str, str]]) -> None:
        self.differences = differences
        self.used: set[str] = set()

    def pytest_configure(self, config: Any) -> None:
        import vllm.v1.kv_offload.cpu.manager as vllm_cpu_manager
        from vllm.v1.kv_offload.factory import OffloadingSpecFactory

        from kvfsm.vllm.manager import KvfsmCPUOffloadingManager

        # Swap the class before anything else imports it (kvfsm.vllm.spec imports vLLM's CPU spec module).
        self.native_manager = vllm_cpu_manager.CPUOffloadingManager
        vllm_cpu_manager.CPUOffloadingManager = KvfsmCPUOffloadingManager  # type: ignore[misc]
        from kvfsm.vllm.spec import KvfsmOffloadingSpec

        OffloadingSpecFactory._registry["CPUOffloadingSpec"] = lambda: KvfsmOffloadingSpec
        config.addinivalue_line("markers", "cpu_test: vLLM's marker of CPU-only tests")

    def pytest_collection_modifyitems(self, session: Any, config: Any, items: list[Any]) -> None:
        import pytest

        for item in items:
            for e in self.differences:
                if item.nodeid == e["test"] or item.nodeid.startswith(e["test"] + "["):
                    self.used.add(e["test"])
                    item.add_marker(pytest.mark.xfail(reason=f"[{e['category']}] {e['reason']}", strict=True))

    def pytest_collection_finish(self, session: Any) -> None:
        """Every module (vLLM's and the tests') must see kvfsm's manager: fail if vLLM's was bound first."""
        from kvfsm.vllm.manager import KvfsmCPUOffloadingManager

        stale = sorted(
            name
            for name, module in list(sys.modules.items())
            if getattr(module, "CPUOffloadingManager", None) is self.native_manager
        )
        if stale:
            raise SystemExit(f"kvfsm: these modules still bind vLLM's CPUOffloadingManager: {stale}")
        tiering = sys.modules.get("vllm.v1.kv_offload.tiering.manager")
        if tiering is not None and not issubclass(tiering.CPUPrimaryTierOffloadingManager, KvfsmCPUOffloadingManager):
            raise SystemExit("kvfsm: vLLM's tiering primary does not run on kvfsm's manager")

    def pytest_sessionfinish(self, session: Any, exitstatus: int) -> None:
        selected = {e["test"] for e in self.differences}
        unused = sorted(t for t in selected - self.used if any(t.startswith(p) for p in session.config.args))
        if unused:
            print(f"\nkvfsm: deliberate differences naming no collected test: {unused}", file=sys.stderr)


def fetch_vllm_tests(dest: Path) -> None:
    """Copy the installed vLLM version's sdist tests/ to ``dest/tests`` (see the module docstring)."""
    import shutil
    import subprocess
    from importlib.metadata import version

    if (dest / "tests" / "v1").is_dir():
        return
    tmp = dest / "sdist-tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--no-build-isolation"]
    cmd += ["--no-clean", f"vllm=={version('vllm')}", "-d", str(dest / "dl")]
    # Expected to fail at the metadata step; only the unpacked tree is wanted.
    subprocess.run(cmd, env={**os.environ, "TMPDIR": str(tmp)}, capture_output=True, check=False)
    found = sorted(p.parent for p in tmp.glob("*/*/tests/v1") if p.is_dir())
    if not found:
        raise SystemExit(f"run_vllm_tests: pip left no unpacked vLLM sdist with tests/ under {tmp}")
    shutil.copytree(found[0], dest / "tests")
    shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-src", required=True, type=Path, help="directory holding vLLM's tests/ (sdist)")
    parser.add_argument("--fetch", action="store_true", help="first fetch the tests from vLLM's sdist into --vllm-src")
    parser.add_argument("--suite", choices=[*SUITES, "all"], default="all")
    parser.add_argument(
        "--native", action="store_true", help="run the suites on vLLM's own manager and spec (the baseline), no kvfsm"
    )
    args, rest = parser.parse_known_args(argv)
    src: Path = args.vllm_src.resolve()
    if args.fetch:
        fetch_vllm_tests(src)
    if not (src / "tests" / "v1").is_dir():
        print(f"run_vllm_tests: {src} has no tests/v1; expected vLLM's sdist tree", file=sys.stderr)
        return 2
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ["VLLM_TARGET_DEVICE"] = "cpu"
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    home = Path(tempfile.mkdtemp(prefix="kvfsm-hf-"))
    write_hf_stub(home)
    os.environ["HF_HOME"] = str(home)
    os.chdir(src)
    sys.path.insert(0, str(src))
    suites = list(SUITES) if args.suite == "all" else [args.suite]
    paths = [p for s in suites for p in SUITES[s]]
    import pytest

    # An ini file of the sdist tree's own makes it pytest's rootdir: where the tree lies inside kvfsm's checkout
    # (tox's envtmpdir), pytest would otherwise take kvfsm's pyproject.toml, whose --strict-markers rejects
    # vLLM's own markers (skip_global_cleanup, ...).
    ini = src / "pytest.ini"
    ini.write_text("[pytest]\n")
    # vLLM's top-level tests/conftest.py needs its whole test requirements; the suites need none of it.
    return int(
        pytest.main(
            [
                "-p",
                "no:cacheprovider",
                "-c",
                str(ini),
                "--rootdir",
                str(src),
                "--confcutdir",
                "tests/v1",
                "-q",
                *paths,
                *rest,
            ],
            plugins=[] if args.native else [KvfsmPlugin(load_differences())],
        )
    )


if __name__ == "__main__":
    sys.exit(main())
