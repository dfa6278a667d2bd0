"""NcclSender: the prefill side of the NCCL connector -- pairing, posting requests, completing them.

See nccl_connector.py for the protocol, nccl_pairing.py for the handshake. A sender is paired with
exactly one receiver at a time; after its peer is lost it fails what was in flight, holds no
buffer, and re-pairs on the next `send` (or an explicit `pair`).

`send` never waits for the device. A request that finds the link idle goes out at once; one that
comes while an earlier message is still on its way is held and coalesced with the others held
into one data message (nccl_batch.py says when, and why that costs a lone request nothing). A
message is posted by sending its metadata -- planned on the host, nothing waits for the device --
then queueing its layout and block-sum kernels (the sums go into the message's trailer,
nccl_checksum.py) and posting its p2p send (NCCL orders it after the kernels on the stream), so
the receiver allocates and posts its recv while the sender lays the buffer out. The side channel and the p2p stream carry
messages in the same order; metadata the receiver does not take within `send_timeout` fails the
message (no byte of it was posted) and drops the pairing: the peer does not answer.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
import zmq

from pd_ssm.cache.pages import LayerPages, StatePages
from pd_ssm.state_transfer.base import Ticket, TransferStats
from pd_ssm.state_transfer.ledger import TransferLedger
from pd_ssm.state_transfer.nccl_batch import OutMessage, build
from pd_ssm.state_transfer.nccl_coalesce import Coalescer, Queued
from pd_ssm.state_transfer.nccl_config import NcclConfig
from pd_ssm.state_transfer.nccl_control import Control
from pd_ssm.state_transfer.nccl_group import PeerGroup, split_tcp
from pd_ssm.state_transfer.nccl_memo import Memo
from pd_ssm.state_transfer.nccl_message import Layouts
from pd_ssm.state_transfer.nccl_pairing import dropped, pair_with
from pd_ssm.state_transfer.nccl_stream_out import StreamOut

# (layout, offset) pairs kept: a few models' layouts at every place a coalesced message puts a request
_MEMO_ENTRIES = 256
_REAP_PROBE_S = 0.02  # seconds between the store probes of `reap` (flush always probes)
_IDLE_PROBE_S = 20e-6  # seconds between `send_layers`' looks at the link (one ~1-2 us event query)


class NcclSender:
    def __init__(self, config: NcclConfig, ledger: TransferLedger, ctx: zmq.Context) -> None:
        self.config = config
        self.ledger = ledger
        self.device = torch.device(config.device)
        self.rendezvous = config.rendezvous
        self.address: str | None = None  # the paired receiver's data address
        self._token = config.token.encode()
        self._ctx = ctx
        self._push: zmq.Socket | None = None
        self._group: PeerGroup | None = None
        self._probe: dist.TCPStore | None = None  # the receiver's store, with a short timeout
        # taken by `send`, not posted yet: the next message's requests. NOTE: within both caps, so
        # a coalesced message never exceeds what the receiver takes
        self._held = Coalescer(min(config.coalesce_bytes, config.max_message_bytes), config.max_message_bytes)
        self._layouts: Layouts = Memo(_MEMO_ENTRIES)  # run headers by (layout, offset): they repeat
        self._pending: deque[OutMessage] = deque()  # p2p sends posted; they complete in posting order
        self._lost = "peer lost"  # why the last pairing went (a request held meanwhile fails with it)
        self._streams = StreamOut()  # layer-wise streaming (`send_layers`)
        self._probed = 0.0  # time.monotonic() of reap's last store probe
        self._stream: torch.cuda.Stream | None = None  # where gated messages are laid out (`_gate`)
        self._posted_at = float("-inf")  # time.monotonic() of the last data message with bytes posted
        self._idle_probed = float("-inf")  # time.monotonic() of send_layers' last look at the link

    @property
    def paired(self) -> bool:
        return self._group is not None

    @property
    def in_flight(self) -> int:
        """Requests taken by `send` whose send has not completed: held for the next message, or
        posted (their message holds its buffer until its p2p send completed)."""
        return len(self._held) + sum(len(out.req_ids) for out in self._pending)

    def pair(self, rendezvous: str | None = None) -> None:
        if rendezvous is not None:
            split_tcp(rendezvous)
            self.rendezvous = rendezvous
        self.lose_peer("re-pairing")
        p = pair_with(self.rendezvous, self.config, self._ctx, self.device)
        self._close_push()
        self.address, self._push, self._group, self._probe = p

    def send(self, pages: StatePages, ticket: Ticket) -> None:
        if self._group is None:
            try:
                self.pair()
            except RuntimeError as e:
                self.ledger.fail(pages.req_id, str(e))
                return
        if ticket.address != self.address:
            raise ValueError(
                f"ticket of {ticket.req_id!r} names {ticket.address}, but this connector is paired with "
                f"the receiver at {self.address}: one NcclConnector per receiver"
            )
        streamed = self._streams.finish(pages.req_id)
        if streamed is None:  # its stream broke (reported then): nothing to finish
            return
        if not streamed.layers:
            nbytes = pages.nbytes()
        elif pages.layers:  # layers of its own beside the held ones: all counted together
            pages.layers.update((p.layer_idx, p) for p in streamed.layers)
            nbytes = pages.nbytes()
        else:  # NOTE: the usual end of a stream: the held layers' bytes are known (64 layers: ~50 us saved)
            pages.layers = {p.layer_idx: p for p in streamed.layers}
            nbytes = streamed.nbytes
        # NOTE: a streamed request's stats count from its first layers, with every part's bytes
        start = time.monotonic() if streamed.start is None else streamed.start
        self._queue(Queued(pages, start, nbytes, streamed.parts, ready=streamed.ready, prior=streamed.sent))

    def _queue(self, q: Queued) -> None:
        """Post `q` now, hold it, or post it with what is held (module docstring). One gated on
        a device event goes at once, after what is held: the device orders it, and holding it
        would make the layers streamed with it wait for the last of them."""
        if q.ready is not None:
            self._post(self._held.take())
            self._post([q])
            return
        for message in self._held.add(q):
            self._post(message)
        if not self._link_busy():
            self._post(self._held.take())

    def send_layers(self, ticket: Ticket, layers: Sequence[LayerPages], ready: Any = None, last: bool = False) -> None:
        """Layer-wise streaming: hold `layers` of `ticket.req_id`; once they reach `stream_bytes`
        (`coalesce_bytes` while a message went less than `part_hold` ago, for host layers) they
        become a PART (nccl_control.py), which goes out as a request does: at once on an idle
        link, else coalesced with what is held (the parts of a batch's requests, finished layer
        by layer together, share messages). The request's final `send` takes the layers still
        held and says how many parts went before. `ready`, `last`: nccl_connector.py."""
        req_id = ticket.req_id
        if self._streams.is_broken(req_id):
            return
        if self._group is None:
            try:
                self.pair()
            except RuntimeError as e:
                self._break(req_id, str(e))
                return
        # NOTE: host layers handed over faster than the hosts post messages (a message went less
        # than part_hold ago) collect up to coalesce_bytes before they make a part: each entry costs
        # both hosts its own work (layout, sums check, unpack), and in a burst the link waits on
        # those, not on the layers. Gated layers (`ready`) keep stream_bytes: they come all at once,
        # at the launch of a graph that makes them over milliseconds
        size = self.config.stream_bytes
        now = time.monotonic()
        if ready is None and now - self._posted_at < self.config.part_hold:
            size = self._held.cap
        part = self._streams.add(req_id, layers, size, ready, flush=last)
        if part is None:
            # NOTE: what is held leaves once the link is idle, as at a send: a burst handed over
            # layer by layer makes an entry only at each request's end (~0.3 ms of hand-over on the
            # H200's host), and the link would wait that long for the next message
            if self._held and now - self._idle_probed >= _IDLE_PROBE_S:
                self._idle_probed = now
                if not self._link_busy():
                    self._post(self._held.take())
            return
        self._queue(Queued(part.pages, time.monotonic(), part.nbytes, part=True, ready=part.ready))

    def _fail_queued(self, q: Queued, reason: str) -> None:
        """A request's entry cannot go: a part breaks its stream (the final send is then dropped)."""
        if q.part:
            if not self._streams.is_broken(q.pages.req_id):
                self._break(q.pages.req_id, reason)
        else:
            self.ledger.fail(q.pages.req_id, reason)

    def _break(self, req_id: str, reason: str) -> None:
        """A streamed request failed before its final send: report it, drop what is held of it."""
        self._streams.break_(req_id)
        self.ledger.fail(req_id, reason)

    def _link_busy(self) -> bool:
        """Whether an earlier message is still on its way ((NCCL) its p2p send not completed).
        Gloo cannot tell: any send posted and not flushed counts as busy."""
        if self._group is None:
            return False
        # NOTE: a message without bytes posts no send (`_dispatch`); the last send posted says
        last = next((out.work for out in reversed(self._pending) if out.work is not None), None)
        return last is not None and self._group.done(last) is not True

    def _post(self, held: list[Queued]) -> None:
        """Post `held` as ONE data message."""
        if not held:
            return
        if self._group is None:  # the pairing went while they were held
            for q in held:
                self._fail_queued(q, self._lost)
            return
        try:
            out = build(held, self._group.gen, self._token, self._layouts)
        except ValueError as e:  # a tensor whose dtype cannot go on the wire: that request alone fails
            if len(held) == 1:
                self._fail_queued(held[0], str(e))
                return
            for q in held:
                self._post([q])
            return
        self._dispatch(out)

    def _dispatch(self, out: OutMessage) -> None:
        """Metadata out, then the buffer laid out and its p2p send posted (none for a message
        without bytes, which is sent once its metadata is out)."""
        assert self._push is not None and self._group is not None
        try:
            self._push.send_multipart(out.parts)
        except zmq.Again:  # nothing of it is on the stream, but the peer does not answer: re-pair next time
            why = f"peer {self.address} did not take the metadata within {self.config.send_timeout} s"
            for req_id in out.req_ids:
                self.ledger.fail(req_id, why)
            self.lose_peer(why)
            return
        out.parts = []
        self._pending.append(out)  # from here on a lost peer fails it
        with self._gate(out.ready):
            try:
                buf = out.lay_out(self.device)
            except RuntimeError as e:  # out of device memory: the receiver waits for bytes that cannot come
                self.lose_peer(f"cannot lay out a {sum(out.sizes)}-byte message: {str(e).splitlines()[0][:200]}")
                return
            if buf.numel() == 0:  # nothing to send (a streamed request whose layers all went as parts)
                # NOTE: it completes in order, after the sends before it: its request's parts
                if len(self._pending) == 1:
                    self._pending.pop()
                    self._complete(out)
                return
            try:
                out.work = self._group.isend(buf)  # NOTE: NCCL orders it after the current stream's work
            except RuntimeError as e:  # gloo refuses at once on a pair whose peer is gone
                self.lose_peer(f"peer lost: {e}")
                return
            self._posted_at = time.monotonic()

    def _gate(self, ready: list[Any]) -> AbstractContextManager[Any]:
        """The stream a message is laid out and posted from: the current one, or for pages still
        being made (`ready` events) the sender's own, made to wait for them."""
        if not ready:
            return nullcontext()
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        for event in ready:
            self._stream.wait_event(event)
        return torch.cuda.stream(self._stream)

    def post(self, req_ids: list[str], parts: list[bytes | memoryview], buf: torch.Tensor, start: float) -> None:
        """`parts` out, then the p2p send of `buf`, after everything sent before. Public so fault
        tests can post a message they mangled; `send` is the way to post requests."""
        self._post(self._held.take())
        if self._push is None or self._group is None:
            raise RuntimeError("this NcclConnector is not paired: call pair() first")
        n = len(req_ids)
        self._dispatch(OutMessage(req_ids, [buf.numel() // max(1, n)] * n, [start] * n, list(parts), buf))

    def abort(self, req_id: str) -> None:
        """Tell the receiver to release the reservation of `req_id` now rather than at its expiry.
        Held, it never leaves (the others held go out now). Best effort once posted: its bytes are
        on the stream regardless, and the receiver reads the abort after them; never blocks."""
        self._held.drop(req_id)
        self._streams.abort(req_id)
        if self._push is None or self._group is None:
            return
        self._post(self._held.take())
        if self._push is None or self._group is None:
            return
        try:
            self._push.send_multipart([self._token, Control.abort(self._group.gen, req_id).encode()], zmq.NOBLOCK)
        except zmq.Again:
            pass  # the receiver's expiry frees the reservation instead

    def flush(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        self._post(self._held.take())
        # NOTE: probe first: a gloo send whose receiver died before posting its recv is never
        # failed by gloo, and a gloo wait cannot be sliced (a timed-out wait ends the Work)
        self._check_dropped()
        while self._pending and self._group is not None:
            out = self._pending[0]
            if out.work is None:  # no bytes of its own: done once those before it are
                self._complete(self._pending.popleft())
                continue
            why = self._group.wait(out.work, end - time.monotonic())
            if why is not None:
                self.lose_peer(f"p2p send failed: {why}")
                break
            self._complete(self._pending.popleft())
        self._check_dropped()  # and after: the receiver may have dropped what it just read
        return not self._pending and not self._held

    def reap(self) -> None:
        """Post what is held, report completed sends without blocking where the backend can tell
        (NCCL); a send older than `timeout` means the peer is gone. Also notices a pairing the
        receiver dropped (a store round trip, ~0.1-0.2 ms: at most every _REAP_PROBE_S, since a
        worker loop reaps each turn)."""
        self._post(self._held.take())
        now = time.monotonic()
        if now - self._probed >= _REAP_PROBE_S:
            self._probed = now
            self._check_dropped()
        while self._pending and self._group is not None:
            out = self._pending[0]
            if out.work is None:  # no bytes of its own: done once those before it are
                self._complete(self._pending.popleft())
                continue
            if not self._group.done(out.work):
                if time.monotonic() - out.starts[-1] > self.config.timeout:
                    self.lose_peer(f"p2p send not completed within {self.config.timeout} s")
                return
            why = self._group.wait(out.work, self.config.timeout)  # completed: surfaces its error
            if why is not None:
                self.lose_peer(f"p2p send failed: {why}")
                return
            self._complete(self._pending.popleft())

    def _check_dropped(self) -> None:
        """One store round trip: did the receiver drop our generation (then re-pair on next send)?"""
        if self._group is None or self._probe is None:
            return
        reason = dropped(self._probe, self._group.gen)
        if reason is not None:
            self.lose_peer(f"the receiver dropped the pairing ({reason})")

    def _complete(self, out: OutMessage) -> None:
        now = time.monotonic()
        finals = out.finals or [True] * len(out.req_ids)
        priors = out.priors or [0] * len(out.req_ids)
        for req_id, size, start, final, prior in zip(out.req_ids, out.sizes, out.starts, finals, priors, strict=True):
            if final:  # a part's request completes with its last part
                self.ledger.sent(TransferStats(req_id, size + prior, now - start))

    def lose_peer(self, reason: str) -> None:
        """Fail every request in flight -- held or posted -- (aborted ones silently) and tear the
        group down; the peer's pending ops then fail too, so it notices at once."""
        self._lost = reason
        req_ids = [q.pages.req_id for q in self._held.take()]
        for out in self._pending:
            req_ids += out.req_ids
        for req_id in self._streams.with_parts():  # parts went on this pairing: the receiver drops them with it
            self._streams.break_(req_id)
            req_ids.append(req_id)
        for req_id in dict.fromkeys(req_ids):
            if not self.ledger.is_aborted(req_id):
                self.ledger.fail(req_id, reason)
        self._pending.clear()
        if self._group is not None:
            self._group.close()
            self._group = None
        self._probe = None

    def close(self, timeout: float) -> None:
        """Wait up to `timeout` for posted sends, then drop the group and the socket."""
        if self._group is not None:
            self.flush(timeout)
        self.lose_peer("connector closed")
        self._close_push()

    def _close_push(self) -> None:
        if self._push is not None:
            self._push.close()
            self._push = None

