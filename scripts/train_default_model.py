"""Train pd_ssm's embedded default model: a small Bamba hybrid on the Python standard library.

    python scripts/train_default_model.py --minutes 4 --out /tmp/out        # GPU run (bf16 autocast)
    python scripts/train_default_model.py --tiny --out /tmp/tiny            # CPU smoke run, seconds

The model reads bytes the way pd_ssm's `ByteTokenizer` writes them (byte b is id b + 3; 0/1/2 are
pad/bos/eos; vocab 512), so the checkpoint ships without a tokenizer file.  Documents are the
stdlib's `.py` files (`sysconfig.get_paths()["stdlib"]`, site-packages excluded), each followed by
EOS and no BOS (ByteTokenizer does not prepend one); a fixed 2% of the files, chosen by a hash of
their relative path, is held out.  Training runs for a wall-clock budget: AdamW, linear warmup,
then a cosine over the *elapsed fraction of the budget*, so the schedule ends on time whatever the
step rate.  Outputs under --out (or $OUT, default /tmp/out):

    default_model/{config.json, model.safetensors}   bf16 weights, what pd_ssm loads
    train_log.jsonl                                   config record, train / eval records, final record
    samples.txt                                       greedy and sampled continuations of 5 prompts
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.nn.functional as F

VOCAB_SIZE = 512  # as pd_ssm.default_model.CONFIG; ids 259..511 are never used
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
BYTE_OFFSET = 3  # pd_ssm.engine.tokenizer.BYTE_OFFSET: byte b is id b + 3
SAVE_DTYPE = torch.bfloat16  # trained under bf16 autocast; pd_ssm's config parser and loader accept it
MAX_WEIGHT_BYTES = 20 * 10**6  # the package ships the weights: <= 20 MB (decimal, the stricter reading)
HELDOUT_PERCENT = 2
PROMPTS = ("def ", "import ", "class Stack:\n", "for i in range(", "# Compute the")


@dataclass(slots=True, frozen=True)
class Shape:
    """Model dimensions; mamba heads * mamba_d_head must equal 2 * hidden (mamba_expand 2)."""

    hidden: int
    intermediate: int
    layers: int
    attn_layers: tuple[int, ...]
    attn_heads: int
    kv_heads: int
    mamba_heads: int
    mamba_d_head: int
    d_state: int
    chunk: int

    def __post_init__(self) -> None:
        if self.mamba_heads * self.mamba_d_head != 2 * self.hidden:
            raise ValueError("mamba_heads * mamba_d_head must be 2 * hidden (mamba_expand = 2)")
        if not self.attn_layers or any(not 0 <= i < self.layers for i in self.attn_layers):
            raise ValueError(f"attn_layers {self.attn_layers} must name layers in 0..{self.layers - 1}")


# ~8M parameters (~16 MB in bf16); chunk 64 keeps the intra-chunk tensors of transformers' torch
# SSD path (no mamba_ssm on the GPU machine) small: they grow with chunk * chunk * heads * d_state.
FULL = Shape(hidden=256, intermediate=768, layers=8, attn_layers=(2, 5), attn_heads=4, kv_heads=2,
             mamba_heads=8, mamba_d_head=64, d_state=64, chunk=64)
TINY = Shape(hidden=64, intermediate=128, layers=3, attn_layers=(1,), attn_heads=4, kv_heads=2,
             mamba_heads=4, mamba_d_head=32, d_state=16, chunk=16)


@dataclass(slots=True)
class Run:
    """Training hyper-parameters; `--tiny` swaps in the smoke-test values."""

    minutes: float = 4.0
    max_steps: int | None = None  # None: only the clock stops training
    batch: int = 32
    seq_len: int = 512
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    log_every: int = 10
    eval_every: int = 100
    eval_windows: int = 64
    sample_tokens: int = 200
    max_files: int | None = None  # None: every file
    seed: int = 0


def bamba_config(shape: Shape) -> Any:
    from transformers import BambaConfig

    return BambaConfig(
        vocab_size=VOCAB_SIZE, pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
        tie_word_embeddings=False, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, attn_layer_indices=list(shape.attn_layers),
        num_attention_heads=shape.attn_heads, num_key_value_heads=shape.kv_heads,
        # NOTE: n_groups 1 is the only value for which transformers 5.17 (GPU machine: gated norm
        # over all of d_inner) and >= 5.24 (grouped gated norm, pd_ssm's reference) agree
        mamba_n_groups=1, mamba_n_heads=shape.mamba_heads, mamba_d_head=shape.mamba_d_head,
        mamba_d_state=shape.d_state, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=shape.chunk,
        mamba_conv_bias=True, mamba_proj_bias=False, max_position_embeddings=4096, use_cache=False,
    )


@torch.no_grad()
def init_ssm_params(model: torch.nn.Module, seed: int) -> None:
    """mamba_ssm's initialization of A_log, dt_bias, D, whatever this transformers version does.

    Versions differ (5.24 sets dt_bias = 1, A = 1..heads); the mamba_ssm values (A in [1, 16],
    dt = softplus(dt_bias) log-uniform in [1e-3, 1e-1]) are what Mamba2 trains well from.
    """
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.log(torch.empty(p.shape).uniform_(1.0, 16.0, generator=g)))
        elif name.endswith("dt_bias"):
            u = torch.rand(p.shape, generator=g)
            dt = torch.exp(u * (math.log(1e-1) - math.log(1e-3)) + math.log(1e-3)).clamp(min=1e-4)
            p.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        elif name.endswith(".D"):
            p.fill_(1.0)


def weight_bytes(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Bytes of the saved tensors (the safetensors header adds a few KB)."""
    return sum(p.numel() for p in model.parameters()) * torch.empty((), dtype=dtype).element_size()


