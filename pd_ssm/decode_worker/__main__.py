"""`python -m pd_ssm.decode_worker --worker-id D --router tcp://HOST:PORT --connector zmq|nccl
[engine flags]`: one decode worker process (started by orchestrator/local.py with --disagg).

Its receivers bind free ports on --host; tickets carry their addresses to the prefill workers.
The cluster token comes from $PD_SSM_CLUSTER_TOKEN.  Exit status as `python -m pd_ssm.worker`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pd_ssm.decode_worker.receivers import Receiver, ReceiverFactory, Receivers
from pd_ssm.decode_worker.role import DecodeRole
from pd_ssm.engine.engine import Engine
from pd_ssm.state_transfer.reservations import ReservationTable
from pd_ssm.worker.__main__ import parser, run
from pd_ssm.worker.transfer_flags import add_transfer_flags, cluster_token, transfer_device


def receiver_factory(args: argparse.Namespace, token: str) -> ReceiverFactory:
    host = args.host
    if args.connector == "zmq":
        from pd_ssm.state_transfer.zmq_connector import ZmqConfig, ZmqConnector

        def zmq_rx(table: ReservationTable) -> Receiver:
            c = ZmqConnector(ZmqConfig(token, send_timeout=args.send_timeout), bind=f"tcp://{host}:0",
                             reservations=table)
            assert c.address is not None
            return Receiver(c, c.address, "")

        return zmq_rx
    from pd_ssm.state_transfer.nccl_connector import NcclConfig, NcclConnector

    device = transfer_device(args.device)

    def nccl_rx(table: ReservationTable) -> Receiver:
        config = NcclConfig(token, f"tcp://{host}:0", device=device, timeout=args.transfer_timeout,
                            send_timeout=args.send_timeout)
        c = NcclConnector(config, bind=f"tcp://{host}:0", reservations=table)
        assert c.address is not None
        return Receiver(c, c.address, c.rendezvous)

    return nccl_rx


def make_role(args: argparse.Namespace, engine: Engine, worker_id: str) -> DecodeRole:
    token = cluster_token()
    table = ReservationTable(ttl=args.transfer_timeout, token=token)
    receivers = Receivers(receiver_factory(args, token), table, per_prefill=args.connector == "nccl")
    return DecodeRole(engine, receivers, worker_id)


def main(argv: Sequence[str] | None = None) -> int:
    p = parser("python -m pd_ssm.decode_worker", __doc__)
    add_transfer_flags(p)
    return run(p.parse_args(argv), make_role)


if __name__ == "__main__":
    sys.exit(main())
