"""`pd-ssm bench kernels`: every kernel at Mamba2-2.7B shapes against the ceilings and mamba_ssm.

For each kernel and shape: median time (`triton.testing.do_bench`), the bytes it must move and
the FLOPs it must do, achieved GB/s and TFLOP/s as a percentage of the ceilings measured in the
same run (device copy bandwidth, bf16 matmul rate), and the ratio to mamba_ssm's kernel when
`mamba_ssm` is importable ("baseline not available" otherwise).  Prefill kernels are timed as
eager launches (as the engine runs them), and the SSD scan a second time inside a CUDA graph
(`ssd [graph]`: device time alone; an eager call of up to ~8192 tokens is bound by its host time,
mamba_ssm's ~0.5 ms most of all, so the eager ratio there follows the host's speed); the decode
kernels (state update, conv update, paged attention) inside a CUDA graph of 32 calls, as the
engine's decode step runs them, for ours and the baseline alike.  The hybrid layers' attention
kernels run at a Bamba-9B layer's shape (mamba_ssm has no attention kernel), beside torch SDPA on one
dense fresh causal sequence: the one case SDPA could take over from the paged prefill kernel (it is
faster there; benchmarks/NOTES_small_kernels.md says why the engine does not route to it).
Inputs are random, never zeros,
and small cases rotate through several input sets larger than L2 so the cache is not measured.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

# Mamba2-2.7B
NH, HD, DS, NG, CHUNK, WIDTH = 80, 64, 128, 1, 256, 4
D_INNER = NH * HD
CONV_DIM = D_INNER + 2 * NG * DS
# the attention layers of a hybrid model (Bamba-9B's): GQA, KV pages of 16 tokens
ATT_HEADS, ATT_KV_HEADS, ATT_HEAD_DIM, ATT_BLOCK = 32, 8, 128, 16
L2_BYTES = 60 << 20


@dataclass(slots=True)
class Row:
    kernel: str
    shape: str
    ms: float
    gbps: float
    pct_copy: float
    tflops: float
    pct_mma: float
    baseline_ms: float | None
    speedup: float | None
    note: str = ""


def _bench(fn: Callable[[int], Any], n_sets: int) -> float:
    import triton.testing

    i = [0]

    def call() -> None:
        fn(i[0] % n_sets)
        i[0] += 1

    return float(triton.testing.do_bench(call, warmup=50, rep=300, return_mode="median"))


def _bench_graph(fn: Callable[[int], Any], n_sets: int, calls: int = 32) -> float:
    """GPU time per call with launch overhead removed: `calls` calls captured in one CUDA graph
    (how the decode path runs them), replayed; rotating through the input sets as `_bench`."""
    import triton.testing

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up outside the capture
        for i in range(n_sets):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i % n_sets)
    return float(triton.testing.do_bench(graph.replay, warmup=50, rep=300, return_mode="median")) / calls


def measure_ceilings(dev: torch.device) -> tuple[float, float]:
    """(copy GB/s counting read + write, bf16 matmul TFLOP/s), measured now."""
    import triton.testing

    src = torch.randn(512 << 20 >> 2, device=dev)  # 512 MB
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    copy = 2 * src.numel() * 4 / ms / 1e6
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ b, return_mode="median")
    return copy, 2 * 8192**3 / ms / 1e9


def _offsets(lens: list[int], dev: torch.device) -> torch.Tensor:
    """cu_seqlens of sequences of these lengths: [S + 1] int32, from 0."""
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)


def _sets(nbytes_one: int) -> int:
    return max(1, min(8, math.ceil(3 * L2_BYTES / max(nbytes_one, 1))))


def _baseline() -> Any | None:
    try:
        from mamba_ssm.ops.triton import selective_state_update as ssu_mod
        from mamba_ssm.ops.triton import ssd_combined
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None
    return type("Baseline", (), {"ssd": ssd_combined.mamba_chunk_scan_combined, "ssu": ssu_mod.selective_state_update})


def bench_ssd(k: Any, base: Any, dev: torch.device, lens: list[int], ctx: list[int],
              graph: bool = False) -> tuple[float, float | None, int, float]:
    """Eager median ms of ours and the baseline, or with `graph` their device time inside a CUDA
    graph (a baseline that cannot be captured: None)."""
    T, S = sum(lens), len(lens)
    g = torch.Generator(device=dev).manual_seed(0)
    n = _sets(T * (2 * D_INNER + 4 * DS) * 2)

    def rnd(*shape: int, dtype: torch.dtype = torch.bfloat16, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=dev) * scale).to(dtype)

    xs = [rnd(T, NH, HD) for _ in range(n)]
    dts = [rnd(T, NH, scale=0.5) for _ in range(n)]
    Bs = [rnd(T, NG, DS) for _ in range(n)]
    Cs = [rnd(T, NG, DS) for _ in range(n)]
    A = -torch.rand(NH, device=dev, generator=g) * 4 - 0.5
    D = torch.rand(NH, device=dev, generator=g)
    dt_bias = torch.rand(NH, device=dev, generator=g) - 3
    pool = torch.randn(S + 1, NH, HD, DS, device=dev, generator=g)
    cu = _offsets(lens, dev)
    cl = torch.tensor(ctx, dtype=torch.int32, device=dev)
    idx = torch.arange(S, dtype=torch.int32, device=dev)
    has = cl > 0

    def ours(i: int) -> None:
        k.mamba_chunk_scan_varlen(xs[i], dts[i], A, Bs[i], Cs[i], CHUNK, cu_seqlens=cu, context_lens=cl,
                                  ssm_state=pool, state_indices=idx, has_initial_state=has, D=D, dt_bias=dt_bias,
                                  dt_softplus=True)

    # NOTE: a few calls a graph: each holds its own scratch (~1 GB at 32768 tokens)
    timer = functools.partial(_bench_graph, calls=4) if graph else _bench
    ms = timer(ours, n)
    base_ms = None
    if base is not None:
        init = torch.randn(S, NH, HD, DS, device=dev, generator=g) if any(ctx) else None
        if S == 1:
            def theirs(i: int) -> None:
                base.ssd(xs[i][None], dts[i][None], A, Bs[i][None], Cs[i][None], CHUNK, D=D, dt_bias=dt_bias,
                         initial_states=init, dt_softplus=True, return_final_states=True)
        else:  # the baseline takes per-sequence initial states only as a padded batch
            L = max(lens)
            def theirs(i: int) -> None:
                base.ssd(xs[i].view(S, L, NH, HD), dts[i].view(S, L, NH), A, Bs[i].view(S, L, NG, DS),
                         Cs[i].view(S, L, NG, DS), CHUNK, D=D, dt_bias=dt_bias, initial_states=init,
                         dt_softplus=True, return_final_states=True)
        try:
            base_ms = timer(theirs, n)
        except RuntimeError:  # a host sync inside its call breaks the capture
            if not graph:
                raise
            torch.cuda.synchronize()
    nbytes = T * (2 * D_INNER * 2 + 2 * NG * DS * 2 + NH * 2) + 2 * S * NH * HD * DS * 4
    # per head and chunk of L tokens: C B^T (2 L^2 ds), its product with x (2 L^2 hd), the chunk
    # state (2 L hd ds) and the state's contribution to the output (2 L hd ds)
    flops = NH * T * (2 * CHUNK * DS + 2 * CHUNK * HD + 4 * HD * DS)
    return ms, base_ms, nbytes, flops


def bench_ssu(k: Any, base: Any, dev: torch.device, batch: int) -> tuple[float, float | None, int, float]:
    g = torch.Generator(device=dev).manual_seed(1)
    slots = batch * 2
    state_bytes = slots * NH * HD * DS * 4
    n = _sets(state_bytes)
    pools = [torch.randn(slots, NH, HD, DS, device=dev, generator=g) for _ in range(n)]
    x = torch.randn(batch, NH, HD, device=dev, generator=g).bfloat16()
    dt = torch.randn(batch, NH, device=dev, generator=g).bfloat16()
    A = -torch.rand(NH, device=dev, generator=g) - 0.5
    B = torch.randn(batch, NG, DS, device=dev, generator=g).bfloat16()
    C = torch.randn(batch, NG, DS, device=dev, generator=g).bfloat16()
    D = torch.rand(NH, device=dev, generator=g)
    dt_bias = torch.rand(NH, device=dev, generator=g) - 3
    idx = torch.randperm(slots, device=dev, generator=g)[:batch].to(torch.int32)

    def ours(i: int) -> None:
        k.selective_state_update(pools[i], x, dt, A, B, C, state_indices=idx, D=D, dt_bias=dt_bias, dt_softplus=True)

    # decode kernels run inside CUDA graphs: time them there, both ours and the baseline
    ms = _bench_graph(ours, n)
    base_ms = None
    if base is not None:
        A_e = A[:, None, None].expand(NH, HD, DS)
        dt_e = dt[:, :, None].expand(batch, NH, HD)
        D_e = D[:, None].expand(NH, HD)
        bias_e = dt_bias[:, None].expand(NH, HD)
        def theirs(i: int) -> None:
            base.ssu(pools[i], x, dt_e, A_e, B, C, D=D_e, dt_bias=bias_e, dt_softplus=True, state_batch_indices=idx)

        try:
            base_ms = _bench_graph(theirs, n)
        except RuntimeError:  # a baseline that cannot be captured is timed eagerly instead
            torch.cuda.synchronize()
            base_ms = _bench(theirs, n)
    nbytes = 2 * batch * NH * HD * DS * 4 + batch * (2 * D_INNER * 2 + 2 * NG * DS * 2)
    return ms, base_ms, nbytes, 3.0 * batch * NH * HD * DS * 2


def bench_conv_update(k: Any, dev: torch.device, batch: int) -> tuple[float, None, int, float]:
    g = torch.Generator(device=dev).manual_seed(2)
    slots = batch * 2
    n = _sets(slots * CONV_DIM * (WIDTH - 1) * 2)
    pools = [torch.randn(slots, CONV_DIM, WIDTH - 1, device=dev, generator=g).bfloat16() for _ in range(n)]
    x = torch.randn(batch, CONV_DIM, device=dev, generator=g).bfloat16()
    w = torch.randn(CONV_DIM, WIDTH, device=dev, generator=g).bfloat16()
    b = torch.randn(CONV_DIM, device=dev, generator=g).bfloat16()
    idx = torch.randperm(slots, device=dev, generator=g)[:batch].to(torch.int32)
    ms = _bench_graph(lambda i: k.causal_conv1d_update(x, pools[i], w, b, state_indices=idx), n)
    nbytes = batch * CONV_DIM * 2 * (2 * (WIDTH - 1) + 2)
    return ms, None, nbytes, 2.0 * batch * CONV_DIM * WIDTH


def bench_gated_norm(k: Any, dev: torch.device, T: int, groups: int = NG) -> tuple[float, None, int, float]:
    g = torch.Generator(device=dev).manual_seed(3)
    n = _sets(T * D_INNER * 2 * 3)
    xs = [torch.randn(T, D_INNER, device=dev, generator=g).bfloat16() for _ in range(n)]
    z = torch.randn(T, D_INNER, device=dev, generator=g).bfloat16()
    w = torch.rand(D_INNER, device=dev, generator=g).bfloat16()
    ms = _bench(lambda i: k.rms_norm_gated(xs[i], z, w, 1e-5, D_INNER // groups), n)
    return ms, None, 3 * T * D_INNER * 2, 6.0 * T * D_INNER


def bench_mlp_act(k: Any, dev: torch.device, T: int, width: int, act: str, gated: bool) -> tuple[float, None, int, float]:
    """The FFN activation of a hybrid's MLP: act(gate) * up (Bamba-9B: silu, I 14336) or act(x)
    (Nemotron-H-8B: relu2, 21504), bf16."""
    g = torch.Generator(device=dev).manual_seed(6)
    cols = (2 if gated else 1) * width
    n = _sets(T * (cols + width) * 2)
    xs = [torch.randn(T, cols, device=dev, generator=g).bfloat16() for _ in range(n)]
    ms = _bench(lambda i: k.mlp_act(xs[i], act, gated=gated), n)
    return ms, None, T * (cols + width) * 2, (6.0 if gated else 4.0) * T * width


def bench_conv_varlen(k: Any, dev: torch.device, lens: list[int], init: bool) -> tuple[float, None, int, float]:
    """The prefill conv over a varlen batch, each sequence from its slot's history (`init`) or zeros."""
    g = torch.Generator(device=dev).manual_seed(4)
    T, S = sum(lens), len(lens)
    n = _sets(T * CONV_DIM * 2 * 2)
    xs = [torch.randn(T, CONV_DIM, device=dev, generator=g).bfloat16() for _ in range(n)]
    w = torch.randn(CONV_DIM, WIDTH, device=dev, generator=g).bfloat16()
    b = torch.randn(CONV_DIM, device=dev, generator=g).bfloat16()
    pool = torch.randn(2 * S, CONV_DIM, WIDTH - 1, device=dev, generator=g).bfloat16()
    cu = _offsets(lens, dev)
    idx = torch.randperm(2 * S, device=dev, generator=g)[:S].to(torch.int32)
    has = torch.full((S,), init, dtype=torch.bool, device=dev)
    ms = _bench(lambda i: k.causal_conv1d_varlen(xs[i], w, b, pool, cu_seqlens=cu, state_indices=idx,
                                                 has_initial_state=has), n)
    nbytes = T * CONV_DIM * 2 * 2 + S * CONV_DIM * (WIDTH - 1) * 2 * (2 if init else 1)
    return ms, None, nbytes, 2.0 * T * CONV_DIM * WIDTH


