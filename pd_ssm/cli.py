"""`pd-ssm` command line.  Flags use vLLM's names where the meaning is the same."""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections.abc import Sequence
from typing import Any


def _engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint directory (default: the embedded tiny hybrid)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=1024)
    p.add_argument("--mamba-ssm-cache-dtype", default="float32")
    p.add_argument("--kernel-backend", default="auto", choices=["auto", "torch", "triton"])
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"],
                   help="dummy: random weights of the real sizes (only config.json is read)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of the GPU's memory for weights, activations, graphs and cache pools (CUDA)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (decode or prefill steps)")
    p.add_argument("--no-prefill-cuda-graphs", dest="prefill_cuda_graphs", action="store_false",
                   help="capture CUDA graphs for decode steps only; prefill steps run eagerly")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="launch each decode step before the previous step's tokens are read, hiding "
                        "detokenizing and scheduling behind the GPU (default: on for CUDA, off on the CPU)")


def llm_from_args(args: argparse.Namespace) -> Any:
    """The `LLM` that the engine flags of `_engine_flags` describe (generate and the serve workers)."""
    from pd_ssm import LLM

    return LLM(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
        kernel_backend=args.kernel_backend,
        load_format=args.load_format,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        prefill_cuda_graphs=args.prefill_cuda_graphs,
        async_scheduling=args.async_scheduling,
    )


def _generate(args: argparse.Namespace) -> int:
    from pd_ssm import SamplingParams

    llm = llm_from_args(args)
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos,
    )
    prompts = args.prompt or ["def fibonacci(n):"]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    n = 0
    for out in outs:
        comp = out.outputs[0]
        n += len(comp.token_ids)
        print(f"prompt: {out.prompt!r}")
        print(f"output: {comp.text!r}")
        print(f"tokens: {comp.token_ids}  finish: {comp.finish_reason}")
    print(f"[{len(outs)} prompts, {n} tokens in {dt:.2f}s]", file=sys.stderr)
    return 0


def _add_bench_engine(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("engine", help="whole-model prefill and decode steps against their roofline floors (CUDA)")
    from pd_ssm.bench.shapes import DEFAULT_SHAPE, SHAPES

    p.add_argument("--model", default=None, help="checkpoint directory (default: --shape, dummy weights)")
    p.add_argument("--shape", default=None, choices=list(SHAPES),
                   help=f"a real model's shape with dummy weights, no download (default: {DEFAULT_SHAPE})")
    p.add_argument("--load-format", default=None, choices=["auto", "safetensors", "dummy"],
                   help="default: dummy without --model, auto with it")
    p.add_argument("--kernel-backend", default="auto", choices=["auto", "torch", "triton"])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--mamba-ssm-cache-dtype", default="float32")
    p.add_argument("--prefill-tokens", type=int, default=2048)
    p.add_argument("--prefill-runs", type=int, default=7)
    p.add_argument("--batch-sizes", default="1,32,128", help="decode batch sizes, comma-separated")
    p.add_argument("--decode-steps", type=int, default=60, help="timed decode steps per batch size")
    p.add_argument("--decode-context", type=int, default=16,
                   help="prompt tokens of each decode request (hybrids: the KV their attention reads)")
    p.add_argument("--warmup-steps", type=int, default=8)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--enforce-eager", action="store_true", help="decode without CUDA graphs")
    p.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false",
                   help="read every step's tokens before the next step is launched")
    p.add_argument("--json", default=None, metavar="FILE", help="write every figure to FILE")
    p.set_defaults(func=_bench_engine)