# --- data ---------------------------------------------------------------------------------------


def stdlib_files(root: Path) -> list[Path]:
    """Every stdlib .py file, sorted by relative path so the order is the same on every machine."""
    skip = {"site-packages", "dist-packages", "__pycache__"}
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # pruned, not filtered: a GPU machine's site-packages (torch, ...) holds far more files than the stdlib
        dirnames[:] = [d for d in dirnames if d not in skip]
        files += [Path(dirpath, f) for f in filenames if f.endswith(".py") and Path(dirpath, f).is_file()]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def is_heldout(rel_path: str) -> bool:
    # a hash of the path, not of the contents: the split survives patch releases of the stdlib
    return int(hashlib.sha1(rel_path.encode()).hexdigest()[:8], 16) % 100 < HELDOUT_PERCENT


def encode_documents(files: list[Path]) -> torch.Tensor:
    """int64 ids [total]: each file's bytes (+3) then EOS; files that are not UTF-8 are skipped,
    so every training byte sequence decodes to text."""
    parts: list[torch.Tensor] = []
    eos = torch.tensor([EOS_ID], dtype=torch.int64)
    for path in files:
        data = path.read_bytes()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if data:
            parts += [torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64) + BYTE_OFFSET, eos]
    if not parts:
        raise RuntimeError(f"no UTF-8 .py files among {len(files)} paths: is --data-dir a Python source tree?")
    return torch.cat(parts)


def load_data(root: Path, max_files: int | None) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(train ids, held-out ids, train files, held-out files)."""
    files = stdlib_files(root)
    held = [p for p in files if is_heldout(p.relative_to(root).as_posix())]
    train = [p for p in files if not is_heldout(p.relative_to(root).as_posix())]
    if max_files is not None:  # the smoke run: a prefix of each split, at least one held-out file
        train, held = train[:max_files], held[: max(1, max_files // 20)]
    if not held or not train:
        raise RuntimeError(f"{root} gives {len(train)} training and {len(held)} held-out files; need both")
    return encode_documents(train), encode_documents(held), len(train), len(held)


def heldout_windows(ids: torch.Tensor, seq_len: int, count: int) -> torch.Tensor:
    """[n, seq_len + 1] consecutive windows from the start of the held-out stream, fixed for the run."""
    n = min(count, (ids.numel() - 1) // (seq_len + 1))
    if n == 0:
        raise RuntimeError(f"held-out data ({ids.numel()} ids) is shorter than one window of {seq_len + 1}")
    return ids[: n * (seq_len + 1)].view(n, seq_len + 1)


# --- training -----------------------------------------------------------------------------------


def lr_at(run: Run, step: int, frac: float) -> float:
    """Linear warmup over steps, then cosine from lr to lr * min_lr_ratio over the budget's elapsed fraction."""
    warm = min(1.0, (step + 1) / run.warmup_steps)
    cos = 0.5 * (1.0 + math.cos(math.pi * min(1.0, frac)))
    return run.lr * warm * (run.min_lr_ratio + (1.0 - run.min_lr_ratio) * cos)


