"""Where an eager whole-model step spends its host time: cProfile of eager prefill steps (2048
tokens) and eager decode steps (batch 1) of the Mamba2-2.7B shape with dummy weights. A colocated
engine's steps that mix decodes and prefill chunks run eagerly, and there the host, not the GPU,
sets the step time (`pd-ssm bench engine --enforce-eager`: ~45-77 ms for a 2048-token prefill
against ~26 ms of GPU time, RESULTS.md session 17).

    PYTHONPATH=. python3 benchmarks/host_profile_engine_gpu.py     # CUDA; $OUT/host_profile.txt

Then an A/B in the same process (HOST_AB_ROUNDS rounds, default 4): the same eager steps with
FastKernel's direct launches off (every kernel through Triton's own launch path) and on,
alternating; $OUT/host_ab.json.
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_engine_gpu import eager_engine_2_7b  # noqa: E402

from pd_ssm.kernels.launch import FastKernel  # noqa: E402
from pd_ssm.sampling_params import SamplingParams  # noqa: E402


def main() -> None:
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    engine = eager_engine_2_7b(max_num_seqs=8)
    gen = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    text: list[str] = []

    def prefill() -> float:
        engine.add_request(torch.randint(1, vocab, (2048,), generator=gen).tolist(),
                           SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.step()
        return 1e3 * (time.perf_counter() - t0)

    for _ in range(3):
        prefill()
    walls = [prefill() for _ in range(3)]
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(3):
        prefill()
    prof.disable()
    text.append(f"eager prefill 2048 wall ms: {[round(w, 2) for w in walls]}")
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(45)
        text.append(f"--- prefill, 3 steps, by {key} ---\n" + buf.getvalue())
    # eager decode, batch 1
    engine.add_request(torch.randint(1, vocab, (16,), generator=gen).tolist(),
                       SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    for _ in range(10):
        engine.step()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(10):
        engine.step()
    prof.disable()
    text.append(f"eager decode b1 ms/step (profiled): {1e3 * (time.perf_counter() - t0) / 10:.2f}")
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(40)
    text.append("--- decode b1, 10 steps, by tottime ---\n" + buf.getvalue())
    (out / "host_profile.txt").write_text("\n".join(text))
    print("\n".join(text)[:3000])

    def decode_ms(steps: int = 10) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        return 1e3 * (time.perf_counter() - t0) / steps

    ab: dict[str, dict[str, list[float]]] = {k: {"prefill_ms": [], "decode_b1_ms": []} for k in ("triton", "fast")}
    for r in list(engine.requests):
        engine.abort(r)
    for _ in range(int(os.environ.get("HOST_AB_ROUNDS", "4"))):
        for name, enabled in (("triton", False), ("fast", True)):
            FastKernel.enabled = enabled
            prefill()  # one step on this path first
            ab[name]["prefill_ms"].append(statistics.median([prefill() for _ in range(3)]))
            engine.add_request(torch.randint(1, vocab, (16,), generator=gen).tolist(),
                               SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
            decode_ms(3)
            ab[name]["decode_b1_ms"].append(decode_ms())
            for r in list(engine.requests):
                engine.abort(r)
    FastKernel.enabled = True
    summary = {n: {k: statistics.median(v) for k, v in d.items()} for n, d in ab.items()}
    (out / "host_ab.json").write_text(json.dumps(dict(rounds=ab, medians=summary), indent=1))
    print("eager steps, Triton's launch path against FastKernel's, medians:", summary)


if __name__ == "__main__":
    main()
