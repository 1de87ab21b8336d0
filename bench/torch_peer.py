#!/usr/bin/env python3
"""PyTorch's eager training step of dc's dense Llama, for speed comparisons with dc-run.

    torch_peer.py [--config DIR/config.json] [--layers N --hidden N ...] --micro-batch B --gas G
                  [--device cpu|cuda] [--dtype f32|bf16] [--steps N] [--warmup N] [--threads N]
                  [--ddp N]

The model is dc's (models/model.cc, as tests/torch_reference/dc_reference.py computes it): token
embedding, per layer RMSNorm, grouped-query attention with rotary embeddings ("rotate half"),
RMSNorm and a SwiGLU MLP, a final RMSNorm and an untied LM head, mean cross-entropy, AdamW. Shapes
come from a Hugging Face config.json (dc-run --export writes one) and/or the flags, which take
dc's names. PyTorch runs it as a user would: fp32 parameters, bf16 under autocast on cuda,
scaled_dot_product_attention where this PyTorch has it, fused AdamW on cuda. Prints one JSON line:
tokens_per_second, step_seconds_median, the losses and the peak device memory.

--ddp N runs N processes on this machine under DistributedDataParallel (gloo on cpu, nccl on
cuda), each its own --micro-batch per micro-step, as dc-run --nproc N runs a data-parallel plan;
tokens_per_second then counts all ranks' tokens and rank 0 prints the line.
"""
import argparse
import json
import math
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F