def make_optimizer(model: torch.nn.Module, run: Run, device: torch.device) -> torch.optim.AdamW:
    # decay the matrices only: norms, biases and the SSM's A_log / D / dt_bias keep their scale
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": run.weight_decay}, {"params": other, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=run.lr, betas=(0.9, 0.95), fused=device.type == "cuda")


def lm_loss(model: torch.nn.Module, window: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Mean next-byte cross entropy (nats) of windows [b, seq_len + 1]."""
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        logits = model(input_ids=window[:, :-1], use_cache=False).logits  # [b, seq_len, vocab]
    return F.cross_entropy(logits.float().flatten(0, 1), window[:, 1:].flatten())


@torch.no_grad()
def heldout_loss(model: torch.nn.Module, windows: torch.Tensor, batch: int, device: torch.device) -> float:
    model.eval()
    total = sum(lm_loss(model, windows[i : i + batch], device).item() * len(windows[i : i + batch])
                for i in range(0, len(windows), batch))
    model.train()
    return total / len(windows)


def train(model: torch.nn.Module, train_ids: torch.Tensor, held: torch.Tensor, run: Run,
          device: torch.device, log: TextIO) -> dict[str, Any]:
    """Train until the budget (or max_steps) is spent; returns the final record."""
    opt = make_optimizer(model, run, device)
    g = torch.Generator().manual_seed(run.seed)
    budget = run.minutes * 60.0
    start = last_log = time.monotonic()
    step = tokens = logged_tokens = 0
    loss_sum = torch.zeros((), device=device)
    offsets = torch.arange(run.seq_len + 1, device=device)
    model.train()

    def record(**fields: Any) -> None:
        log.write(json.dumps({"step": step, "elapsed_s": round(time.monotonic() - start, 2), **fields}) + "\n")
        log.flush()

    while True:
        elapsed = time.monotonic() - start
        if elapsed >= budget or (run.max_steps is not None and step >= run.max_steps):
            break
        lr = lr_at(run, step, elapsed / budget)
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, train_ids.numel() - run.seq_len - 1, (run.batch, 1), generator=g).to(device)
        window = train_ids[starts + offsets]  # [batch, seq_len + 1], gathered where the ids live
        loss = lm_loss(model, window, device)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), run.grad_clip)
        opt.step()
        loss_sum += loss.detach()
        step += 1
        tokens += run.batch * run.seq_len
        if step % run.log_every == 0:
            mean = loss_sum.item() / run.log_every  # .item() syncs: tokens/s below is device time
            now = time.monotonic()
            record(kind="train", loss=round(mean, 4), lr=lr, tokens=tokens,
                   tokens_per_s=round((tokens - logged_tokens) / (now - last_log), 1))
            loss_sum.zero_()
            last_log, logged_tokens = now, tokens
        if step % run.eval_every == 0:
            record(kind="eval", heldout_loss=round(heldout_loss(model, held, run.batch, device), 4), tokens=tokens)
    final_eval = heldout_loss(model, held, run.batch, device)
    train_s = time.monotonic() - start
    final = dict(kind="final", heldout_loss=round(final_eval, 4), tokens=tokens,
                 train_s=round(train_s, 2), tokens_per_s=round(tokens / train_s, 1))
    record(**final)
    return {"step": step, **final}


# --- outputs ------------------------------------------------------------------------------------


def save_checkpoint(model: Any, path: Path) -> int:
    """save_pretrained (a BambaForCausalLM) in SAVE_DTYPE, safetensors; returns the weights file's size."""
    model.to(SAVE_DTYPE)
    model.save_pretrained(path, safe_serialization=True)
    # pd_ssm reads config.json + model.safetensors only; the package ships exactly those two files
    (path / "generation_config.json").unlink(missing_ok=True)
    size = (path / "model.safetensors").stat().st_size
    assert size <= MAX_WEIGHT_BYTES, f"weights are {size} bytes, over the {MAX_WEIGHT_BYTES} budget"
    saved = json.loads((path / "config.json").read_text())
    dtype = saved.get("dtype") or saved.get("torch_dtype")
    assert dtype == "bfloat16", f"config.json records dtype {dtype!r}, expected 'bfloat16'"
    return size


def byte_ids(text: str) -> list[int]:
    return [b + BYTE_OFFSET for b in text.encode("utf-8")]


def byte_text(ids: list[int]) -> str:
    # as ByteTokenizer.decode: ids outside the byte block (pad / bos / eos) have no text
    return bytes(i - BYTE_OFFSET for i in ids if BYTE_OFFSET <= i < BYTE_OFFSET + 256).decode("utf-8", "replace")


@torch.no_grad()
def write_samples(model_dir: Path, out: Path, new_tokens: int, device: torch.device, seed: int) -> None:
    """Greedy and sampled continuations from the *saved* checkpoint (fp32 compute), as it will ship."""
    from transformers import BambaForCausalLM

    model: Any = BambaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.to(device).eval()
    modes: dict[str, dict[str, Any]] = {
        "greedy": {"do_sample": False},
        "sampled (T=0.8, top_p=0.95)": {"do_sample": True, "temperature": 0.8, "top_p": 0.95},
    }
    with open(out, "w") as f:
        for prompt in PROMPTS:
            ids = torch.tensor([byte_ids(prompt)], device=device)
            for mode, kwargs in modes.items():
                torch.manual_seed(seed)
                gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                     pad_token_id=PAD_ID, eos_token_id=EOS_ID, use_cache=True, **kwargs)
                f.write(f"=== {mode} | prompt {prompt!r}\n{prompt}{byte_text(gen[0, ids.shape[1]:].tolist())}\n\n")


