"""Disaggregated prefill -> decode over a real ZmqConnector, end to end through two Engines.

The decode engine reserves (slot + KV blocks) before any page exists, the prefill engine sends to
exactly that ticket, and the decode engine writes the pages into its reservation and runs the
request to the end. Tokens must equal a single colocated engine's, greedy and seeded; reservations
that lapse give every page back.

NOTE: the conftest fixture checks after every step that each held slot belongs to a live request,
so the decode engine only steps once no reservation is outstanding.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path
from typing import Any

import pytest

from pd_ssm import LLM, SamplingParams
from pd_ssm.cache.manager import CacheFullError
from pd_ssm.cache.pages import StatePages
from pd_ssm.engine.engine import Engine, RequestError
from pd_ssm.state_transfer.base import Ticket
from pd_ssm.state_transfer.reservations import ReservationTable
from pd_ssm.state_transfer.zmq_connector import ZmqConfig, ZmqConnector
from tests.conftest import random_prompts

TOKEN = "cluster-secret"
MODELS = ["bamba-attn-middle", "mamba2-g2-tied"]
VOCAB = 384
MAX_TOKENS = 12


def small_llm(path: Path | str) -> LLM:
    return LLM(model=str(path), max_num_seqs=8, max_num_batched_tokens=24, block_size=4, num_kv_blocks=64)


def engine(path: Path | str) -> Engine:
    return small_llm(path).engine


def params_for(sampling: str) -> SamplingParams:
    if sampling == "greedy":
        return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return SamplingParams(temperature=0.9, top_p=0.9, seed=4321, max_tokens=MAX_TOKENS, ignore_eos=True)


def colocated(path: Path, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in small_llm(path).generate(prompts, params)]


def prefill(eng: Engine, prompts: dict[str, list[int]], params: SamplingParams) -> dict[str, StatePages]:
    """Step until every request has its first token, exporting each at once (it leaves `eng`)."""
    for rid, prompt in prompts.items():
        eng.add_request(prompt, params, request_id=rid)
    out: dict[str, StatePages] = {}
    while len(out) < len(prompts):
        eng.step()
        for rid in prompts:
            req = eng.requests.get(rid)
            if rid not in out and req is not None and req.is_decoding and req.output_token_ids:
                out[rid] = eng.export_request(rid)
    return out


def run_to_end(eng: Engine) -> dict[str, list[int]]:
    assert not eng.reserved, "stepping with outstanding reservations"
    done: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    return done


def assert_clean(eng: Engine) -> None:
    c = eng.cache
    c.check()
    assert c.num_free_slots == c.num_slots and c.num_free_blocks == c.num_blocks
    assert not eng.requests and not eng.reserved


def recv_all(rx: ZmqConnector, tx: ZmqConnector | None, n: int, timeout: float) -> dict[str, StatePages]:
    got: dict[str, StatePages] = {}
    end = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < end:
        if tx is not None:
            tx.flush(0)
        p = rx.recv(timeout=0.05)
        if p is not None:
            assert p.req_id not in got
            got[p.req_id] = p
    assert rx.get_failed() == {}
    return got


def transfer(
    src: Engine, dst: Engine, rx: ZmqConnector, tx: ZmqConnector, table: ReservationTable,
    prompts: dict[str, list[int]], params: SamplingParams,
) -> dict[str, list[int]]:
    """Reserve on dst for every request first (as the router does), then prefill, send, import, decode."""
    assert rx.address is not None
    tickets: dict[str, Ticket] = {}
    for rid, prompt in prompts.items():
        slot, blocks = dst.reserve(rid, len(prompt) + 1)  # prompt + the first token
        tickets[rid] = table.reserve(rid, rx.address, slot, blocks)
    for rid, pages in prefill(src, prompts, params).items():
        tx.send(pages, tickets[rid])
    return import_and_decode(src, dst, rx, tx, table, tickets)


def import_and_decode(
    src: Engine, dst: Engine, rx: ZmqConnector, tx: ZmqConnector, table: ReservationTable, tickets: dict[str, Ticket]
) -> dict[str, list[int]]:
    """Receive every ticket's request on dst, import it into exactly its reservation and decode to
    the end; the sender reports each sent, and both engines end with nothing held."""
    got = recv_all(rx, tx, len(tickets), timeout=10.0)
    assert sorted(got) == sorted(tickets)
    for pages in got.values():
        req = dst.import_reserved(pages)
        ticket = tickets[pages.req_id]
        assert dst.cache.slot(req.req_id) == ticket.slot and dst.cache.block_table(req.req_id) == ticket.block_ids
    assert tx.flush(2.0) and tx.get_finished()[0] == set(tickets) and tx.get_failed() == {}
    assert len(table) == 0
    done = run_to_end(dst)
    assert_clean(src)
    assert_clean(dst)
    return done


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_transfer_in_process_matches_colocated(
    name: str, sampling: str, hf_checkpoint: Any, rx: ZmqConnector, tx: ZmqConnector, table: ReservationTable
) -> None:
    path, _ = hf_checkpoint(name)
    params = params_for(sampling)
    prompt = random_prompts(VOCAB, [37], seed=5)[0]
    reference = colocated(path, [prompt], params)
    done = transfer(engine(path), engine(path), rx, tx, table, {"r0": prompt}, params)
    assert done == {"r0": reference[0]}


@pytest.mark.parametrize("name", MODELS)
def test_many_requests_concurrently(
    name: str, hf_checkpoint: Any, rx: ZmqConnector, tx: ZmqConnector, table: ReservationTable
) -> None:
    path, _ = hf_checkpoint(name)
    params = params_for("seeded")
    prompts = random_prompts(VOCAB, [5, 19, 33, 8, 40, 17, 1, 26], seed=11)
    reference = colocated(path, prompts, params)
    ids = {f"c{i}": p for i, p in enumerate(prompts)}
    done = transfer(engine(path), engine(path), rx, tx, table, ids, params)
    assert [done[rid] for rid in ids] == reference


# ------------------------------------------------------------------------------------ across processes


def _prefill_child(path: str, prompt: list[int], params: dict[str, Any], ticket: Ticket) -> None:
    src = engine(path)
    pages = prefill(src, {ticket.req_id: prompt}, SamplingParams.from_dict(params))[ticket.req_id]
    assert_clean(src)
    with ZmqConnector(ZmqConfig(TOKEN, send_timeout=10.0)) as c:
        c.send(pages, ticket)
        assert c.flush(10.0) and c.get_finished()[0] == {ticket.req_id} and not c.get_failed()


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_transfer_from_prefill_process(
    name: str, sampling: str, hf_checkpoint: Any, rx: ZmqConnector, table: ReservationTable
) -> None:
    path, _ = hf_checkpoint(name)
    params = params_for(sampling)
    prompt = random_prompts(VOCAB, [29], seed=8)[0]
    reference = colocated(path, [prompt], params)
    dst = engine(path)
    assert rx.address is not None
    slot, blocks = dst.reserve("xp", len(prompt) + 1)
    ticket = table.reserve("xp", rx.address, slot, blocks)
    proc = mp.get_context("spawn").Process(target=_prefill_child, args=(str(path), prompt, params.to_dict(), ticket))
    start = time.monotonic()
    proc.start()
    try:
        got = recv_all(rx, None, 1, timeout=60.0)  # the child imports torch and builds an engine: slow on a loaded host
    finally:
        proc.join(5.0)
        if proc.is_alive():
            proc.kill()
            proc.join()
    assert time.monotonic() - start < 65.0
    assert proc.exitcode == 0 and sorted(got) == ["xp"]
    dst.import_reserved(got["xp"])
    assert rx.get_finished()[1] == {"xp"} and len(table) == 0
    assert run_to_end(dst) == {"xp": reference[0]}
    assert_clean(dst)


# ------------------------------------------------------------------------------------ reservations


def test_expired_reservation_is_cancelled(hf_checkpoint: Any, tx: ZmqConnector) -> None:
    """Pages that arrive after the decode host's clock passed the expiry are dropped and the
    reservation freed; a reservation nothing was ever sent for lapses the same way."""
    path, _ = hf_checkpoint("bamba-attn-middle")
    skew = [0.0]
    table = ReservationTable(ttl=5.0, token=TOKEN, clock=lambda: time.monotonic() + skew[0])
    src, dst = engine(path), engine(path)
    prompt = random_prompts(VOCAB, [21], seed=2)[0]
    with ZmqConnector(ZmqConfig(TOKEN), bind="tcp://127.0.0.1:0", reservations=table) as rx:
        assert rx.address is not None
        slot, blocks = dst.reserve("late", len(prompt) + 1)
        ticket = table.reserve("late", rx.address, slot, blocks)
        slot2, blocks2 = dst.reserve("never", 10)
        table.reserve("never", rx.address, slot2, blocks2)
        assert dst.cache.num_used_slots == 2 and dst.cache.num_free_blocks < dst.cache.num_blocks
        pages = prefill(src, {"late": prompt}, params_for("greedy"))["late"]
        tx.send(pages, ticket)  # still live by the sender's clock
        assert tx.flush(2.0)
        skew[0] = 60.0  # the decode host's clock passes every expiry before the pages are read
        end = time.monotonic() + 5.0
        failed: dict[str, str] = {}
        while "late" not in failed and time.monotonic() < end:
            assert rx.recv(timeout=0.05) is None
            failed.update(rx.get_failed())
        assert "expired" in failed["late"]
        dst.cancel_reservation("late")
        for t in table.expire():
            dst.cancel_reservation(t.req_id)
    assert len(table) == 0
    dst.cancel_reservation("late")  # idempotent
    assert_clean(src)
    assert_clean(dst)


def test_reserve_refuses_and_import_checks(hf_checkpoint: Any) -> None:
    """Never over-commit: a full pool refuses with nothing held; a failed import frees the reservation."""
    path, _ = hf_checkpoint("bamba-attn-middle")
    src, dst = engine(path), engine(path)
    c = dst.cache
    prompt = random_prompts(VOCAB, [21], seed=4)[0]
    pages = prefill(src, {"a": prompt}, params_for("greedy"))["a"]
    held = 0
    while True:  # 60 tokens = 15 blocks: the blocks or the slots run out
        before = (c.num_free_slots, c.num_free_blocks)
        try:
            dst.reserve(f"fill{held}", 60)
        except CacheFullError:
            assert (c.num_free_slots, c.num_free_blocks) == before  # the refusal held nothing
            break
        held += 1
    c.check()
    assert 0 < held == len(dst.reserved) and c.num_used_slots == held
    for i in range(held):
        dst.cancel_reservation(f"fill{i}")
    assert_clean(dst)
    with pytest.raises(RequestError, match="no reservation"):
        dst.import_reserved(pages)
    dst.reserve("a", len(prompt))  # one token short: the first output token does not fit
    with pytest.raises(RequestError, match="reserved"):
        dst.import_reserved(pages)
    assert_clean(dst)
    dst.reserve("a", len(prompt) + 1)
    with pytest.raises(RequestError, match="in use"):
        dst.reserve("a", 4)
    with pytest.raises(RequestError, match="in use"):
        dst.add_request([5, 6], request_id="a")
    dst.import_reserved(pages)
    assert not dst.reserved and "a" in dst.requests
    run_to_end(dst)
    assert_clean(dst)
    assert_clean(src)
