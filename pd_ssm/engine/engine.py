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

The engine's parts are built in build.py: on CUDA it sizes its pools from
`gpu_memory_utilization` after loading the weights and profiling a step (memory_plan.py), and
captures CUDA graphs for decode-only and prefill-only steps unless `enforce_eager`
(cuda_graphs.py, prefill_graphs.py); on the CPU the pools keep CacheConfig's sizes and every step
runs eagerly.

With async scheduling (on by default on CUDA, inflight.py) a decode-only step is launched before
the previous step's tokens are read, and `step()` returns the outputs of the steps it read: in a
steady decode batch, those of the step before the one it launched.  `has_unfinished()` stays True
until every launched step has been read.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import NamedTuple

from pd_ssm.cache.pages import RequestState, StatePages, export_pages, import_pages
from pd_ssm.config import EngineConfig
from pd_ssm.engine.build import build_parts
from pd_ssm.engine.device_sample import SamplerOutput
from pd_ssm.engine.inflight import InflightStep, launch_ahead_ok
from pd_ssm.engine.layer_export import LayerExporter, PageSink
from pd_ssm.engine.output_processor import OutputProcessor
from pd_ssm.engine.request import Request, Status
from pd_ssm.engine.sampler import make_seed
from pd_ssm.outputs import RequestOutput
from pd_ssm.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request the engine refuses (bad prompt, too long, ...); nothing was allocated for it."""


class Reservation(NamedTuple):
    """Where a reserved request's pages go: its state slot and KV block ids (in order)."""

    slot: int
    block_ids: list[int]


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        parts = build_parts(config)  # build.py: model, pools, scheduler, runner and graphs
        self.device, self.model_config, self.dtype = parts.device, parts.model_config, parts.dtype
        self.kernels, self.model, self.memory_plan = parts.kernels, parts.model, parts.memory_plan
        self.pool, self.cache, self.max_model_len = parts.pool, parts.cache, parts.max_model_len
        self.scheduler, self.runner, self.tokenizer = parts.scheduler, parts.runner, parts.tokenizer
        self.outputs = OutputProcessor(self.tokenizer, self.model_config.eos_token_ids, self.max_model_len)
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