def parse_args(argv: list[str] | None) -> tuple[Run, Shape, Path, Path]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=None, help="training wall-clock budget (default 4.0)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/out")))
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny dims, a few steps, few files")
    p.add_argument("--data-dir", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    # tiny: seconds on a CPU; a real run's budget, stop rule and outputs, at toy sizes
    run = Run(batch=4, seq_len=64, max_steps=6, minutes=1.0, log_every=2, eval_every=2, eval_windows=2,
              sample_tokens=8, max_files=40, warmup_steps=2) if a.tiny else Run()
    for name in ("minutes", "batch", "seq_len", "lr", "max_steps"):
        if getattr(a, name) is not None:
            setattr(run, name, getattr(a, name))
    run.seed = a.seed
    return run, TINY if a.tiny else FULL, a.out, a.data_dir


def main(argv: list[str] | None = None) -> int:
    run, shape, out, data_dir = parse_args(argv)
    from transformers import BambaForCausalLM

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(run.seed)
    model = BambaForCausalLM(bamba_config(shape)).float()
    init_ssm_params(model, run.seed)
    n_bytes = weight_bytes(model, SAVE_DTYPE)
    # fail before training, not after: the shipped weights have a hard size budget
    assert n_bytes <= MAX_WEIGHT_BYTES, f"{n_bytes} bytes of {SAVE_DTYPE} weights exceed {MAX_WEIGHT_BYTES}"
    model.to(device)
    train_ids, held_ids, n_train, n_held = load_data(data_dir, run.max_files)
    held = heldout_windows(held_ids, run.seq_len, run.eval_windows).to(device)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "train_log.jsonl", "w") as log:
        log.write(json.dumps({
            "kind": "config", "shape": asdict(shape), "run": asdict(run), "device": str(device),
            "params": sum(p.numel() for p in model.parameters()), "weight_bytes": n_bytes,
            "data_dir": str(data_dir), "train_files": n_train, "heldout_files": n_held,
            "train_bytes": train_ids.numel(), "heldout_bytes": held_ids.numel(),
            "torch": torch.__version__, "transformers": __import__("transformers").__version__,
        }) + "\n")
        # the whole corpus lives on the device (~8 bytes per byte: ~300 MB for the stdlib)
        final = train(model, train_ids.to(device), held, run, device, log)
    size = save_checkpoint(model, out / "default_model")
    write_samples(out / "default_model", out / "samples.txt", run.sample_tokens, device, run.seed)
    print(json.dumps({**final, "weights_bytes": size, "out": str(out)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
