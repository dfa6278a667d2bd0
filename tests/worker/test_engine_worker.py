"""EngineWorker against the router's WorkerPool in one process (worker loop in a thread, real ZMQ on
loopback): admission, streaming, abort, health answers, and a fatal engine error seen by the router."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from pathlib import Path
from typing import Any

from pd_ssm import LLM, SamplingParams
from pd_ssm.control.messages import TokenDelta
from pd_ssm.router.workers import StreamFailure, WorkerPool, WorkerStatus
from pd_ssm.worker.engine_worker import EngineWorker, WorkerConfig


def _llm(model_dir: Path) -> LLM:
    return LLM(model=str(model_dir), max_num_seqs=4, num_kv_blocks=64)


async def _until(pred: Any, within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within} s: {what}")
        await asyncio.sleep(0.01)


async def _drain(queue: asyncio.Queue[TokenDelta | StreamFailure], within: float = 20.0) -> list[Any]:
    items: list[Any] = []
    while not items or (isinstance(items[-1], TokenDelta) and not items[-1].finished):
        items.append(await asyncio.wait_for(queue.get(), within))
    return items


def test_worker_serves_aborts_reports_and_dies_loudly(model_dir: Path) -> None:
    rng = random.Random()
    prompt = [rng.randrange(3, 259) for _ in range(rng.randint(4, 40))]
    n = rng.randint(5, 20)
    params = SamplingParams(temperature=0.8, top_k=30, seed=rng.randrange(1 << 31), max_tokens=n, ignore_eos=True)
    expected = _llm(model_dir).generate(prompt, params)[0].outputs[0]
    engine = _llm(model_dir).engine
    crashed: list[BaseException] = []

    def run(worker: EngineWorker) -> None:
        try:
            worker.run()
        except BaseException as e:  # the fatal path re-raises: keep it for the assertion
            crashed.append(e)

    async def main() -> None:
        pool = WorkerPool("127.0.0.1", expected=["w0"], health_interval=0.05, health_timeout=0.5)
        pool.start()
        worker = EngineWorker(engine, WorkerConfig("w0", pool.address, idle_poll_ms=10))
        thread = threading.Thread(target=run, args=(worker,), daemon=True)
        thread.start()
        try:
            await _until(lambda: pool.in_rotation(), 5.0, "worker in rotation")
            assert pool.max_model_len() == engine.max_model_len

            # a request streams exactly what LLM.generate gives
            items = await _drain(pool.submit("w0", "r1", prompt, params).queue)
            assert [t for d in items for t in d.token_ids] == expected.token_ids
            assert "".join(d.text for d in items) == expected.text
            assert items[-1].finish_reason == "length" and items[-1].completion_tokens == n

            # an abort frees the pages, and the report says so without waiting for a health check
            long = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)
            stream = pool.submit("w0", "r2", prompt, long)
            await asyncio.wait_for(stream.queue.get(), 10)
            load = pool.workers["w0"]
            await _until(lambda: load.load is not None and load.load.used_slots == 1, 2.0, "slot held")
            pool.abort("r2")
            await _until(lambda: load.load is not None and load.load.used_slots == 0, 1.0, "slot freed")
            assert load.load is not None and load.load.pool_ok and not load.inflight

            # a refused request fails alone
            too_long = [5] * engine.max_model_len
            (refused,) = await _drain(pool.submit("w0", "r3", too_long, params).queue)
            assert refused.finish_reason == "error" and "maximum model length" in (refused.error or "")
            assert pool.workers["w0"].status is WorkerStatus.HEALTHY

            # an engine failure is fatal: the router marks the worker dead and fails its requests
            def boom() -> list[Any]:
                raise RuntimeError("injected step failure")

            engine.step = boom  # type: ignore[method-assign]
            items = await _drain(pool.submit("w0", "r4", prompt, params).queue)
            assert isinstance(items[-1], StreamFailure) and "injected step failure" in items[-1].message
            assert pool.workers["w0"].status is WorkerStatus.DEAD and not pool.in_rotation()
            thread.join(5)
            assert not thread.is_alive() and isinstance(crashed[0], RuntimeError)
        finally:
            worker.stop()
            thread.join(5)
            await pool.close()

    asyncio.run(main())
