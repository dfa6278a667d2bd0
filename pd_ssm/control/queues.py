"""Typed ZMQ PUSH/PULL queues of control messages.

A queue knows which message types it may carry (`accepts`): sending another type is a
programming error (TypeError); receiving one means a peer speaks another protocol (CodecError,
the message is dropped by the caller with a log line, never acted on).  One PULL per receiver
(bound; many peers PUSH into it), one PUSH per destination (connected).

Sync classes serve the worker's step loop and the router's sends (non-blocking, so safe on an
event loop); `AsyncPullQueue` (zmq.asyncio) is the router's receiver.  Every socket has LINGER 0: a peer that died must never make
`close()` hang, and control messages to a dead peer are worthless.
"""

from __future__ import annotations

from typing import Any

import zmq
import zmq.asyncio

from pd_ssm.control.codec import Codec, CodecError
from pd_ssm.control.messages import CONTROL_CODEC

# NOTE: queued control messages per peer before send would block; token deltas are small and a
# router that falls this far behind is better told by a blocked worker than by lost tokens
_HWM = 100_000


class _Typed:
    def __init__(self, accepts: tuple[type, ...], codec: Codec) -> None:
        unknown = [t.__name__ for t in accepts if t not in codec.types]
        if unknown:
            raise ValueError(f"the codec cannot carry {unknown}")
        self.accepts = accepts
        self.codec = codec

    def _encode(self, msg: Any) -> bytes:
        if not isinstance(msg, self.accepts):
            raise TypeError(f"{type(msg).__name__} cannot go on a queue of {[t.__name__ for t in self.accepts]}")
        return self.codec.encode(msg)

    def _decode(self, data: bytes) -> Any:
        msg = self.codec.decode(data)
        if not isinstance(msg, self.accepts):
            raise CodecError(f"unexpected {type(msg).__name__} on a queue of {[t.__name__ for t in self.accepts]}")
        return msg


def _socket(ctx: zmq.Context, kind: int) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM if kind == zmq.PUSH else zmq.RCVHWM, _HWM)
    return sock


def bind_random(sock: zmq.Socket, host: str) -> str:
    """Bind to a free port on `host` (the OS picks it: no race); return the full address."""
    port = sock.bind_to_random_port(f"tcp://{host}")
    return f"tcp://{host}:{port}"


class PullQueue(_Typed):
    """Bound receiver for the worker's loop."""

    def __init__(self, ctx: zmq.Context, host: str, accepts: tuple[type, ...], codec: Codec = CONTROL_CODEC) -> None:
        super().__init__(accepts, codec)
        self.sock = _socket(ctx, zmq.PULL)
        self.address = bind_random(self.sock, host)

    def poll(self, timeout_ms: int) -> bool:
        return bool(self.sock.poll(timeout_ms, zmq.POLLIN))

    def recv_nowait(self) -> Any | None:
        try:
            return self._decode(self.sock.recv(zmq.NOBLOCK))
        except zmq.Again:
            return None

    def close(self) -> None:
        self.sock.close()


class PushQueue(_Typed):
    """Connected sender (worker loop, or router with block=False)."""

    def __init__(self, ctx: zmq.Context, address: str, accepts: tuple[type, ...], codec: Codec = CONTROL_CODEC) -> None:
        super().__init__(accepts, codec)
        self.sock = _socket(ctx, zmq.PUSH)
        self.sock.connect(address)
        self.address = address

    def send(self, msg: Any, *, block: bool = True) -> None:
        """Queue `msg` for the peer; with block=False a full queue (peer gone for long) raises zmq.Again."""
        self.sock.send(self._encode(msg), 0 if block else zmq.NOBLOCK)

    def close(self) -> None:
        self.sock.close()


class AsyncPullQueue(_Typed):
    """Bound receiver on the router's event loop."""

    def __init__(
        self, ctx: zmq.asyncio.Context, host: str, accepts: tuple[type, ...], codec: Codec = CONTROL_CODEC
    ) -> None:
        super().__init__(accepts, codec)
        self.sock: zmq.asyncio.Socket = _socket(ctx, zmq.PULL)  # type: ignore[assignment]
        self.address = bind_random(self.sock, host)

    async def recv(self) -> Any:
        """The next message; raises CodecError for one that is not ours (the socket stays usable)."""
        return self._decode(await self.sock.recv())

    def close(self) -> None:
        self.sock.close()
