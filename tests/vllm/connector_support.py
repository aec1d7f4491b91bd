"""A rig for KvfsmConnector inside vLLM's real ``Scheduler`` (no model, no GPU needed).

vLLM's scheduler runs as it does in the engine core, with KvfsmConnector in the scheduler role. The worker
role is W real KvfsmConnector instances over CPU (or CUDA) tensors shaped like vLLM's KV caches, driven the
way vLLM's model runner drives a connector each step (``handle_preemptions`` before the forward,
``wait_for_save`` / ``get_finished`` / ``build_connector_worker_meta`` after it), their outputs merged by
vLLM's own ``KVOutputAggregator``. The "forward" writes, for every scheduled token, a value that depends only
on the token's prefix; so the ground truth is in the data plane: before each forward every request's already
computed positions must hold exactly the values of its prefix, whether they came from vLLM's prefix cache,
a kvfsm load, or an earlier forward.

The model is a directory holding only an OPT ``config.json`` (written at test time,
:func:`kvfsm.vllm.drive.opt_config_dir`): vLLM's scheduler never needs weights or a tokenizer.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from typing_extensions import override

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvfsm.control.types import GPUBlockSpec, SlotSpec
from kvfsm.control.worker import CopyBackend
from kvfsm.data.backend import ThreadPoolCopyBackend
from kvfsm.data.gate import CopyGate
from kvfsm.data.pool import CPUSlotPool
from kvfsm.vllm.connector import KvfsmConnector
from kvfsm.vllm.drive import make_request, model_runner_output, opt_config_dir, scheduler_config

__all__ = ["BLOCK_SIZE", "Rig", "StepRecord", "opt_config_dir"]

BLOCK_SIZE = 16
NUM_LAYERS = 2
HEADS = 2
HEAD_DIM = 4


def token_value(prefix: Sequence[int], rank: int) -> float:
    """The stand-in forward's KV value for the last token of ``prefix`` on worker ``rank`` (exact in fp32)."""
    digest = hashlib.blake2b(repr(list(prefix)).encode(), digest_size=4).digest()
    return float(int.from_bytes(digest, "big") % (1 << 20)) + rank / 4


class GatedBackend(ThreadPoolCopyBackend):
    """kvfsm's thread-pool backend with a :class:`CopyGate`: each copy stays on its copy thread until the test
    releases it. A flush's blocking ``wait`` releases the copies it names first (a flush means "finish these
    now"), and every copy and wait is written to the shared ``log`` so a test can see what ran before what."""

    def __init__(
        self, layers: list[torch.Tensor], pool: CPUSlotPool, bpc: int, log: list[tuple[str, int, int]], rank: int
    ):
        self.copy_gate = CopyGate()
        super().__init__(layers, pool, bpc, max_workers=16, gate=self.copy_gate)
        self.log = log
        self.rank = rank
        self.submitted: list[int] = []

    @override
    def submit(self, job_id: int, is_store: bool, gpu: GPUBlockSpec, slots: SlotSpec) -> Future[None]:
        self.submitted.append(job_id)
        self.log.append(("store" if is_store else "load", self.rank, job_id))
        return super().submit(job_id, is_store, gpu, slots)

    @override
    def wait(self, job_ids: Iterable[int]) -> None:
        ids = list(job_ids)
        for job_id in ids:
            self.log.append(("flush", self.rank, job_id))
            self.copy_gate.release(job_id)
        super().wait(ids)

    def finish(self, job_id: int, ok: bool = True) -> None:
        """Release one held copy and wait until it has finished (its report comes with the next step)."""
        self.copy_gate.release(job_id, ok=ok)
        super().wait([job_id])


@dataclass
class StepRecord:
    """What one engine step did, as the tests need it."""

    scheduled: dict[str, int]
    new_req_ids: list[str]
    finished_recving: set[str]
    pending_push_work_before: bool
    output: SchedulerOutput