def rms_norm(x, weight, eps):
    if hasattr(F, "rms_norm"):
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class Layer(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        hd = c.hidden // c.heads
        self.c, self.head_dim = c, hd
        self.attn_norm = torch.nn.Parameter(torch.ones(c.hidden))
        self.q = torch.nn.Linear(c.hidden, c.heads * hd, bias=False)
        self.k = torch.nn.Linear(c.hidden, c.kv_heads * hd, bias=False)
        self.v = torch.nn.Linear(c.hidden, c.kv_heads * hd, bias=False)
        self.o = torch.nn.Linear(c.heads * hd, c.hidden, bias=False)
        self.mlp_norm = torch.nn.Parameter(torch.ones(c.hidden))
        self.gate = torch.nn.Linear(c.hidden, c.ffn, bias=False)
        self.up = torch.nn.Linear(c.hidden, c.ffn, bias=False)
        self.down = torch.nn.Linear(c.ffn, c.hidden, bias=False)

    def forward(self, h, cos, sin):
        c, hd = self.c, self.head_dim
        b, s, _ = h.shape
        n = rms_norm(h, self.attn_norm, c.eps)
        q = self.q(n).view(b, s, c.heads, hd).transpose(1, 2)
        k = self.k(n).view(b, s, c.kv_heads, hd).transpose(1, 2)
        v = self.v(n).view(b, s, c.kv_heads, hd).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        h = h + self.o(attention(q, k, v, c.heads // c.kv_heads).transpose(1, 2).reshape(b, s, -1))
        n = rms_norm(h, self.mlp_norm, c.eps)
        return h + self.down(F.silu(self.gate(n)) * self.up(n))


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def attention(q, k, v, groups):
    if hasattr(F, "scaled_dot_product_attention"):
        try:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=groups > 1)
        except TypeError:  # no enable_gqa before PyTorch 2.5
            pass
    k = k.repeat_interleave(groups, 1)
    v = v.repeat_interleave(groups, 1)
    if hasattr(F, "scaled_dot_product_attention"):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    s = q.shape[-2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    return scores.masked_fill(mask, float("-inf")).softmax(-1) @ v


class Llama(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.embed = torch.nn.Embedding(c.vocab, c.hidden)
        self.layers = torch.nn.ModuleList(Layer(c) for _ in range(c.layers))
        self.norm = torch.nn.Parameter(torch.ones(c.hidden))
        self.head = torch.nn.Linear(c.hidden, c.vocab, bias=False)
        hd = c.hidden // c.heads
        inv_freq = c.theta ** (-2.0 * torch.arange(hd // 2, dtype=torch.float64) / hd)
        angle = torch.arange(c.seq, dtype=torch.float64)[:, None] * inv_freq[None, :]
        self.register_buffer("cos", angle.cos().float(), persistent=False)
        self.register_buffer("sin", angle.sin().float(), persistent=False)

    def forward(self, tokens, targets):
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h, self.cos, self.sin)
        logits = self.head(rms_norm(h, self.norm, self.c.eps))
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", help="Hugging Face config.json (dc-run --export writes one)")
    for name in ("layers", "hidden", "heads", "kv-heads", "ffn", "vocab", "seq"):
        p.add_argument("--" + name, type=int)
    p.add_argument("--micro-batch", type=int, required=True)
    p.add_argument("--gas", type=int, default=1)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=("f32", "bf16"), default="f32")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--ddp", type=int, default=0,
                   help="ranks under DistributedDataParallel on this machine (0: one process)")
    p.add_argument("--port", type=int, default=29517, help="rendezvous port of --ddp")
    a = p.parse_args()
    cfg = {}
    if a.config:
        with open(a.config) as f:
            cfg = json.load(f)
    c = argparse.Namespace(
        layers=a.layers or cfg.get("num_hidden_layers"), hidden=a.hidden or cfg.get("hidden_size"),
        heads=a.heads or cfg.get("num_attention_heads"),
        kv_heads=a.kv_heads or cfg.get("num_key_value_heads"),
        ffn=a.ffn or cfg.get("intermediate_size"), vocab=a.vocab or cfg.get("vocab_size"),
        seq=a.seq or cfg.get("max_position_embeddings"), eps=cfg.get("rms_norm_eps", 1e-5),
        theta=cfg.get("rope_theta", 1e4))
    missing = [k for k, v in vars(c).items() if v is None]
    if missing:
        p.error("no value for " + ", ".join(missing) + ": give --config or the flags")
    if c.hidden % c.heads or c.heads % c.kv_heads:
        p.error("--hidden must divide by --heads and --heads by --kv-heads")
    if a.ddp < 0:
        p.error("--ddp must be 0 (one process) or a rank count")
    return a, c


def main():
    a, c = parse()
    if a.ddp > 0:
        mp.spawn(run, args=(a, c), nprocs=a.ddp, join=True)
    else:
        run(0, a, c)


def run(rank, a, c):
    world = max(1, a.ddp)
    if a.ddp > 0:
        import os
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(a.port))
        dist.init_process_group("nccl" if a.device == "cuda" else "gloo", rank=rank,
                                world_size=world)
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("torch_peer.py: --device cuda: this PyTorch sees no CUDA device")
    dev = torch.device(a.device, rank) if a.device == "cuda" and a.ddp else torch.device(a.device)
    torch.manual_seed(0)
    model = Llama(c).to(dev)
    if a.ddp > 0:
        model = torch.nn.parallel.DistributedDataParallel(model)
    fused = {"fused": True} if a.device == "cuda" else {}
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1,
                            **fused)
    step_fn = model
    if a.compile:
        step_fn = torch.compile(model)
    gen = torch.Generator().manual_seed(1 + rank)
    batches = [torch.randint(0, c.vocab, (a.micro_batch, c.seq + 1), generator=gen).to(dev)
               for _ in range(a.gas)]
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if a.dtype == "bf16"
                else torch.autocast(a.device, enabled=False))

    def sync():
        if a.device == "cuda":
            torch.cuda.synchronize()

    losses, seconds = [], []
    for step in range(a.warmup + a.steps):
        sync()
        start = time.perf_counter()
        total = 0.0
        for t in batches:
            with autocast:
                loss = step_fn(t[:, :-1], t[:, 1:]) / a.gas
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = float(total)  # the loss read once per step, as dc-run does
        sync()
        if step >= a.warmup:
            seconds.append(time.perf_counter() - start)
            losses.append(total)
    if a.ddp > 0:
        dist.destroy_process_group()
    if rank != 0:
        return
    median = statistics.median(seconds)
    print(json.dumps({
        "framework": f"pytorch {torch.__version__} eager" + (" compiled" if a.compile else ""),
        "device": a.device, "dtype": a.dtype, "steps": a.steps, "world_size": world,
        "step_seconds_median": median,
        "tokens_per_second": world * a.micro_batch * a.gas * c.seq / median,
        "peak_memory_bytes": torch.cuda.max_memory_allocated() if a.device == "cuda" else None,
        "losses": losses}))


if __name__ == "__main__":
    main()