def _add_bench_transfer(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("transfer", help="state-transfer connectors vs raw socket / send-recv in the same run (CPU or CUDA)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: NCCL between cuda:0 and cuda:1")
    p.add_argument("--connectors", default="zmq,nccl,stream",
                   help="comma-separated: zmq, nccl, stream (zmq layer-wise during a prefill), stream-nccl")
    p.add_argument("--pages", default="mamba2,hybrid", help="comma-separated: mamba2, hybrid")
    p.add_argument("--dtypes", default="float32,bfloat16", help="SSM state dtypes, comma-separated")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--in-flight", type=int, default=8, help="nccl: requests posted back to back in a timed run")
    p.add_argument("--stream-model", default=None, help="default: Mamba2-2.7B shape (dummy) on CUDA, tiny on CPU")
    p.add_argument("--stream-tokens", type=int, default=2048)
    p.add_argument("--stream-bytes", type=int, default=None,
                   help="nccl streaming: bytes of layers a part holds (default NcclConfig's, 32 MiB; --tiny: 4 KiB)")
    p.add_argument("--tiny", action="store_true", help="tiny page shapes (smoke tests)")
    p.add_argument("--json", default=None, metavar="FILE", help="write every figure to FILE")
    p.set_defaults(func=_bench_transfer)


def _bench_transfer(args: argparse.Namespace) -> int:
    from pd_ssm.bench import transfer

    opts = transfer.TransferBenchOptions(
        connectors=args.connectors.split(","), kinds=args.pages.split(","), dtypes=args.dtypes.split(","),
        shape=transfer.PageShape.tiny() if args.tiny else transfer.PageShape(), repeats=args.repeats, device=args.device,
        in_flight=args.in_flight, stream_model=args.stream_model, stream_tokens=args.stream_tokens,
        stream_bytes=args.stream_bytes if args.stream_bytes is not None else (4096 if args.tiny else None),
    )
    result = transfer.run_transfer_bench(opts, on_row=lambda r: print(
        f"[bench] {r['connector']} {r['pages']} {r['state_dtype']}: {r['gbps']:.2f} GB/s ({r['ratio']:.2f}x baseline)",
        file=sys.stderr, flush=True))
    print(transfer.format_table(result))
    if args.json:
        transfer.write_json(result, args.json)
    return 0


def _add_bench_kernels(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("kernels", help="every kernel at Mamba2-2.7B shapes vs the ceilings and mamba_ssm (CUDA)")
    p.add_argument("--json", default=None, metavar="FILE", help="write every figure to FILE")
    p.set_defaults(func=_bench_kernels)


def _bench_kernels(args: argparse.Namespace) -> int:
    import torch

    from pd_ssm.bench.kernels import run

    if not torch.cuda.is_available():
        print("pd-ssm: error: `bench kernels` needs a CUDA device", file=sys.stderr)
        return 2
    run(args.json)
    return 0


def _bench_engine(args: argparse.Namespace) -> int:
    import json

    from pd_ssm.bench.engine import BenchError, EngineBenchOptions, format_table, run_engine_bench
    from pd_ssm.bench.shapes import DEFAULT_SHAPE

    if args.model is not None and args.shape is not None:
        print("pd-ssm: error: --model and --shape are two models; give one", file=sys.stderr)
        return 2
    opts = EngineBenchOptions(
        model=args.model, shape=args.shape or DEFAULT_SHAPE, load_format=args.load_format,
        kernel_backend=args.kernel_backend, dtype=args.dtype,
        mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype, prefill_tokens=args.prefill_tokens,
        prefill_runs=args.prefill_runs, batch_sizes=[int(b) for b in args.batch_sizes.split(",")],
        decode_steps=args.decode_steps, decode_context=args.decode_context, warmup_steps=args.warmup_steps,
        gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
    )

    def progress(row: Any) -> None:
        print(f"[bench] {row.name}: {row.measured_ms:.3f} ms (floor {row.floor_ms:.3f} ms)", file=sys.stderr, flush=True)

    try:
        result = run_engine_bench(opts, on_row=progress)
    except BenchError as e:
        print(f"pd-ssm: error: {e}", file=sys.stderr)
        return 2
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def _add_bench_serve(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("serve", help="a workload against a running OpenAI-compatible server (pd-ssm, vLLM, "
                                       "SGLang): throughput, TTFT, TPOT, ITL")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (http://host:port)")
    p.add_argument("--launch", default=None, choices=["colocated", "disagg", "both"],
                   help="start the deployment(s) on this machine instead of --base-url (both: colocated, then "
                        "--disagg, same workload), benchmark and stop each; they get --serve-args")
    p.add_argument("--serve-args", default="", metavar="ARGS",
                   help='flags for each launched `pd-ssm serve`, one string, e.g. "--model DIR --device cuda '
                        '--num-prefill 1 --num-decode 1 --connector nccl"')
    p.add_argument("--launch-timeout", type=float, default=120.0,
                   help="seconds a launched deployment has to become healthy (real-size models on a GPU load and "
                        "capture their CUDA graphs first)")
    p.add_argument("--model", default=None, help="default: the first model of the server's /v1/models")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens (random ids)")
    p.add_argument("--output-len", type=int, default=64, help="generated tokens (max_tokens, ignore_eos)")
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len * [1 - r, 1 + r]")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests a second, Poisson arrivals (default inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument("--token-range", default="0:256", help="prompt ids are drawn from [lo, hi)")
    p.add_argument("--no-token-ids", dest="return_token_ids", action="store_false",
                   help="do not ask for token ids in the stream (a server without vLLM's return_token_ids)")
    p.add_argument("--warmup-requests", type=int, default=1, help="untimed short requests sent first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="FILE", help="write the figures and every request to FILE")
    p.set_defaults(func=_bench_serve)


def _bench_serve(args: argparse.Namespace) -> int:
    from pd_ssm.bench.serving import ServeBenchOptions, main_serve
    from pd_ssm.bench.workload import WorkloadSpec

    try:
        lo, hi = (int(v) for v in args.token_range.split(":"))
        opts = ServeBenchOptions(
            base_url=args.base_url, model=args.model, api_key=args.api_key, max_concurrency=args.max_concurrency,
            return_token_ids=args.return_token_ids, warmup_requests=args.warmup_requests,
            workload=WorkloadSpec(num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
                                  range_ratio=args.range_ratio, request_rate=args.request_rate, seed=args.seed,
                                  token_low=lo, token_high=hi),
        )
        kinds = None if args.launch is None else ["colocated", "disagg"] if args.launch == "both" else [args.launch]
        return main_serve(opts, args.json, kinds, shlex.split(args.serve_args), args.launch_timeout)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"pd-ssm: error: bench serve: {e}", file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pd-ssm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text offline with one engine")
    _engine_flags(gen)
    gen.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    bench = sub.add_parser("bench", help="benchmarks: engine, kernels, transfer, serve").add_subparsers(
        dest="bench", required=True)
    _add_bench_engine(bench)
    _add_bench_kernels(bench)
    _add_bench_transfer(bench)
    _add_bench_serve(bench)
    from pd_ssm.orchestrator.serve_cli import add_serve_parser

    add_serve_parser(sub)
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command in ("bench", "serve"):
            return int(args.func(args))
    except Exception as e:  # bad input or a setup this machine cannot run: one clear line, no traceback
        if not _is_setup_error(e):
            raise
        print(f"pd-ssm: error: {e}", file=sys.stderr)
        return 2
    return 1


def _is_setup_error(e: Exception) -> bool:
    from pd_ssm.engine.cuda_graphs import GraphCaptureError
    from pd_ssm.engine.memory_plan import InsufficientMemoryError
    from pd_ssm.kernels.dispatch import KernelNotAvailable
    from pd_ssm.orchestrator.launcher import LaunchError

    return isinstance(e, (ValueError, FileNotFoundError, GraphCaptureError, InsufficientMemoryError,
                          KernelNotAvailable, LaunchError))


if __name__ == "__main__":
    sys.exit(main())