@dataclass
class Rig:
    """vLLM's Scheduler with KvfsmConnector, W kvfsm workers over CPU tensors and a stand-in forward."""

    model_dir: Path
    num_slots: int = 64
    num_gpu_blocks: int = 64
    world_size: int = 1
    max_num_batched_tokens: int = 64
    extra: dict[str, Any] = field(default_factory=dict)
    #: Where the KV caches live (``KVFSM_VLLM_DEVICE`` sets the default: scripts/gpu_check.sh runs the suite
    #: with ``cuda``).
    device: str = field(default_factory=lambda: os.environ.get("KVFSM_VLLM_DEVICE", "cpu"))
    #: Hold every copy at a CopyGate until the test releases it (else copies run freely).
    gated: bool = True
    #: vLLM's ``kv_events_config.enable_kv_cache_events`` (null publisher: tests record what is published).
    kv_events: bool = False

    def __post_init__(self) -> None:
        #: ("store" | "load" | "flush", rank, job id) and ("forward", -1, step), in the order they happened.
        self.log: list[tuple[str, int, int]] = []
        self.backends: list[GatedBackend] = []
        init_none_hash(sha256)
        self.vllm_config = self._config()
        spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float32)
        self.kv_cache_config = KVCacheConfig(
            num_blocks=self.num_gpu_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec([f"layer.{i}" for i in range(NUM_LAYERS)], spec)],
        )
        self.vllm_config.cache_config.num_gpu_blocks = self.num_gpu_blocks
        self.scheduler = Scheduler(
            vllm_config=self.vllm_config,
            kv_cache_config=self.kv_cache_config,
            log_stats=True,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=BLOCK_SIZE,
        )
        connector = self.scheduler.connector
        assert isinstance(connector, KvfsmConnector)
        self.connector = connector
        self.kv: list[dict[str, torch.Tensor]] = []
        self.workers: list[KvfsmConnector] = []
        heads = HEADS // self.world_size
        for rank in range(self.world_size):
            worker = KvfsmConnector(self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config)
            worker.bind_rank(rank)
            if self.gated:
                worker.backend_factory = self._gated_factory(rank)
            caches = {
                f"layer.{i}": torch.zeros(
                    (2, self.num_gpu_blocks, BLOCK_SIZE, heads, HEAD_DIM), dtype=torch.float32, device=self.device
                )
                for i in range(NUM_LAYERS)
            }
            worker.register_kv_caches(caches)
            self.workers.append(worker)
            self.kv.append(caches)
        self.aggregator = KVOutputAggregator(self.world_size)
        self.requests: dict[str, Request] = {}
        self.steps: list[StepRecord] = []
        self.mismatches: list[str] = []
        self._counter = 0

    def _gated_factory(self, rank: int) -> Any:
        def build(layers: list[torch.Tensor], pool: CPUSlotPool, bpc: int, threads: int) -> CopyBackend:
            backend = GatedBackend(layers, pool, bpc, self.log, rank)
            self.backends.append(backend)
            return backend

        return build

    def release(self, job_id: int, ok: bool = True, ranks: Sequence[int] | None = None) -> None:
        """Let job ``job_id``'s copy finish on the given ranks (all by default); reported at the next step."""
        for rank in range(self.world_size) if ranks is None else ranks:
            self.backends[rank].finish(job_id, ok=ok)

    def held(self, rank: int = 0) -> list[int]:
        """Jobs submitted on ``rank`` whose copy has not finished."""
        return self.backends[rank].unfinished_job_ids()

    def _config(self) -> VllmConfig:
        config: VllmConfig = scheduler_config(
            self.model_dir,
            connector="KvfsmConnector",
            module="kvfsm.vllm",
            extra={"num_slots": self.num_slots, **self.extra},
            block_size=BLOCK_SIZE,
            world_size=self.world_size,
            max_num_seqs=16,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=4096,
            kv_events=self.kv_events,
        )
        return config

    # ------------------------------------------------------------------ requests

    def add(self, prompt: Sequence[int], max_tokens: int = 4, req_id: str | None = None) -> Request:
        self._counter += 1
        req: Request = make_request(req_id or f"r{self._counter}", prompt, max_tokens, BLOCK_SIZE)
        self.scheduler.add_request(req)
        self.requests[req.request_id] = req
        return req

    def abort(self, req_id: str) -> None:
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)

    # ------------------------------------------------------------------ the engine step

    def has_work(self) -> bool:
        """EngineCore.step's test: it steps while the scheduler has requests or the connector pending work."""
        return bool(self.scheduler.has_requests())

    def step(self) -> StepRecord:
        pending = self.connector.has_pending_push_work()
        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        assert meta is not None
        for worker in self.workers:
            worker.bind_connector_metadata(meta)
            worker.handle_preemptions(meta)
            worker.start_load_kv(None)
        self._check_context(out)
        self.log.append(("forward", -1, len(self.steps)))
        self._forward(out)
        outputs: list[ModelRunnerOutput] = []
        req_ids = list(out.num_scheduled_tokens)
        sampled = [self._sample(rid, out) for rid in req_ids]
        for worker in self.workers:
            worker.wait_for_save()
            sending, recving = worker.get_finished(out.finished_req_ids)
            invalid = worker.get_block_ids_with_load_errors()
            wmeta = worker.build_connector_worker_meta()
            worker.clear_connector_metadata()
            outputs.append(
                model_runner_output(
                    req_ids,
                    sampled_token_ids=sampled,
                    kv_connector_output=KVConnectorOutput(
                        finished_sending=sending,
                        finished_recving=recving,
                        invalid_block_ids=invalid,
                        kv_connector_worker_meta=wmeta,
                    ),
                )
            )
        merged = self.aggregator.aggregate(outputs)
        recving = set(merged.kv_connector_output.finished_recving or ()) if merged.kv_connector_output else set()
        self.scheduler.update_from_output(out, merged)
        record = StepRecord(
            dict(out.num_scheduled_tokens), [r.req_id for r in out.scheduled_new_reqs], recving, pending, out
        )
        self.steps.append(record)
        return record

    def run_until_idle(self, max_steps: int = 500) -> int:
        """Step while vLLM's engine loop would (has_requests, which asks has_pending_push_work); the steps."""
        n = 0
        while self.has_work():
            self.step()
            n += 1
            if n >= max_steps:
                raise AssertionError(f"engine still busy after {max_steps} steps")
        return n

    def wait_copies(self) -> None:
        """Block until every worker's launched copies finished (their reports still come from the next step)."""
        for worker in self.workers:
            assert worker.worker is not None
            worker.worker.worker.wait_all()

    # ------------------------------------------------------------------ stand-in model

    def _blocks(self, req_id: str) -> list[int]:
        blocks = self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
        return list(blocks)

    def _tokens(self, req_id: str) -> list[int]:
        return list(self.requests[req_id].all_token_ids)

    def _forward(self, out: SchedulerOutput) -> None:
        for req_id, n in out.num_scheduled_tokens.items():
            req = self.requests[req_id]
            start = req.num_computed_tokens - n  # schedule() already advanced it
            tokens = self._tokens(req_id)
            blocks = self._blocks(req_id)
            for pos in range(start, min(start + n, len(tokens))):
                for rank, caches in enumerate(self.kv):
                    value = token_value(tokens[: pos + 1], rank)
                    for t in caches.values():
                        t[:, blocks[pos // BLOCK_SIZE], pos % BLOCK_SIZE].fill_(value)

    def _check_context(self, out: SchedulerOutput) -> None:
        """Every scheduled request's computed positions hold the values of its prefix (the ground truth)."""
        for req_id, n in out.num_scheduled_tokens.items():
            req = self.requests[req_id]
            tokens = self._tokens(req_id)
            blocks = self._blocks(req_id)
            for pos in range(req.num_computed_tokens - n):  # schedule() already advanced it
                for rank, caches in enumerate(self.kv):
                    want = token_value(tokens[: pos + 1], rank)
                    for name, t in caches.items():
                        got = t[:, blocks[pos // BLOCK_SIZE], pos % BLOCK_SIZE]
                        if not bool((got == want).all()):
                            self.mismatches.append(
                                f"step {len(self.steps)}: {req_id} pos {pos} rank {rank} {name}: "
                                f"{got.flatten()[0].item()} != {want}"
                            )
                            return

    def _sample(self, req_id: str, out: SchedulerOutput) -> list[int]:
        req = self.requests[req_id]
        done = req.num_computed_tokens  # schedule() already advanced it
        if done < req.num_tokens:
            return []  # a chunk of the prompt: nothing sampled
        return [100 + (done * 7) % 900]

    def shutdown(self) -> None:
        for backend in self.backends:
            backend.copy_gate.open()
        self.connector.shutdown()
        for worker in self.workers:
            worker.shutdown()
