"""The engine: admit requests, step the scheduler, run the model, sample, emit outputs.

Roles come from composition: a colocated engine has both managers and hands a request whose
prefill is done straight to its decode batch.  `export_request` / `import_request` move a request
with its StatePages between engines (what the disaggregated workers build on).  The decode side of
a transfer reserves first (`reserve`: slot + KV blocks, before any page arrives, so it never
over-commits), then `import_reserved` writes the pages into exactly that place, or
`cancel_reservation` gives it back (expiry, failed transfer, abort).  In the prefill role
(`stream_prefills_to`) a request whose prefill finishes leaves through a LayerExporter instead:
its pages go to a sink layer by layer during the step's forward, then its state with the first
token, and its slot is freed.

On CUDA the engine sizes its pools from `gpu_memory_utilization` after loading the weights and
profiling a step (memory_plan.py), and captures CUDA graphs for decode-only steps unless
`enforce_eager` (cuda_graphs.py); on the CPU the pools keep CacheConfig's sizes and every step
runs eagerly.

With async scheduling (on by default on CUDA, inflight.py) a decode-only step is launched before
the previous step's tokens are read, and `step()` returns the outputs of the steps it read: in a
steady decode batch, those of the step before the one it launched.  `has_unfinished()` stays True
until every launched step has been read.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from pd_ssm.cache.manager import CacheManager
from pd_ssm.cache.pages import RequestState, StatePages, export_pages, import_pages
from pd_ssm.cache.pool import CachePool
from pd_ssm.config import EngineConfig, ModelConfig
from pd_ssm.engine.cuda_graphs import DecodeGraphs, capture_sizes, check_capturable, table_width
from pd_ssm.engine.decode_manager import DecodeManager
from pd_ssm.engine.device_sample import SamplerOutput
from pd_ssm.engine.inflight import InflightStep, launch_ahead_ok
from pd_ssm.engine.layer_export import LayerExporter, PageSink
from pd_ssm.engine.memory_plan import (
    CachePlan,
    MemorySnapshot,
    kv_block_bytes,
    plan_pools,
    profile_memory,
    state_slot_bytes,
)
from pd_ssm.engine.output_processor import OutputProcessor
from pd_ssm.engine.prefill_graphs import PrefillGraphs, prefill_buckets
from pd_ssm.engine.prefill_manager import PrefillManager
from pd_ssm.engine.request import Request, Status
from pd_ssm.engine.runner import ModelRunner
from pd_ssm.engine.sampler import make_seed
from pd_ssm.engine.scheduler import Scheduler
from pd_ssm.engine.tokenizer import Tokenizer, load_tokenizer
from pd_ssm.kernels.dispatch import get_kernels
from pd_ssm.models.loader import load_model
from pd_ssm.outputs import RequestOutput
from pd_ssm.sampling_params import SamplingParams

log = logging.getLogger(__name__)

# Pure SSM models have no positional limit; this bounds max_tokens=None all the same.
_UNBOUNDED_LEN = 1 << 20


class RequestError(ValueError):
    """A request the engine refuses (bad prompt, too long, ...); nothing was allocated for it."""


class Reservation(NamedTuple):
    """Where a reserved request's pages go: its state slot and KV block ids (in order)."""

    slot: int
    block_ids: list[int]


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.model_config = ModelConfig.from_pretrained(config.model)
        mc = self.model_config
        self.dtype = config.resolve_dtype(mc)
        self.kernels = get_kernels(config.kernel_backend, self.device)  # type: ignore[arg-type]
        use_graphs = config.use_cuda_graphs
        if use_graphs:
            check_capturable(self.kernels, mc)
        start = MemorySnapshot.take(self.device) if self.device.type == "cuda" else None
        self.model = load_model(
            config.model,
            device=self.device,
            dtype=self.dtype,
            kernels=self.kernels,
            load_format=config.load_format,
            seed=config.seed,
        )
        uses_kv = bool(mc.attention_layer_ids)
        declared = config.scheduler.max_model_len or mc.max_position_embeddings or _UNBOUNDED_LEN
        graph_sizes = capture_sizes(config.scheduler.max_num_seqs) if use_graphs else []
        # NOTE: prefill graphs need kernels that never read device values on the host (Triton's)
        prefill_shapes = (
            prefill_buckets(config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs)
            if use_graphs and config.prefill_cuda_graphs and self.kernels.backend == "triton" else None
        )
        cc = config.cache
        self.memory_plan: CachePlan | None = None
        if start is not None:  # CUDA: the pools take what gpu_memory_utilization leaves
            self.memory_plan = self._plan_pools(start, declared, graph_sizes, prefill_shapes is not None)
            log.info(self.memory_plan.describe())
            cc = dataclasses.replace(
                cc, num_state_slots=self.memory_plan.num_state_slots, num_kv_blocks=self.memory_plan.num_kv_blocks
            )
        # NOTE: with CUDA graphs the pool has one slot past the manager's: the scratch slot that
        # padded graph rows write into, never handed out
        scratch = 1 if use_graphs else 0
        self.pool = CachePool(
            mc, dataclasses.replace(cc, num_state_slots=cc.num_state_slots + scratch), self.device, self.dtype
        )
        self.cache = CacheManager(cc.num_state_slots, cc.num_kv_blocks, cc.block_size, uses_kv)
        kv_tokens = cc.num_kv_blocks * cc.block_size if uses_kv else declared
        self.max_model_len = min(declared, kv_tokens)
        self.scheduler = Scheduler(
            config.scheduler,
            self.cache,
            PrefillManager(self.cache, config.scheduler.enable_chunked_prefill),
            DecodeManager(self.cache),
        )
        self.runner = ModelRunner(self.model, self.pool, self.cache, self.device)
        if use_graphs:
            self.runner.graphs = DecodeGraphs(
                self.model, self.pool, sizes=graph_sizes, scratch_slot=cc.num_state_slots,
                width=table_width(self.max_model_len, cc.block_size, uses_kv),
            )
            log.info("captured %d decode CUDA graphs (batch %s) in %.1f s", len(graph_sizes), graph_sizes,
                     self.runner.graphs.capture_seconds)
        if prefill_shapes is not None:
            self.runner.prefill_graphs = PrefillGraphs(
                self.model, self.pool, buckets=prefill_shapes,
                scratch_slot=cc.num_state_slots, width=table_width(self.max_model_len, cc.block_size, uses_kv),
            )
            log.info("captured %d prefill CUDA graphs (tokens, sequences: %s) in %.1f s", len(prefill_shapes),
                     prefill_shapes, self.runner.prefill_graphs.capture_seconds)
        self.tokenizer: Tokenizer = load_tokenizer(
            Path(config.model), vocab_size=mc.vocab_size, eos_token_ids=mc.eos_token_ids, bos_token_id=mc.bos_token_id
        )
        self.outputs = OutputProcessor(self.tokenizer, mc.eos_token_ids, self.max_model_len)
        self.requests: dict[str, Request] = {}
        # NOTE: request id -> tokens reserved for it; these hold cache but are not in `requests`
        # (nor in the scheduler) until `import_reserved`
        self.reserved: dict[str, int] = {}
        self._ids = itertools.count()
        # prefill role (stream_prefills_to): finished prefills leave through it, not to a decode batch
        self.exporter: LayerExporter | None = None
        self.async_scheduling = config.use_async_scheduling
        self._inflight: InflightStep | None = None  # launched, its tokens not read yet
        # outputs of a step read outside step() (export_request), handed out by the next step()
        self._undelivered: list[RequestOutput] = []

    def _plan_pools(
        self, start: MemorySnapshot, declared_len: int, graph_sizes: list[int], prefill_graphs: bool
    ) -> CachePlan:
        """Profile the steps this engine will run, then size the pools from what is left."""
        mc, cc, sc = self.model_config, self.config.cache, self.config.scheduler
        uses_kv = bool(mc.attention_layer_ids)
        profile = profile_memory(
            self.model, cc, self.dtype, start,
            num_tokens=min(sc.max_num_batched_tokens, declared_len),
            num_sampled_rows=sc.max_num_seqs,
            graph_size=graph_sizes[-1] if graph_sizes else 0,
            graph_width=table_width(declared_len, cc.block_size, uses_kv),
            prefill_graphs=prefill_graphs,
        )
        return plan_pools(
            profile,
            utilization=self.config.gpu_memory_utilization,
            num_slots=sc.max_num_seqs,
            num_scratch=1 if graph_sizes else 0,
            slot_bytes=state_slot_bytes(mc, cc, self.dtype),
            block_bytes=kv_block_bytes(mc, cc, self.dtype),
            uses_kv=uses_kv,
            max_useful_blocks=sc.max_num_seqs * -(-declared_len // cc.block_size),
        )

    # --- requests ------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> Request:
        params = params or SamplingParams()
        req_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        self._check_free_id(req_id)
        if isinstance(prompt, str):
            text: str | None = prompt
            ids = self.tokenizer.encode(prompt)
        else:
            text, ids = None, [int(t) for t in prompt]
        self._validate_prompt(ids)
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        seed = params.seed if params.seed is not None else make_seed()
        req = Request(req_id, ids, params, seed=seed, max_tokens=max_tokens, prompt=text)
        self.requests[req_id] = req
        self.scheduler.add(req)
        return req

    def _check_free_id(self, req_id: str) -> None:
        # NOTE: a request finished or aborted while a step in flight still writes its slot holds
        # that slot under its id until the step is read (async scheduling): the id is not free yet
        if req_id in self.requests or req_id in self.reserved or self.cache.holds(req_id):
            raise RequestError(f"request id {req_id!r} is already in use")

    def _validate_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise RequestError("prompt is empty: give at least one token")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise RequestError(
                f"prompt has {len(ids)} tokens; the maximum model length is {self.max_model_len} "
                f"(prompt + at least one generated token)"
            )

    def abort(self, req_id: str) -> RequestOutput | None:
        req = self.requests.pop(req_id, None)
        if req is None:
            return None
        if self.exporter is not None:
            self.exporter.cancel(req_id)  # a ticket may wait for it in the sink
        req.finish("abort")
        if not req.num_inflight:
            self.scheduler.release(req)
        # else: the step in flight still writes its slot; it is released when that step is read
        self.outputs.forget(req_id)
        return self.outputs.output(req, [], "")

    @property
    def in_flight(self) -> list[Request]:
        """Requests of the step launched and not read yet (async scheduling); some may be finished
        already: they hold their cache until that step is read."""
        return list(self._inflight.reqs) if self._inflight is not None else []

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None or bool(self._undelivered)

    # --- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        results, self._undelivered = self._undelivered, []
        if self._inflight is not None and not launch_ahead_ok(self.scheduler, self.cache, self.max_model_len):
            results += self._read_inflight()
        sched = self.scheduler.schedule()
        for req in sched.preempted:
            if req.finished:  # a decode-only engine had to drop it
                self.requests.pop(req.req_id, None)
                results.append(self.outputs.output(req, [], ""))
            else:
                log.debug("preempted %s (recompute #%d)", req.req_id, req.num_preemptions)
        if sched.empty:
            if self._inflight is not None:
                results += self._read_inflight()
            return results
        launched = self.runner.launch(sched, self._inflight)
        for seq in sched.seqs:
            seq.request.num_computed_tokens += seq.num_new_tokens
        if self.async_scheduling and self.exporter is None and not sched.prefills and launched.sample is not None:
            for req in launched.reqs:
                req.num_inflight += 1
            older, self._inflight = self._inflight, InflightStep(launched.reqs, launched.sample)
            if older is not None:  # read while the step just launched runs
                results += self._read(older)
            return results
        # NOTE: a step with prefill chunks is scheduled only after the step in flight was read
        assert self._inflight is None, "a synchronous step was launched behind a step in flight"
        sampled = launched.sample.host() if launched.sample is not None else SamplerOutput([], [])
        return results + self._apply(launched.reqs, sampled)

    def _apply(self, reqs: list[Request], sampled: SamplerOutput) -> list[RequestOutput]:
        """Outputs of a step read as soon as it ran (prefill chunks, or async scheduling off)."""
        results: list[RequestOutput] = []
        prefilling = self.scheduler.prefill.prefilling if self.scheduler.prefill else []
        for req, token, logprobs in zip(reqs, sampled.token_ids, sampled.logprobs, strict=True):
            was_prefill = req in prefilling
            new_text = self.outputs.append(req, token, logprobs)
            if req.finished:
                if was_prefill and self.exporter is not None:
                    self.exporter.cancel(req.req_id)  # done at its first token: nothing to decode
                self.scheduler.release(req)
                self.requests.pop(req.req_id, None)
            elif was_prefill:
                self.scheduler.finish_prefill(req)
                if self.exporter is not None:
                    results.append(self.outputs.output(req, [token], new_text))
                    self._ship(req)
                    continue
                self.scheduler.add_decoding(req)
            if req.finished or req.params.output_kind != "final_only":
                results.append(self.outputs.output(req, [token], new_text))
        return results

    def _read_inflight(self) -> list[RequestOutput]:
        step, self._inflight = self._inflight, None
        return self._read(step) if step is not None else []

    def _read(self, step: InflightStep) -> list[RequestOutput]:
        """Read a decode step launched ahead: its tokens join their requests (waits for them)."""
        sampled = step.sample.host()
        results: list[RequestOutput] = []
        for req, token, logprobs in zip(step.reqs, sampled.token_ids, sampled.logprobs, strict=True):
            req.num_inflight -= 1
            if req.finished:  # aborted, or finished by its previous token: this one is dropped
                if not req.num_inflight:
                    self.scheduler.release(req)
                continue
            new_text = self.outputs.append(req, token, logprobs)
            if req.finished:
                self.requests.pop(req.req_id, None)
                if not req.num_inflight:  # else a later step in flight still writes its slot
                    self.scheduler.release(req)
            if req.finished or req.params.output_kind != "final_only":
                results.append(self.outputs.output(req, [token], new_text))
        return results

    # --- moving a request between engines --------------------------------------------------
    def stream_prefills_to(self, sink: PageSink, per_layer: bool = True) -> LayerExporter:
        """Prefill role: a request whose prefill finishes ships its pages to `sink` -- layer by layer
        while the step's forward runs (layer_export.py), or whole after it (`per_layer=False`) --
        then its state with the first token; it then leaves this engine instead of joining a decode
        batch."""
        self.exporter = LayerExporter(self.pool, self.cache, sink, per_layer=per_layer)
        self.runner.layer_export = self.exporter
        return self.exporter

    def _ship(self, req: Request) -> None:
        assert self.exporter is not None
        self.exporter.finish(self._request_state(req))  # waits for the last layers' copies
        self.scheduler.release(req)
        self.requests.pop(req.req_id)
        self.outputs.forget(req.req_id)

    def _request_state(self, req: Request) -> RequestState:
        return RequestState(
            req_id=req.req_id,
            prompt_token_ids=list(req.prompt_token_ids),
            output_token_ids=list(req.output_token_ids),
            num_computed_tokens=req.num_computed_tokens,
            params=req.params.to_dict(),
            seed=req.seed,
            max_tokens=req.max_tokens,
            prompt=req.prompt,
        )

    def export_request(self, req_id: str) -> StatePages:
        """Snapshot a request's cache and bookkeeping, then release it here."""
        if self.requests[req_id].num_inflight:
            self._undelivered += self._read_inflight()
        req = self.requests.get(req_id)
        if req is None:  # it finished with the token just read
            raise RequestError(f"request {req_id!r} finished before it could be exported")
        if req.num_computed_tokens == 0 or not self.cache.holds(req_id):
            raise RequestError(f"request {req_id!r} holds no computed state to export yet")
        state = self._request_state(req)
        pages = export_pages(self.pool, state, self.cache.slot(req_id), self.cache.block_table(req_id))
        self.scheduler.release(req)
        self.requests.pop(req_id)
        self.outputs.forget(req_id)
        return pages

    def import_request(self, pages: StatePages) -> Request:
        """Install a request exported elsewhere; it joins this engine's decode batch."""
        st = pages.request
        self.reserve(st.req_id, len(st.prompt_token_ids) + len(st.output_token_ids))
        return self.import_reserved(pages)

    def reserve(self, req_id: str, num_tokens: int) -> Reservation:
        """Hold a state slot and the KV blocks for `num_tokens` tokens for a request whose pages
        have not arrived yet (the decode side's answer to the router's Reserve).

        Raises CacheFullError (nothing held) when the pools cannot take it: the caller refuses,
        never over-commits. The request does not run until `import_reserved`.
        """
        self._check_free_id(req_id)
        if not 0 < num_tokens <= self.max_model_len:
            raise RequestError(
                f"cannot reserve {num_tokens} tokens for {req_id!r}: give 1..{self.max_model_len} "
                f"(the maximum model length)"
            )
        slot = self.cache.allocate(req_id, num_tokens)
        self.reserved[req_id] = num_tokens
        return Reservation(slot, list(self.cache.block_table(req_id)))

    def import_reserved(self, pages: StatePages) -> Request:
        """Write pages into the slot / blocks `reserve` held for them; the request joins the decode
        batch. On any failure the reservation is freed and the error raised."""
        st = pages.request
        if st.req_id not in self.reserved:
            raise RequestError(f"request {st.req_id!r} holds no reservation here (never made, cancelled or used)")
        try:
            params = SamplingParams.from_dict(st.params)
            req = Request(st.req_id, list(st.prompt_token_ids), params, seed=st.seed, max_tokens=st.max_tokens,
                          prompt=st.prompt, output_token_ids=list(st.output_token_ids))
            req.num_computed_tokens = st.num_computed_tokens
            if req.num_pending_tokens != 1:
                raise RequestError(
                    f"request {st.req_id!r} has {req.num_pending_tokens} pending tokens; only requests "
                    f"ready to decode (prefill finished, one token pending) can be imported"
                )
            if req.num_tokens > self.reserved[st.req_id]:
                raise RequestError(
                    f"request {st.req_id!r} has {req.num_tokens} tokens but only "
                    f"{self.reserved[st.req_id]} were reserved: reserve prompt + 1 tokens"
                )
            import_pages(self.pool, pages, self.cache.slot(req.req_id), self.cache.block_table(req.req_id))
        except Exception:
            self.cancel_reservation(st.req_id)
            raise
        del self.reserved[st.req_id]
        self.requests[req.req_id] = req
        req.status = Status.WAITING
        self.scheduler.add_decoding(req)
        return req

    def cancel_reservation(self, req_id: str) -> None:
        """Free a reservation whose pages will not come (expired, failed, aborted); idempotent."""
        if self.reserved.pop(req_id, None) is not None:
            self.cache.free(req_id)
