"""`python -m pd_ssm.prefill_worker --worker-id P --router tcp://HOST:PORT --connector zmq|nccl
[engine flags]`: one prefill worker process (started by orchestrator/local.py with --disagg).

The cluster token comes from $PD_SSM_CLUSTER_TOKEN.  Exit status as `python -m pd_ssm.worker`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pd_ssm.engine.engine import Engine
from pd_ssm.prefill_worker.fanout import FanoutConnector
from pd_ssm.prefill_worker.role import PrefillRole
from pd_ssm.state_transfer.base import Connector
from pd_ssm.worker.__main__ import parser, run
from pd_ssm.worker.transfer_flags import add_transfer_flags, cluster_token, transfer_device


def make_role(args: argparse.Namespace, engine: Engine, worker_id: str) -> PrefillRole:
    token = cluster_token()
    connector: Connector
    if args.connector == "zmq":
        from pd_ssm.state_transfer.zmq_connector import ZmqConfig, ZmqConnector

        connector = ZmqConnector(ZmqConfig(token, send_timeout=args.send_timeout))
    else:
        from pd_ssm.state_transfer.nccl_connector import NcclConfig, NcclConnector

        device = transfer_device(args.device)

        def pair(rendezvous: str) -> Connector:
            return NcclConnector(NcclConfig(token, rendezvous, device=device, timeout=args.transfer_timeout,
                                            send_timeout=args.send_timeout, stream_layers=args.stream_layers,
                                            stream_bytes=args.stream_bytes))

        # gloo (CPU) sends complete only inside a blocking wait: see FanoutConnector
        connector = FanoutConnector(pair, wait_sends=device == "cpu", streams=args.stream_layers,
                                    device_pages=device != "cpu")
    return PrefillRole(engine, connector, worker_id, max_unsent=args.max_unsent)


def main(argv: Sequence[str] | None = None) -> int:
    p = parser("python -m pd_ssm.prefill_worker", __doc__)
    add_transfer_flags(p)
    return run(p.parse_args(argv), make_role)


if __name__ == "__main__":
    sys.exit(main())
