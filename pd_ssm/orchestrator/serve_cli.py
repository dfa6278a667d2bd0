"""`pd-ssm serve`: the flags of a deployment (colocated, or `--disagg`), turned into a LocalDeployment,
served with its workers on this machine or, with `--ray`, placed on a Ray cluster (orchestrator/ray.py).

Engine flags are `pd-ssm generate`'s (`_engine_flags`, vLLM's names); they are re-rendered as argv
for every worker, so a flag added there reaches the workers without a change here.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path


def _engine_parser() -> argparse.ArgumentParser:
    from pd_ssm.cli import _engine_flags

    p = argparse.ArgumentParser(add_help=False)
    _engine_flags(p)
    return p


def engine_argv(args: argparse.Namespace, skip: tuple[str, ...] = ("model",)) -> list[str]:
    """The engine flags set in `args`, as command-line arguments (`--max-num-seqs 8`, `--enforce-eager`)."""
    argv: list[str] = []
    for action in _engine_parser()._actions:
        if not action.option_strings or action.dest in skip:
            continue
        value = getattr(args, action.dest, None)
        flag = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):  # --x / --no-x, or neither (None)
            argv += [] if value is None else [flag if value else action.option_strings[1]]
        elif action.nargs == 0:  # store_true / store_false / store_const: the flag alone, when it is set
            argv += [flag] if value == action.const else []
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    from pd_ssm.cli import _engine_flags
    from pd_ssm.worker.transfer_flags import add_transfer_flags

    p = sub.add_parser("serve", help="OpenAI-compatible server: router + colocated engine workers")
    _engine_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="HTTP interface (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port; 0 picks a free one (printed at startup)")
    p.add_argument("--num-workers", type=int, default=1, help="colocated engine worker processes")
    p.add_argument("--served-model-name", default=None, help="model name clients send (default: the directory's)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument("--routing-policy", default="least_loaded", help="round_robin | least_loaded | power_of_two")
    p.add_argument("--health-interval", type=float, default=0.5, help="seconds between worker health checks")
    p.add_argument("--health-timeout", type=float, default=3.0,
                   help="seconds without an answer before a worker leaves rotation")
    p.add_argument("--log-level", default="INFO")
    d = p.add_argument_group("disaggregated serving (prefill and decode on different workers)")
    d.add_argument("--disagg", action="store_true", help="prefill workers ship state pages to decode workers")
    d.add_argument("--num-prefill", type=int, default=1, help="prefill worker processes (--disagg)")
    d.add_argument("--num-decode", type=int, default=1, help="decode worker processes (--disagg)")
    add_transfer_flags(d)
    d.add_argument("--decode-routing-policy", default="least_loaded",
                   help="picks the decode worker (--routing-policy picks the prefill worker)")
    d.add_argument("--gpus", default=None,
                   help="CUDA: comma-separated GPU index per worker, prefill workers first (default 0,1,...)")
    r = p.add_argument_group("Ray (workers placed and supervised on a Ray cluster; the router stays here)")
    r.add_argument("--ray", action="store_true",
                   help="place every worker as a Ray actor (one placement-group bundle each) instead of a local child")
    r.add_argument("--ray-address", default=None,
                   help="cluster to join (e.g. auto, HOST:6379); default: $RAY_ADDRESS, a cluster on this machine, "
                        "else a new local one")
    r.add_argument("--ray-placement-strategy", default="PACK", help="PACK | SPREAD | STRICT_PACK | STRICT_SPREAD")
    r.add_argument("--ray-cpus-per-worker", type=float, default=1.0, help="CPUs in each worker's bundle")
    r.add_argument("--ray-role-resources", action="store_true",
                   help="--disagg: prefill bundles ask for 1 pd_prefill, decode bundles for 1 pd_decode "
                        "(the node types of deploy/cluster.yaml have them)")
    r.add_argument("--ray-max-restarts", type=int, default=3, help="times a worker that exits is started again")
    r.add_argument("--ray-placement-timeout", type=float, default=300.0,
                   help="seconds to wait for the cluster (or its autoscaler) to make room for every worker")
    p.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    from pd_ssm.orchestrator.local import LocalDeployment, serve
    from pd_ssm.router.policies import make_policy

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    make_policy(args.routing_policy)  # a typo fails before any process starts
    make_policy(args.decode_routing_policy)
    if args.model is None:
        from pd_ssm.default_model import default_model_dir

        model_dir = str(default_model_dir())
    else:
        model_dir = str(Path(args.model).resolve())
        if not (Path(model_dir) / "config.json").is_file():
            raise FileNotFoundError(f"--model {args.model}: no config.json there; pass a checkpoint directory")
    dep = LocalDeployment(
        model_dir=model_dir,
        served_model_name=args.served_model_name or Path(model_dir).name,
        engine_argv=engine_argv(args),
        num_workers=args.num_workers,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        policy=args.routing_policy,
        health_interval=args.health_interval,
        health_timeout=args.health_timeout,
        device=args.device,
        log_level=args.log_level,
        disagg=args.disagg,
        num_prefill=args.num_prefill,
        num_decode=args.num_decode,
        connector=args.connector,
        decode_policy=args.decode_routing_policy,
        gpus=[int(g) for g in args.gpus.split(",")] if args.gpus else None,
        transfer_argv=["--connector", args.connector, "--transfer-timeout", str(args.transfer_timeout),
                       "--send-timeout", str(args.send_timeout), "--max-unsent", str(args.max_unsent),
                       *(["--stream-layers", "--stream-bytes", str(args.stream_bytes)] if args.stream_layers else [])],
    )
    if not args.ray:
        return asyncio.run(serve(dep))
    from pd_ssm.orchestrator.ray import RayLauncher, RayOptions

    opts = RayOptions(address=args.ray_address, strategy=args.ray_placement_strategy,
                      cpus_per_worker=args.ray_cpus_per_worker, role_resources=args.ray_role_resources,
                      max_restarts=args.ray_max_restarts, placement_timeout=args.ray_placement_timeout)
    return asyncio.run(serve(dep, RayLauncher(dep, opts)))
