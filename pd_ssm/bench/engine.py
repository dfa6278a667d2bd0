"""`pd-ssm bench engine`: whole-model prefill and decode steps against their roofline floors.

The model is a real shape with dummy weights (`--shape`, shapes.py: Mamba2-2.7B by default,
Bamba-9B, NemotronH-8B) or `--model DIR`; bf16 activations, fp32 SSM state, on CUDA.  Every timed
step is a real `Engine.step()` (schedule -> run -> sample -> outputs) on synthetic requests of
random tokens.  Every step call reads a step's tokens on the host, so over many calls the host
clock measures whole steps: with async scheduling (the default; `--no-async-scheduling` to
compare) a decode step runs on the GPU while the host reads and detokenizes the one before, and
the median call is the period of that pipeline.

  prefill   one request of `prefill_tokens` tokens, batch 1, max_tokens 1: one step prefills it
            and samples its first token; median of several runs
  decode    `batch` requests past their prefill of `decode_context` tokens (the KV the attention
            layers of a hybrid read grows with it); median ms/step over many steady-state steps,
            through the CUDA graphs unless --enforce-eager; twice per batch: with text (each
            step detokenizes every request, cumulative outputs) and "ids only" (detokenize=False,
            output_kind="delta": what a decode worker streaming token ids to a router that makes
            the text runs, as vLLM's engine core does)

Floors (roofline.py; ceilings measured in the same run, TARGETS.md). Targets: decode <= 1.25 x
floor; prefill of 2048 tokens <= 30 ms.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from pd_ssm.bench.roofline import decode_floor_bytes, model_bytes, prefill_floor
from pd_ssm.bench.shapes import DEFAULT_SHAPE, SHAPES, write_shape

DECODE_TARGET = 1.25  # x floor
PREFILL_TARGET_MS = 30.0  # for 2048 tokens


class BenchError(RuntimeError):
    """The benchmark cannot run here; the message says why."""


@dataclass(slots=True)
class EngineBenchOptions:
    model: str | None = None  # None: `shape`, dummy weights
    shape: str = DEFAULT_SHAPE  # a name of shapes.SHAPES
    load_format: str | None = None  # None: dummy without --model, auto with it
    kernel_backend: str = "auto"
    dtype: str = "bfloat16"
    mamba_ssm_cache_dtype: str = "float32"
    prefill_tokens: int = 2048
    prefill_runs: int = 7
    batch_sizes: list[int] = field(default_factory=lambda: [1, 32, 128])
    decode_steps: int = 60
    decode_context: int = 16  # prompt tokens of each decode request
    warmup_steps: int = 8
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    async_scheduling: bool = True
    seed: int = 0


@dataclass(slots=True)
class BenchRow:
    name: str
    measured_ms: float
    floor_ms: float
    floor_kind: str  # "memory" | "matmul"
    target: str
    met: bool | None  # None: no target for this model (the prefill target is the 2.7B shape's)
    bytes_moved: int
    note: str = ""

    @property
    def ratio(self) -> float:
        return self.measured_ms / self.floor_ms


def format_table(result: dict[str, Any]) -> str:
    rows = [BenchRow(**r) for r in result["rows"]]
    head = (
        f"pd-ssm bench engine: {result['device']}, {result['model']} ({result['params'] / 1e9:.2f} G params, "
        f"{result['load_format']}), {result['dtype']}, SSM state {result['mamba_ssm_cache_dtype']}, "
        f"kernels {result['kernel_backend']}, CUDA graphs {'on' if result['cuda_graphs'] else 'off'}, "
        f"async scheduling {'on' if result.get('async_scheduling') else 'off'}\n"
        f"ceilings: copy {result['copy_gbps']:.0f} GB/s, bf16 matmul {result['matmul_tflops']:.0f} TFLOP/s"
    )
    lines = [head, f"{'step':<28}{'ms':>10}{'floor ms':>10}{'floor':>8}{'x floor':>9}  {'target':<16}{'met':<4}"]
    for r in rows:
        lines.append(f"{r.name:<28}{r.measured_ms:>10.3f}{r.floor_ms:>10.3f}{r.floor_kind:>8}{r.ratio:>9.2f}  "
                     f"{r.target:<16}{'-' if r.met is None else 'yes' if r.met else 'no':<4}{('  ' + r.note) if r.note else ''}")
    return "\n".join(lines)


def decode_max_tokens(batch: int, context: int, budget: int, steps: int) -> int:
    """max_tokens for `batch` decode requests with prompts of `context` tokens that must all still
    run `steps` decode steps after the last prompt is prefilled: the first prompts decode while the
    later ones prefill (each step shares `budget` tokens between them)."""
    prefill_steps = -(-batch * context // max(budget - batch, 1)) + 1
    return prefill_steps + steps


def finish_prefills(engine: Any) -> None:
    """Step `engine` until no request waits or prefills (several steps when the prompts are long)."""
    sched = engine.scheduler
    while sched.num_waiting or (sched.prefill is not None and sched.prefill.prefilling):
        engine.step()


def _median_ms(seconds: list[float]) -> float:
    return 1e3 * statistics.median(seconds)


def run_engine_bench(opts: EngineBenchOptions, on_row: Callable[[BenchRow], None] | None = None) -> dict[str, Any]:
    """Build the engine, measure the ceilings and every step; `on_row` sees each row as it is done."""
    if opts.model is None and opts.shape not in SHAPES:
        raise BenchError(f"unknown shape {opts.shape!r}; known: {', '.join(SHAPES)}")
    if opts.decode_context < 1:
        raise BenchError(f"decode_context must be >= 1 token, not {opts.decode_context}")
    if not torch.cuda.is_available():
        raise BenchError("`pd-ssm bench engine` needs a CUDA device; torch sees none here")
    from pd_ssm.bench.kernels import measure_ceilings
    from pd_ssm.config import CacheConfig, EngineConfig, SchedulerConfig
    from pd_ssm.engine.engine import Engine
    from pd_ssm.engine.memory_plan import kv_block_bytes, state_slot_bytes

    dev = torch.device("cuda")
    copy_gbps, mma_tflops = measure_ceilings(dev)  # before the engine takes its share of memory
    torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = opts.model
        if model_dir is None:
            model_dir = write_shape(opts.shape, tmp)
        load_format = opts.load_format or ("dummy" if opts.model is None else "auto")
        max_batch = max(opts.batch_sizes)
        budget = max(opts.prefill_tokens, 2048)  # tokens a step
        config = EngineConfig(
            model=model_dir,
            device="cuda",
            dtype=opts.dtype,
            load_format=load_format,
            kernel_backend=opts.kernel_backend,
            seed=opts.seed,
            gpu_memory_utilization=opts.gpu_memory_utilization,
            enforce_eager=opts.enforce_eager,
            async_scheduling=opts.async_scheduling,
            cache=CacheConfig(mamba_ssm_cache_dtype=opts.mamba_ssm_cache_dtype),  # type: ignore[arg-type]
            scheduler=SchedulerConfig(max_num_seqs=max_batch, max_num_batched_tokens=budget),
        )
        t0 = time.perf_counter()
        engine = Engine(config)
        build_s = time.perf_counter() - t0
    mc, cc = engine.model_config, engine.config.cache
    bs = cc.block_size
    mb = model_bytes(engine.model, state_slot_bytes(mc, cc, engine.dtype), kv_block_bytes(mc, cc, engine.dtype) // bs)
    copy_bps, mma_fps = copy_gbps * 1e9, mma_tflops * 1e12
    gen = torch.Generator().manual_seed(opts.seed)
    vocab = mc.vocab_size

    def prompt(n: int) -> list[int]:
        return torch.randint(1, vocab, (n,), generator=gen).tolist()

    from pd_ssm.sampling_params import SamplingParams

    # the host's time to queue each step (inputs, graph replay, sampling), beside the whole step
    runner_clock: list[float] = []
    launch = engine.runner.launch

    def timed_launch(*args: Any) -> Any:
        t0 = time.perf_counter()
        out = launch(*args)
        runner_clock.append(time.perf_counter() - t0)
        return out

    engine.runner.launch = timed_launch  # type: ignore[method-assign,assignment]
    rows: list[BenchRow] = []
    # --- prefill -------------------------------------------------------------------------
    T = opts.prefill_tokens
    times: list[float] = []
    run_times: list[float] = []
    for i in range(opts.prefill_runs + 2):
        engine.add_request(prompt(T), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        if not (len(outs) == 1 and outs[0].finished):
            raise BenchError(f"the {T}-token prefill did not finish in one step (max_num_batched_tokens too small?)")
        if i >= 2:  # the first two warm up (allocator, kernel compilation)
            times.append(dt)
            run_times.append(runner_clock[-1])
        runner_clock.clear()
    floor_s, kind, nbytes = prefill_floor(mb, T, copy_bps, mma_fps)
    ms = _median_ms(times)
    target_ms = PREFILL_TARGET_MS * T / 2048
    # NOTE: TARGETS.md's prefill target is the Mamba2-2.7B shape's; other models show their floor only
    has_target = opts.model is None and opts.shape == DEFAULT_SHAPE
    rows.append(BenchRow(f"prefill {T} tok, batch 1", ms, 1e3 * floor_s, kind,
                         f"<= {target_ms:.0f} ms" if has_target else "-", ms <= target_ms if has_target else None,
                         nbytes, f"launch {_median_ms(run_times):.3f} ms"))
    if on_row is not None:
        on_row(rows[-1])
    # --- decode --------------------------------------------------------------------------
    graphs = engine.runner.graphs
    passes = [(batch, detok) for batch in opts.batch_sizes for detok in (True, False)]
    for batch, detokenize in passes:
        max_tokens = decode_max_tokens(batch, opts.decode_context, budget, opts.warmup_steps + opts.decode_steps + 4)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                detokenize=detokenize, output_kind="cumulative" if detokenize else "delta")
        ids = [engine.add_request(prompt(opts.decode_context), params).req_id for _ in range(batch)]
        finish_prefills(engine)
        for _ in range(opts.warmup_steps):
            engine.step()
        runner_clock.clear()
        replays = graphs.replays if graphs is not None else 0
        if any(r not in engine.requests for r in ids):
            raise BenchError(f"a decode request of batch {batch} finished before its timed steps")
        kv_read = sum(engine.requests[r].num_tokens for r in ids)  # context attended over, first timed step
        times, run_times = [], []
        for _ in range(opts.decode_steps):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
            run_times.append(runner_clock.pop())
        via_graphs = graphs is not None and graphs.replays - replays == opts.decode_steps
        for req_id in ids:
            engine.abort(req_id)
        # NOTE: the KV read grows by `batch` tokens a step; take the middle of the window
        nbytes = decode_floor_bytes(mb, batch, kv_read + batch * opts.decode_steps // 2)
        ms = _median_ms(times)
        floor_ms = 1e3 * nbytes / copy_bps
        note = f"launch {_median_ms(run_times):.3f} ms" + ("" if via_graphs else ", eager")
        name = f"decode batch {batch}" + ("" if detokenize else ", ids only")
        rows.append(BenchRow(name, ms, floor_ms, "memory", f"<= {DECODE_TARGET} x floor",
                             ms <= DECODE_TARGET * floor_ms, nbytes, note))
        if on_row is not None:
            on_row(rows[-1])
    params_count = sum(p.numel() for p in engine.model.parameters())
    return {
        "device": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "model": opts.model or f"{opts.shape} shape",
        "architecture": mc.architecture,
        "params": params_count,
        "load_format": load_format,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "mamba_ssm_cache_dtype": str(cc.mamba_ssm_cache_dtype).removeprefix("torch."),
        "kernel_backend": engine.kernels.backend,
        "cuda_graphs": graphs is not None,
        "async_scheduling": engine.async_scheduling,
        "graph_sizes": graphs.sizes if graphs is not None else [],
        "graph_capture_s": graphs.capture_seconds if graphs is not None else 0.0,
        "engine_build_s": build_s,
        "memory_plan": engine.memory_plan.describe() if engine.memory_plan is not None else None,
        "copy_gbps": copy_gbps,
        "matmul_tflops": mma_tflops,
        "model_bytes": asdict(mb),
        "options": asdict(opts),
        "rows": [asdict(r) for r in rows],
    }
