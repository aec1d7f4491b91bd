"""vLLM 0.33's real ``Scheduler`` driven by a seeded workload, scheduler side only (no model, no GPU).

:class:`SchedulerDriver` builds vLLM's ``Scheduler`` with either vLLM's native ``OffloadingConnector`` (its
CPU offloading spec) or kvfsm's ``KvfsmConnector`` in the scheduler role, and steps it the way vLLM's engine
core does. The W workers are represented by what crosses back to the scheduler, in each connector's own
format: every job handed out in a step's metadata completes on each rank after a seeded delay (at once if the
step flushes it), reported as vLLM's ``OffloadingWorkerMetadata`` counts or as kvfsm's per-rank
``RankReport``; a finished load's request also goes to ``finished_recving``, through vLLM's own
``KVOutputAggregator``. The recorder (:mod:`kvfsm.vllm.recorder`) and the side-by-side scheduler benchmark
(:mod:`kvfsm.bench.vllm_scheduler`) run on it.

The model is a directory holding only facebook/opt-125m's ``config.json`` (:func:`opt_config_dir`).
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "SchedulerDriver",
    "WorkloadSpec",
    "import_scheduler",
    "make_request",
    "model_runner_output",
    "opt_config_dir",
    "scheduler_config",
    "single_worker_offloading_config",
]


def model_runner_output(req_ids: list[str], **fields: Any) -> Any:
    """vLLM's ``ModelRunnerOutput`` for ``req_ids``, with ``req_id_to_index`` where this vLLM has the field
    (0.32, 0.33; 0.34 dropped it)."""
    import dataclasses

    from vllm.v1.outputs import ModelRunnerOutput

    names = {f.name for f in dataclasses.fields(ModelRunnerOutput)}
    if "req_id_to_index" in names:
        fields["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
    return ModelRunnerOutput(req_ids=req_ids, **fields)


def import_scheduler() -> None:
    """Import vLLM's ``Scheduler`` module, raising ImportError where vLLM (the real package) is missing.

    A bare ``import vllm`` is not enough of a probe: with kvfsm's ``tests/`` on ``sys.path`` its ``tests/vllm``
    folder imports as a namespace package named ``vllm``.
    """
    import vllm.v1.core.sched.scheduler  # noqa: F401


_OPT_125M = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "hidden_size": 768,
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "ffn_dim": 3072,
    "max_position_embeddings": 2048,
    "vocab_size": 50272,
    "torch_dtype": "float16",
    "word_embed_proj_dim": 768,
    "do_layer_norm_before": True,
    "pad_token_id": 1,
    "bos_token_id": 2,
    "eos_token_id": 2,
}


def single_worker_offloading_config(
    extra_config: dict[str, Any],
    *,
    bytes_per_block: int,
    layer_names: Sequence[str] = ("layer",),
    blocks_per_chunk: int = 1,
    events: bool = False,
    engine_id: str = "kvfsm-test",
    model_name: str = "test-model",
) -> Any:
    """vLLM's normalized ``OffloadingConfig`` (what its spec factory builds a spec from) for one worker, one
    KV-cache group of ``layer_names`` with 16 tokens a block, ``bytes_per_block`` KV bytes per block, and
    ``extra_config`` as ``kv_connector_extra_config``: a spec built with no engine around it."""
    import dataclasses

    import vllm.v1.kv_offload.config as offload_config

    # vLLM 0.33 added max_model_len (the config-info metric's token count); 0.32 has no such field.
    model_fields = {f.name for f in dataclasses.fields(offload_config.OffloadingModelConfig)}
    model_extra = {"max_model_len": 4096} if "max_model_len" in model_fields else {}
    return offload_config.OffloadingConfig(
        groups=(offload_config.OffloadingGroupConfig(16, tuple(layer_names), 0),),
        worker_kv_bytes_per_block=bytes_per_block,
        enable_kv_cache_events=events,
        extra_config=extra_config,
        engine_id=engine_id,
        model=offload_config.OffloadingModelConfig(name=model_name, dtype="float16", **model_extra),
        cache=offload_config.OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=blocks_per_chunk),
        parallel=offload_config.OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )


def opt_config_dir(root: Path) -> Path:
    """A model directory with only facebook/opt-125m's config.json (no weights, no tokenizer)."""
    model = root / "opt-125m-config-only"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(_OPT_125M))
    return model


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """A seeded prefix-reuse workload: requests share one of ``num_prefixes`` prompts' heads."""

    num_requests: int = 200
    num_prefixes: int = 8
    prefix_tokens: int = 96
    suffix_tokens: tuple[int, int] = (1, 40)
    max_tokens: tuple[int, int] = (1, 24)
    arrivals_per_step: float = 0.7
    abort_rate: float = 0.03
    #: Chance per step of dropping vLLM's GPU prefix cache, so prefixes come back from the CPU tier.
    gpu_cache_reset_rate: float = 0.05
    #: Chance per step of vLLM's reset_connector_cache (only between steps, as vLLM does).
    connector_reset_rate: float = 0.0
    max_report_delay: int = 3
    #: After every ``wave`` requests, no arrival until the engine has gone idle (0: never), so the
    #: workload drains, goes idle and is admitted again many times.
    wave: int = 0
    seed: int = 0


