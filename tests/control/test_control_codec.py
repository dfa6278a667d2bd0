"""The control codec: every message round-trips exactly; anything else is refused loudly."""

from __future__ import annotations

import random

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pd_ssm.control.codec import Codec, CodecError
from pd_ssm.control.disagg_messages import (
    ForwardTicket,
    PrefillRequest,
    ReserveReply,
    ReserveRequest,
    TicketSpec,
    TransferReport,
)
from pd_ssm.control.messages import (
    CONTROL_CODEC,
    AbortRequest,
    HealthCheck,
    LoadReport,
    Shutdown,
    StepOutputs,
    SubmitRequest,
    TokenDelta,
    WorkerError,
    WorkerHello,
)
from pd_ssm.sampling_params import SamplingParams

ids = st.lists(st.integers(0, 1 << 20), max_size=50)
text = st.text(max_size=40)


@st.composite
def params(draw: st.DrawFn) -> SamplingParams:
    max_tokens = draw(st.integers(1, 4096))
    return SamplingParams(
        temperature=draw(st.floats(0, 2)), top_p=draw(st.floats(0.01, 1)), top_k=draw(st.integers(-1, 100)),
        min_p=draw(st.floats(0, 1)), seed=draw(st.none() | st.integers(0, 1 << 62)), max_tokens=max_tokens,
        min_tokens=draw(st.integers(0, max_tokens)), stop=draw(st.lists(st.text(min_size=1, max_size=5), max_size=3)),
        stop_token_ids=draw(ids), ignore_eos=draw(st.booleans()),
    )


deltas = st.builds(TokenDelta, text, ids, text, st.integers(0, 9999), st.integers(0, 9999),
                   st.sampled_from([None, "stop", "length", "abort", "error"]),
                   st.none() | st.integers(0, 999) | text, st.none() | text)
messages = st.one_of(
    st.builds(SubmitRequest, text, ids, params()),
    st.builds(AbortRequest, text),
    st.builds(HealthCheck, st.integers(-1, 1 << 40)),
    st.builds(Shutdown, text),
    st.builds(WorkerHello, text, text, st.integers(1, 1 << 22), text, st.integers(1, 1 << 20), text),
    st.builds(LoadReport, text, *[st.integers(-1, 1 << 20)] * 7, st.booleans(), st.integers(0, 1 << 30)),
    st.builds(StepOutputs, text, st.lists(deltas, max_size=5)),
    st.builds(WorkerError, text, text, st.none() | text, st.booleans()),
)


@settings(max_examples=300, deadline=None)
@given(messages)
def test_every_message_round_trips(msg: object) -> None:
    back = CONTROL_CODEC.decode(CONTROL_CODEC.encode(msg))
    assert type(back) is type(msg)
    assert back == msg


def test_disaggregated_messages_round_trip_nested() -> None:
    """Reserve / Ticket / Prefill messages carry a TicketSpec or SamplingParams nested."""
    rng = random.Random()
    spec = TicketSpec("r1", f"tcp://127.0.0.1:{rng.randrange(1024, 65536)}", rng.randrange(8),
                      [rng.randrange(64) for _ in range(rng.randint(0, 5))], rng.uniform(0, 1e6), "tok",
                      rendezvous=rng.choice(["", "tcp://127.0.0.1:4242"]))
    msgs = [
        ReserveRequest("r1", "p0", rng.randint(1, 4096)),
        ReserveReply("d0", "r1", spec),
        ReserveReply("d1", "r2", None, "no free state slot"),
        PrefillRequest("r1", [rng.randrange(500) for _ in range(9)], SamplingParams(seed=rng.randrange(99))),
        ForwardTicket(spec, "d0"),
        TransferReport("p0", "r1", "prefill", True, rng.randrange(1 << 30), rng.random()),
        TransferReport("d0", "r1", "decode", False, error="expired"),
    ]
    for msg in msgs:
        assert CONTROL_CODEC.decode(CONTROL_CODEC.encode(msg)) == msg
    with pytest.raises(CodecError, match="num_tokens must be > 0"):
        CONTROL_CODEC.decode(_with_tokens(msgs[0], 0))


def _with_tokens(msg: ReserveRequest, n: int) -> bytes:
    """A ReserveRequest frame whose num_tokens is `n`, built past the constructor's check."""
    fields = {"req_id": msg.req_id, "prefill_id": msg.prefill_id, "num_tokens": n}
    inner = msgpack.packb(["reserve", fields], use_bin_type=True)
    return msgpack.packb(msgpack.ExtType(1, inner), use_bin_type=True)


def test_garbage_and_foreign_frames_are_refused() -> None:
    rng = random.Random()
    for _ in range(50):
        junk = rng.randbytes(rng.randint(0, 64))
        try:
            msg = CONTROL_CODEC.decode(junk)
        except CodecError:
            continue
        raise AssertionError(f"decoded {junk!r} into {msg!r}")
    with pytest.raises(CodecError, match="must be a registered dataclass"):
        CONTROL_CODEC.decode(msgpack.packb({"req_id": "x"}))
    with pytest.raises(CodecError, match="unknown message tag 'pickle'"):
        CONTROL_CODEC.decode(msgpack.packb(msgpack.ExtType(1, msgpack.packb(["pickle", {}]))))
    with pytest.raises(CodecError, match="has no field"):
        CONTROL_CODEC.decode(msgpack.packb(msgpack.ExtType(1, msgpack.packb(["abort", {"req_id": "a", "x": 1}]))))


def test_decoding_validates_through_the_class() -> None:
    """A SamplingParams that arrives runs its own checks: a bad temperature never reaches an engine."""
    good = CONTROL_CODEC.encode(SubmitRequest("r", [1, 2], SamplingParams(temperature=0.5)))
    bad = good.replace(msgpack.packb(0.5), msgpack.packb(-0.5))
    assert bad != good
    with pytest.raises(CodecError, match="temperature"):
        CONTROL_CODEC.decode(bad)


def test_codec_construction_errors() -> None:
    with pytest.raises(TypeError, match="not a dataclass"):
        Codec([int])
    with pytest.raises(ValueError, match="tag 'abort'"):
        Codec([AbortRequest, AbortRequest])
    with pytest.raises(CodecError, match="not a message type"):
        CONTROL_CODEC.encode({"req_id": "x"})
