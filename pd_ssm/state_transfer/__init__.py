"""State transfer: the wire format and the Connector contract that move StatePages P -> D."""

from __future__ import annotations

from pd_ssm.state_transfer.assembler import PageAssembler, frames_to_pages
from pd_ssm.state_transfer.base import Connector, StreamingConnector, Ticket, TransferStats
from pd_ssm.state_transfer.reservations import ReservationTable
from pd_ssm.state_transfer.wire import (
    Frame,
    FrameError,
    decode_frame,
    encode_end,
    encode_page,
    encode_request,
    encode_run,
    pages_to_frames,
)

__all__ = [
    "Connector",
    "Frame",
    "FrameError",
    "PageAssembler",
    "ReservationTable",
    "StreamingConnector",
    "Ticket",
    "TransferStats",
    "decode_frame",
    "encode_end",
    "encode_page",
    "encode_request",
    "encode_run",
    "frames_to_pages",
    "pages_to_frames",
]