@dataclass
class _Pending:
    job_id: int
    req_id: str
    is_load: bool
    due: list[int]  # per rank: the step at which that rank reports


def scheduler_config(
    model_dir: Path,
    *,
    connector: str,
    module: str | None,
    extra: dict[str, Any],
    block_size: int,
    world_size: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    kv_events: bool = False,
) -> Any:
    """vLLM's ``VllmConfig`` of a scheduler-only run (no weights, no tokenizer, prefix caching and chunked
    prefill on) with ``connector`` (from ``module``, None for vLLM's own) in the ``kv_both`` role."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVEventsConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.config.parallel import ParallelConfig

    return VllmConfig(
        model_config=ModelConfig(model=str(model_dir), dtype="float16", seed=42, skip_tokenizer_init=True),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=block_size, gpu_memory_utilization=0.9, enable_prefix_caching=True),
        parallel_config=ParallelConfig(tensor_parallel_size=world_size),
        kv_transfer_config=KVTransferConfig(
            kv_connector=connector, kv_connector_module_path=module, kv_role="kv_both", kv_connector_extra_config=extra
        ),
        device_config=DeviceConfig("cpu"),
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null") if kv_events else None,
    )


def make_request(req_id: str, prompt: Sequence[int], max_tokens: int, block_size: int) -> Any:
    """A vLLM ``Request`` that generates exactly ``max_tokens`` tokens, with its block hasher."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    params.update_from_generation_config({}, 2)
    return Request(
        request_id=req_id,
        prompt_token_ids=list(prompt),
        sampling_params=params,
        pooling_params=None,
        mm_features=None,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )


