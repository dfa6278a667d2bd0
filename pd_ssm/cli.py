"""`pd-ssm` command line.  Flags use vLLM's names where the meaning is the same."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence


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
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"])


def _generate(args: argparse.Namespace) -> int:
    from pd_ssm import LLM, SamplingParams

    llm = LLM(
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
    )
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos,
    )
    prompts = args.prompt or ["Hello, my name is"]
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
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
    except (ValueError, FileNotFoundError) as e:  # bad input: one clear line, no traceback
        print(f"pd-ssm: error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
