"""Not a test: run on a CUDA machine (`PYTHONPATH=. python3 tests/models/gpu_smoke.py`) to check that
every model builds, loads and runs on the GPU with the torch reference kernels, fp32 and bf16:
GPU logits must equal the CPU run's (prefill batch, then one decode step per sequence); the error
against that machine's transformers is printed for information (its version may differ)."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from harness import (  # noqa: E402
    CONFIGS,
    StepRunner,
    hf_logits,
    load_pd,
    make_hf_model,
    rel_err,
    save_checkpoint,
)


def run(model, prompts: list[list[int]]) -> list[torch.Tensor]:
    runner = StepRunner(model)
    for i in range(len(prompts)):
        runner.add(f"s{i}", slot=i)
    outs = runner.step([(f"s{i}", p, False) for i, p in enumerate(prompts)])
    outs += runner.step([(f"s{i}", [7], True) for i in range(len(prompts))])
    return outs


def main() -> None:
    assert torch.cuda.is_available()
    failed = False
    prompts = [list(range(3, 3 + n)) for n in (1, 9, 40)]
    for name in CONFIGS:
        hf = make_hf_model(name)
        path = save_checkpoint(hf, Path(tempfile.mkdtemp()))
        hf_err = max(rel_err(o, hf_logits(hf, p)).max().item() for o, p in zip(run(load_pd(path), prompts)[:3], prompts, strict=True))
        for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 0.05)):
            cpu = run(load_pd(path, dtype=dtype), prompts)
            gpu = run(load_pd(path, dtype=dtype, device="cuda"), prompts)
            err = max(rel_err(g, c).max().item() for g, c in zip(gpu, cpu, strict=True))
            ok = err < tol and all(torch.isfinite(g).all() for g in gpu)
            failed |= not ok
            print(f"{name:26s} {str(dtype):15s} gpu vs cpu {err:.2e} {'ok' if ok else 'FAIL'}  (cpu prefill vs HF {hf_err:.1e})")
    import transformers.models.mamba2.modeling_mamba2 as m

    src = Path(m.__file__).read_text()
    print("HF", m.__file__, [line.strip() for line in src.splitlines() if "clamp" in line or "time_step_limit" in line])
    assert not failed


if __name__ == "__main__":
    main()
