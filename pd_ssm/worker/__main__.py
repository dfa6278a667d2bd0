"""`python -m pd_ssm.worker --worker-id W --router tcp://HOST:PORT [engine flags]`: one colocated
engine worker process (started by orchestrator/local.py; runnable by hand for debugging).

Engine flags are `pd-ssm generate`'s (vLLM's names).  Exit status: 0 after Shutdown or a signal,
1 when the engine failed (the router got a fatal WorkerError first when it could be sent).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Callable, Sequence
from types import FrameType

from pd_ssm.cli import _engine_flags, llm_from_args
from pd_ssm.engine.engine import Engine
from pd_ssm.worker.engine_worker import EngineWorker, WorkerConfig
from pd_ssm.worker.role import WorkerRole

log = logging.getLogger("pd_ssm.worker")


# (parsed flags, engine, worker id) -> the role composed into the worker loop
RoleFactory = Callable[[argparse.Namespace, Engine, str], WorkerRole]


def parser(prog: str = "python -m pd_ssm.worker", doc: str | None = __doc__) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=doc)
    _engine_flags(p)
    p.add_argument("--worker-id", required=True)
    p.add_argument("--router", required=True, help="the router's control address, tcp://HOST:PORT")
    p.add_argument("--host", default="127.0.0.1", help="interface the worker's command socket binds on")
    p.add_argument("--served-model-name", default="")
    p.add_argument("--parent-pid", type=int, default=None, help="exit when this process (the launcher) is gone")
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    return run(parser().parse_args(argv), None)


def run(args: argparse.Namespace, make_role: RoleFactory | None) -> int:
    """Build the engine (and the role, if any), serve until Shutdown or a signal; the exit status."""
    logging.basicConfig(level=args.log_level.upper(), format=f"%(asctime)s worker[{args.worker_id}] %(message)s")
    config = WorkerConfig(worker_id=args.worker_id, router_address=args.router, host=args.host,
                          model_name=args.served_model_name, parent_pid=args.parent_pid)
    llm = llm_from_args(args)
    role = make_role(args, llm.engine, args.worker_id) if make_role is not None else None
    worker = EngineWorker(llm.engine, config, role=role)

    def stop(signum: int, frame: FrameType | None) -> None:
        # SIGTERM from the launcher, or Ctrl-C: leave the loop after this step, close sockets, exit 0
        worker.stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log.info("engine ready (max_model_len %d); commands on %s", llm.engine.max_model_len, worker.commands.address)
    try:
        worker.run()
    except (KeyboardInterrupt, SystemExit):
        return 0
    except Exception:
        log.exception("engine worker failed")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