@dataclass
class SchedulerDriver:
    """vLLM's Scheduler with a connector in the scheduler role, and its workers' reports (module docs)."""

    model_dir: Path
    connector: str = "native"  # "native" (vLLM's OffloadingConnector) or "kvfsm" (KvfsmConnector)
    num_gpu_blocks: int = 256
    cpu_chunks: int = 128
    world_size: int = 1
    block_size: int = 16
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    seed: int = 0
    max_report_delay: int = 3
    #: Steps before a rank reports a job it was handed, at least (a flush reports at once regardless).
    min_report_delay: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import torch
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        init_none_hash(sha256)
        self.rng = random.Random(self.seed)
        spec = FullAttentionSpec(block_size=self.block_size, num_kv_heads=1, head_size=64, dtype=torch.float16)
        self.kv_cache_config = KVCacheConfig(
            num_blocks=self.num_gpu_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
        )
        self.vllm_config = self._config(spec.page_size_bytes)
        self.vllm_config.cache_config.num_gpu_blocks = self.num_gpu_blocks
        self.scheduler = Scheduler(
            vllm_config=self.vllm_config,
            kv_cache_config=self.kv_cache_config,
            log_stats=False,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=self.block_size,
        )
        self.aggregator = KVOutputAggregator(self.world_size)
        self.requests: dict[str, Any] = {}
        self.pending: dict[int, _Pending] = {}
        self.step_index = 0
        self._counter = 0

    def _config(self, page_bytes: int) -> Any:
        if self.connector == "native":
            # vLLM's CPU spec sizes its tier in bytes: one chunk (one block) is the page, aligned.
            extra = {"cpu_bytes_to_use": self.cpu_chunks * max(page_bytes * self.world_size, 4096), **self.extra}
            name, module = "OffloadingConnector", None
        elif self.connector == "kvfsm":
            extra = {"num_slots": self.cpu_chunks, **self.extra}
            name, module = "KvfsmConnector", "kvfsm.vllm"
        else:
            raise ValueError(f"connector={self.connector!r}; expected 'native' or 'kvfsm'")
        return scheduler_config(
            self.model_dir,
            connector=name,
            module=module,
            extra=extra,
            block_size=self.block_size,
            world_size=self.world_size,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=8192,
        )

    @property
    def connector_scheduler(self) -> Any:
        """The connector's scheduler half (vLLM's OffloadingConnectorScheduler or kvfsm's OffloadingScheduler)."""
        conn = self.scheduler.connector
        return conn.connector_scheduler if self.connector == "native" else conn.scheduler

    # ------------------------------------------------------------------ requests

    def add(self, prompt: Sequence[int], max_tokens: int, req_id: str | None = None) -> Any:
        self._counter += 1
        req = make_request(req_id or f"r{self._counter}", prompt, max_tokens, self.block_size)
        self.scheduler.add_request(req)
        self.requests[req.request_id] = req
        return req

    def abort(self, req_id: str) -> None:
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)

    # ------------------------------------------------------------------ the engine step

    def has_work(self) -> bool:
        return bool(self.scheduler.has_requests())

    def schedule(self) -> Any:
        return self.scheduler.schedule()

    def finish_step(self, out: Any) -> None:
        """What the workers and the model return for ``out``, handed to ``update_from_output``."""
        from vllm.v1.outputs import KVConnectorOutput

        self._take_jobs(out.kv_connector_metadata)
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            req = self.requests[rid]
            sampled.append([] if req.num_computed_tokens < req.num_tokens else [100 + req.num_computed_tokens % 900])
        outputs = []
        for rank in range(self.world_size):
            done = [p for p in self.pending.values() if p.due[rank] == self.step_index]
            outputs.append(
                model_runner_output(
                    req_ids,
                    sampled_token_ids=sampled,
                    kv_connector_output=KVConnectorOutput(
                        finished_recving={p.req_id for p in done if p.is_load},
                        kv_connector_worker_meta=self._worker_meta(rank, [p.job_id for p in done]),
                    ),
                )
            )
        for job_id in [j for j, p in self.pending.items() if max(p.due) <= self.step_index]:
            del self.pending[job_id]
        merged = self.aggregator.aggregate(outputs)
        self.scheduler.update_from_output(out, merged)
        self.step_index += 1

    def step(self) -> Any:
        out = self.schedule()
        self.finish_step(out)
        return out

    def _take_jobs(self, meta: Any) -> None:
        if self.connector == "native":
            loads = {j: t.req_id for j, t in meta.load_jobs.items()}
            stores = {j: t.req_id for j, t in meta.store_jobs.items()}
            flush = set(meta.jobs_to_flush or ())
        else:
            msg = meta.message
            loads = {j.job_id: j.req_id for j in msg.load_jobs}
            stores = {j.job_id: j.req_id for j in msg.store_jobs}
            flush = set(msg.jobs_to_flush)
        for jobs, is_load in ((loads, True), (stores, False)):
            for job_id, req_id in jobs.items():
                due = [
                    self.step_index
                    + self.rng.randint(self.min_report_delay, max(self.min_report_delay, self.max_report_delay))
                    for _ in range(self.world_size)
                ]
                self.pending[job_id] = _Pending(job_id, req_id, is_load, due)
        for job_id in flush:  # the workers wait for a flushed job before this step's forward
            p = self.pending.get(job_id)
            if p is not None:
                p.due = [min(d, self.step_index) for d in p.due]

    def _worker_meta(self, rank: int, job_ids: list[int]) -> Any:
        if not job_ids:
            return None
        if self.connector == "native":
            from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata

            return OffloadingWorkerMetadata(completed_jobs=dict.fromkeys(job_ids, 1))
        from kvfsm.control.messages import RankReport
        from kvfsm.vllm.connector import KvfsmWorkerMetadata

        return KvfsmWorkerMetadata((RankReport(rank, tuple(job_ids)),))

    # ------------------------------------------------------------------ a seeded workload

    def run_workload(self, spec: WorkloadSpec, on_step: Any = None, max_steps: int = 100_000) -> int:
        """Run ``spec`` to the end (every request finished, the engine idle); returns the steps taken.
        ``on_step(driver)`` is called at the top of every engine-loop iteration."""
        rng = random.Random(spec.seed)
        prefixes = [[rng.randrange(3, 50_000) for _ in range(spec.prefix_tokens)] for _ in range(spec.num_prefixes)]
        added = 0
        steps = 0
        while added < spec.num_requests or self.has_work():
            if on_step is not None:
                on_step(self)
            waiting = spec.wave and added % spec.wave == 0 and added and self.has_work()
            while not waiting and added < spec.num_requests and rng.random() < spec.arrivals_per_step:
                head = prefixes[rng.randrange(spec.num_prefixes)]
                tail = [rng.randrange(3, 50_000) for _ in range(rng.randint(*spec.suffix_tokens))]
                self.add(head + tail, rng.randint(*spec.max_tokens))
                added += 1
                if spec.wave and added % spec.wave == 0:
                    break
            live = [r for r in self.requests.values() if not r.is_finished()]
            if live and rng.random() < spec.abort_rate:
                self.abort(rng.choice(live).request_id)
            if rng.random() < spec.gpu_cache_reset_rate:
                self.scheduler.reset_prefix_cache()
            if spec.connector_reset_rate and rng.random() < spec.connector_reset_rate:
                self.scheduler.reset_connector_cache()
            if not self.has_work():
                continue
            self.step()
            steps += 1
            if steps >= max_steps:
                raise RuntimeError(f"the workload did not finish in {max_steps} steps")
        return steps