def _paged_kv(dev: torch.device, g: torch.Generator, lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K and V caches holding `lens` tokens a sequence in shuffled blocks, and the block tables."""
    per_seq = [math.ceil(n / ATT_BLOCK) for n in lens]
    blocks = sum(per_seq)
    k_cache = torch.randn(blocks, ATT_BLOCK, ATT_KV_HEADS, ATT_HEAD_DIM, device=dev, generator=g).bfloat16()
    v_cache = torch.randn(blocks, ATT_BLOCK, ATT_KV_HEADS, ATT_HEAD_DIM, device=dev, generator=g).bfloat16()
    order = torch.randperm(blocks, device=dev, generator=g).to(torch.int32)
    tables = torch.zeros(len(lens), max(per_seq), dtype=torch.int32, device=dev)
    at = 0
    for s, nb in enumerate(per_seq):
        tables[s, :nb] = order[at:at + nb]
        at += nb
    return k_cache, v_cache, tables


def bench_decode_attention(k: Any, dev: torch.device, batch: int, ctx: int) -> tuple[float, None, int, float]:
    """One new token a sequence against `ctx` tokens of paged context (a hybrid model's attention
    layer: 32 query heads on 8 KV heads of 128), inside a CUDA graph as the decode step runs it."""
    g = torch.Generator(device=dev).manual_seed(5)
    nbytes = 2 * batch * ctx * ATT_KV_HEADS * ATT_HEAD_DIM * 2 + 2 * batch * ATT_HEADS * ATT_HEAD_DIM * 2
    sets = [_paged_kv(dev, g, [ctx] * batch) for _ in range(_sets(nbytes))]
    q = torch.randn(batch, ATT_HEADS, ATT_HEAD_DIM, device=dev, generator=g).bfloat16()
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    scale = ATT_HEAD_DIM ** -0.5
    ms = _bench_graph(lambda i: k.paged_decode_attention(q, sets[i][0], sets[i][1], seq_lens=lens,
                                                         block_tables=sets[i][2], scale=scale), len(sets))
    return ms, None, nbytes, 4.0 * batch * ATT_HEADS * ctx * ATT_HEAD_DIM


def _causal_keys(q_lens: list[int], ctx: list[int]) -> int:
    """Query-key pairs of causal attention: query i of a chunk after c tokens sees c + i + 1 keys."""
    return sum(n * c + n * (n + 1) // 2 for n, c in zip(q_lens, ctx, strict=True))


def bench_prefill_attention(k: Any, dev: torch.device, q_lens: list[int],
                            ctx: list[int]) -> tuple[float, None, int, float]:
    """Causal attention of prefill chunks of `q_lens` tokens after `ctx` tokens of paged context."""
    g = torch.Generator(device=dev).manual_seed(6)
    T, seq_lens = sum(q_lens), [c + n for n, c in zip(q_lens, ctx, strict=True)]
    nbytes = 2 * T * ATT_HEADS * ATT_HEAD_DIM * 2 + 2 * sum(seq_lens) * ATT_KV_HEADS * ATT_HEAD_DIM * 2
    n = _sets(nbytes)
    sets = [_paged_kv(dev, g, seq_lens) for _ in range(n)]
    qs = [torch.randn(T, ATT_HEADS, ATT_HEAD_DIM, device=dev, generator=g).bfloat16() for _ in range(n)]
    cu = _offsets(q_lens, dev)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    scale = ATT_HEAD_DIM ** -0.5
    ms = _bench(lambda i: k.varlen_prefill_attention(qs[i], sets[i][0], sets[i][1], cu_seqlens_q=cu, seq_lens=lens,
                                                     block_tables=sets[i][2], scale=scale), n)
    return ms, None, nbytes, 4.0 * ATT_HEADS * ATT_HEAD_DIM * _causal_keys(q_lens, ctx)


def bench_sdpa_prefill(dev: torch.device, T: int) -> tuple[float, None, int, float]:
    """torch's SDPA on one dense causal sequence with no context (its flash path, the case most in its
    favour): the reference for `bench_prefill_attention`'s 1 x T row."""
    g = torch.Generator(device=dev).manual_seed(7)
    nbytes = 2 * T * ATT_HEADS * ATT_HEAD_DIM * 2 + 2 * T * ATT_KV_HEADS * ATT_HEAD_DIM * 2
    n = _sets(nbytes)
    qs = [torch.randn(1, ATT_HEADS, T, ATT_HEAD_DIM, device=dev, generator=g).bfloat16() for _ in range(n)]
    # NOTE: K and V repeated to the query heads beforehand (untimed): flash takes no GQA
    kvs = [torch.randn(2, 1, ATT_KV_HEADS, T, ATT_HEAD_DIM, device=dev, generator=g).bfloat16()
           .repeat_interleave(ATT_HEADS // ATT_KV_HEADS, dim=2) for _ in range(n)]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    ms = _bench(lambda i: sdpa(qs[i], kvs[i][0], kvs[i][1], is_causal=True), n)
    return ms, None, nbytes, 4.0 * ATT_HEADS * ATT_HEAD_DIM * _causal_keys([T], [0])


def _baseline_note(kernel: str, importable: bool, base_ms: float | None) -> str:
    if kernel not in ("ssd", "ssd [graph]", "selective_state_update [graph]"):
        return ""
    if not importable:
        return "baseline not available"
    return "" if base_ms is not None else "baseline not capturable"


def run(json_path: str | None = None) -> list[Row]:
    if not torch.cuda.is_available():
        raise RuntimeError("`pd-ssm bench kernels` needs a CUDA device")
    from pd_ssm.kernels.dispatch import get_kernels

    dev = torch.device("cuda")
    k = get_kernels("triton", dev)
    base = _baseline()
    copy_gbps, mma_tflops = measure_ceilings(dev)
    ssd_shapes = [
        ("1x2048", [2048], [0]), ("1x8192", [8192], [0]), ("1x32768", [32768], [0]),
        ("16x1024 init, aligned", [1024] * 16, [256 * (i + 1) for i in range(16)]),
        ("16x1024 init, mid-chunk", [1024] * 16, [37 * i + 5 for i in range(16)]),
    ]
    cases: list[tuple[str, str, Callable[[], tuple[float, float | None, int, float]]]] = [
        (name, shape, functools.partial(bench_ssd, k, base, dev, lens, ctx, graph=graph))
        for name, graph in (("ssd", False), ("ssd [graph]", True)) for shape, lens, ctx in ssd_shapes
    ]
    for b in (1, 64, 256):
        cases.append(("selective_state_update [graph]", f"batch {b}", functools.partial(bench_ssu, k, base, dev, b)))
    for b in (1, 256):
        cases.append(("causal_conv1d_update [graph]", f"batch {b}", functools.partial(bench_conv_update, k, dev, b)))
    cases.append(("rms_norm_gated", "2048 tokens", lambda: bench_gated_norm(k, dev, 2048)))
    cases.append(("rms_norm_gated", "2048 tokens, 8 groups", lambda: bench_gated_norm(k, dev, 2048, 8)))
    for T in (32, 2048):
        cases.append(("mlp_act silu gated", f"{T} tokens x 14336",
                      functools.partial(bench_mlp_act, k, dev, T, 14336, "silu", True)))
        cases.append(("mlp_act relu2", f"{T} tokens x 21504",
                      functools.partial(bench_mlp_act, k, dev, T, 21504, "relu2", False)))
    for shape, lens, init in (("1x2048", [2048], False), ("16x1024 init", [1024] * 16, True)):
        cases.append(("causal_conv1d_varlen", shape, functools.partial(bench_conv_varlen, k, dev, lens, init)))
    for b in (1, 64):
        cases.append(("paged_decode_attention [graph]", f"batch {b}, ctx 4096",
                      functools.partial(bench_decode_attention, k, dev, b, 4096)))
    for shape, q_lens, ctx in (("1x2048", [2048], [0]), ("4x512 after 1536", [512] * 4, [1536] * 4)):
        cases.append(("varlen_prefill_attention", shape,
                      functools.partial(bench_prefill_attention, k, dev, q_lens, ctx)))
    cases.append(("torch SDPA (dense, flash)", "1x2048", lambda: bench_sdpa_prefill(dev, 2048)))
    rows: list[Row] = []
    for name, shape, fn in cases:
        ms, base_ms, nbytes, flops = fn()
        gbps = nbytes / ms / 1e6
        tflops = flops / ms / 1e9
        rows.append(Row(name, shape, ms, gbps, 100 * gbps / copy_gbps, tflops, 100 * tflops / mma_tflops,
                        base_ms, base_ms / ms if base_ms else None,
                        _baseline_note(name, base is not None, base_ms)))
    print(f"ceilings: copy {copy_gbps:.0f} GB/s, bf16 matmul {mma_tflops:.0f} TFLOP/s")
    print(f"{'kernel':<32}{'shape':<26}{'ms':>9}{'GB/s':>9}{'%copy':>7}{'TFLOP/s':>9}{'%mma':>6}"
          f"{'mamba_ssm ms':>14}{'speedup':>9}")
    for r in rows:
        bms = f"{r.baseline_ms:.4f}" if r.baseline_ms else (r.note or "-")
        sp = f"{r.speedup:.2f}x" if r.speedup else "-"
        print(f"{r.kernel:<32}{r.shape:<26}{r.ms:>9.4f}{r.gbps:>9.0f}{r.pct_copy:>7.1f}{r.tflops:>9.1f}"
              f"{r.pct_mma:>6.1f}{bms:>14}{sp:>9}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"copy_gbps": copy_gbps, "bf16_mma_tflops": mma_tflops, "device": torch.cuda.get_device_name(),
                       "rows": [asdict(r) for r in rows]}, f, indent=2)
    return rows
