#!/usr/bin/python3
"""A small PyTorch reference of dc's Llama and Mixtral, to check dc against an outside framework.

It computes what dc's program computes (models/model.cc; the math of executor/cpu_kernels.cc and
schemas/op_kinds.h) from an export of dc-run (--export: model.safetensors + config.json in
Hugging Face's names and layout) and the batch dc trained on (the token file and the sample
order of executor/data.h), with PyTorch's autograd and torch.optim.AdamW. Everything runs in
float64, so the reference is exact to far below fp32's rounding: a difference is dc's.

    dc_reference.py --weights W0 --dump G [--dc-loss L] [--after W5 --steps 5] [--json out]

compares dc's first-step loss and gradients (dc-run --dump-grads G, from W0) and, with --after,
the weights dc reached after --steps AdamW steps from W0 (another dc-run --export). With
--eval-data E --eval-batches K --dc-eval-loss L it also compares dc-run --eval-data's loss from
W0: the mean over held-out global batches 0..K-1 of E, each split as a training step's batch. A gradient's
difference is max|dc - ref| / max|ref| over the tensor (relative to the tensor's scale, so
elements near zero do not dominate); the weights' is that and ||dc - ref|| / ||ref|| (see
main). Exits 1 when a tolerance is exceeded.

Where dc's definitions differ from Hugging Face's own modules (see README, "Parity with
PyTorch"): Mixtral's load-balancing loss is computed per layer on each micro-batch and summed
over layers (HF's load_balancing_loss_func pools all layers' router logits into one term), and
the loss is the mean over micro-batches of (mean cross-entropy + the balancing terms).
"""
import argparse
import json
import math
import os
import struct
import sys

import torch

DTYPE = torch.float64


# --------------------------------------------------------------------------------------------
# Files


def read_safetensors(path):
    """name -> float64 tensor, from the format's 8-byte header length, JSON header and data."""
    with open(path, "rb") as f:
        data = f.read()
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + header_len])
    base = 8 + header_len
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        raw = bytearray(data[base + begin:base + end])
        if info["dtype"] == "F32":
            t = torch.frombuffer(raw, dtype=torch.float32)
        elif info["dtype"] in ("BF16", "F16"):
            bits = torch.frombuffer(raw, dtype=torch.int16)
            if info["dtype"] == "F16":
                t = bits.view(torch.float16).float()
            else:  # bf16: the top half of an fp32
                t = (bits.to(torch.int32) << 16).view(torch.float32)
        else:
            raise SystemExit(f"{path}: {name} has dtype {info['dtype']}, not a float")
        tensors[name] = t.to(DTYPE).reshape(info["shape"]).clone()
    return tensors


def read_model(directory):
    """The tensors of a model directory: model.safetensors, or HF's sharded files listed by
    model.safetensors.index.json."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if not os.path.exists(index):
        return read_safetensors(os.path.join(directory, "model.safetensors"))
    with open(index) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    tensors = {}
    for name in files:
        tensors.update(read_safetensors(os.path.join(directory, name)))
    return tensors


class TokenFile:
    """A flat uint16 token file, sampled as executor/data.cc's FileTokenSource does."""

    def __init__(self, path, seq):
        with open(path, "rb") as f:
            raw = bytearray(f.read())
        self.tokens = torch.frombuffer(raw, dtype=torch.int16).to(torch.int64) & 0xFFFF
        self.seq = seq

    def sample(self, index):
        start = (index * self.seq) % (len(self.tokens) - self.seq)
        window = self.tokens[start:start + self.seq + 1]
        return window[:-1], window[1:]


# --------------------------------------------------------------------------------------------
# The model


def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, heads, head_dim, theta):
    """Rotary embedding, "rotate half" pairing (i with i + head_dim / 2), as HF's Llama."""
    b, s, _ = x.shape
    half = head_dim // 2
    inv_freq = theta ** (-2.0 * torch.arange(half, dtype=DTYPE) / head_dim)
    angle = torch.arange(s, dtype=DTYPE)[:, None] * inv_freq[None, :]  # [S, half]
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    x = x.view(b, s, heads, head_dim)
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).view(b, s, -1)


def attention(q, k, v, heads, kv_heads, head_dim):
    """Causal grouped-query attention: query head h reads kv head h // (heads / kv_heads)."""
    b, s, _ = q.shape
    q = q.view(b, s, heads, head_dim).transpose(1, 2)
    k = k.view(b, s, kv_heads, head_dim).transpose(1, 2).repeat_interleave(heads // kv_heads, 1)
    v = v.view(b, s, kv_heads, head_dim).transpose(1, 2).repeat_interleave(heads // kv_heads, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(head_dim)
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)
    probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
    return (probs @ v).transpose(1, 2).reshape(b, s, heads * head_dim)


def swiglu_mlp(x, gate, up, down):
    return (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T


def moe_mlp(x, p, prefix, cfg, aux_coef):
    """Mixtral's block: top-k of softmax(router), gates renormalized over the chosen experts.
    Returns the output and this layer's load-balancing term, aux_coef * E * sum_e f_e * P_e over
    the micro-batch's tokens (f_e: the share of choices that went to e, not differentiable;
    P_e: the mean router probability of e)."""
    experts, top_k = cfg["num_local_experts"], cfg["num_experts_per_tok"]
    rows = x.reshape(-1, x.shape[-1])
    probs = (rows @ p[prefix + "gate.weight"].T).softmax(-1)
    chosen_p, chosen = probs.topk(top_k, dim=-1)
    gates = chosen_p / chosen_p.sum(-1, keepdim=True)
    out = torch.zeros_like(rows)
    for e in range(experts):
        token, slot = (chosen == e).nonzero(as_tuple=True)
        if len(token) == 0:
            continue
        w = prefix + f"experts.{e}."
        y = swiglu_mlp(rows[token], p[w + "w1.weight"], p[w + "w3.weight"], p[w + "w2.weight"])
        out = out.index_add(0, token, gates[token, slot, None] * y)
    share = torch.stack([(chosen == e).sum() for e in range(experts)]).to(DTYPE) / rows.shape[0]
    aux = aux_coef * experts * (share * probs.mean(0)).sum()
    return out.view_as(x), aux


def micro_batch_loss(p, cfg, tokens, targets, aux_coef):
    """Mean cross-entropy over the micro-batch's tokens plus each MoE layer's balancing term."""
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg["hidden_size"] // heads
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    h = p["model.embed_tokens.weight"][tokens]
    aux_total = 0.0
    for layer in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{layer}."
        n = rms_norm(h, p[pre + "input_layernorm.weight"], eps)
        q = rope(n @ p[pre + "self_attn.q_proj.weight"].T, heads, head_dim, theta)
        k = rope(n @ p[pre + "self_attn.k_proj.weight"].T, kv_heads, head_dim, theta)
        v = n @ p[pre + "self_attn.v_proj.weight"].T
        h = h + attention(q, k, v, heads, kv_heads, head_dim) @ p[pre + "self_attn.o_proj.weight"].T
        n = rms_norm(h, p[pre + "post_attention_layernorm.weight"], eps)
        if cfg["model_type"] == "mixtral":
            y, aux = moe_mlp(n, p, pre + "block_sparse_moe.", cfg, aux_coef)
            aux_total = aux_total + aux
        else:
            y = swiglu_mlp(n, p[pre + "mlp.gate_proj.weight"], p[pre + "mlp.up_proj.weight"],
                           p[pre + "mlp.down_proj.weight"])
        h = h + y
    logits = rms_norm(h, p["model.norm.weight"], eps) @ p["lm_head.weight"].T
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           targets.reshape(-1))
    return ce + aux_total


def step_loss(p, cfg, run, data, step):
    """The optimizer step's loss: the mean over its world * gas micro-batches. Micro-batch u =
    (step * gas + micro_step) * world + rank holds samples u * micro_batch + b (data.h's
    SampleIndex)."""
    mb, micro_batches = run["micro_batch"], run["world_size"] * run["gas"]
    total = 0.0
    for i in range(micro_batches):
        u = step * micro_batches + i
        pairs = [data.sample(u * mb + b) for b in range(mb)]
        tokens = torch.stack([t for t, _ in pairs])
        targets = torch.stack([t for _, t in pairs])
        total = total + micro_batch_loss(p, cfg, tokens, targets, run["router_aux_coef"])
    return total / micro_batches


# --------------------------------------------------------------------------------------------
# Comparison


def relative_difference(dc, ref):
    scale = ref.abs().max().item()
    diff = (dc.to(DTYPE) - ref).abs().max().item()
    return diff / scale if scale > 0 else diff


def l2_relative_difference(dc, ref):
    scale = ref.norm().item()
    diff = (dc.to(DTYPE) - ref).norm().item()
    return diff / scale if scale > 0 else diff


def compare(what, dc, ref, tolerance, report, metric=relative_difference):
    worst = (0.0, None)
    failures = []
    for name in sorted(ref):
        if name not in dc:
            failures.append(f"{what}: dc has no {name}")
            continue
        if tuple(dc[name].shape) != tuple(ref[name].shape):
            failures.append(f"{what}: {name} is {list(dc[name].shape)} in dc, "
                            f"{list(ref[name].shape)} in the reference")
            continue
        d = metric(dc[name], ref[name])
        report.setdefault(what, {})[name] = d
        worst = max(worst, (d, name))
        if not d <= tolerance:
            failures.append(f"{what}: {name} differs by {d:.3g} relative (tolerance {tolerance:g})")
    print(f"{what}: largest relative difference {worst[0]:.3g} ({worst[1]})")
    return failures


def dc_adamw(params, run):
    """dc's AdamW: PyTorch's, with weight decay on the matrices only."""
    groups = [{"params": [p for p in params.values() if p.dim() >= 2],
               "weight_decay": run["weight_decay"]},
              {"params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=run["lr"], betas=(run["beta1"], run["beta2"]),
                             eps=run["adam_eps"])


def compare_to_peer(what, dc, peer, ref, factor, rounding, report, metric):
    """dc's differences from the float64 reference, each held to `factor` times the largest of
    the peer's (PyTorch in the same low precision) over the tensors, and at least `rounding`."""
    peer_worst = max(metric(peer[name], ref[name]) for name in ref)
    tolerance = max(factor * peer_worst, rounding)
    failures = compare(what, dc, ref, tolerance, report, metric)
    report.setdefault("peer " + what, {}).update(
        {name: metric(peer[name], ref[name]) for name in ref})
    print(f"{what}: PyTorch's largest relative difference {peer_worst:.3g} "
          f"(dc's tolerance {tolerance:.3g})")
    return failures


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--weights", required=True, help="dc-run --export directory: the start")
    ap.add_argument("--dump", required=True, help="dc-run --dump-grads directory (from --weights)")
    ap.add_argument("--data", help="token file (default: the one dc_run.json names)")
    ap.add_argument("--dc-loss", type=float, help="dc's loss of the first step")
    ap.add_argument("--after", help="dc-run --export directory after --steps steps from --weights")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--grad-tolerance", type=float, default=1e-5)
    ap.add_argument("--weight-tolerance", type=float, default=1e-4,
                    help="of ||dc - ref|| / ||ref|| per tensor after --steps steps")
    ap.add_argument("--weight-element-tolerance", type=float, default=1e-3,
                    help="of max|dc - ref| / max|ref| per tensor after --steps steps")
    ap.add_argument("--eval-data", help="held-out token file dc evaluated W0 on (--eval-data)")
    ap.add_argument("--eval-batches", type=int, default=1)
    ap.add_argument("--dc-eval-loss", type=float, help="dc's evaluation loss of W0")
    ap.add_argument("--peer-dtype", choices=["bf16"],
                    help="dc computed in this type: hold its differences from the float64 "
                    "reference to --peer-factor times PyTorch's own in that type (the same model, "
                    "weights and batches with params and activations in it, fp32 AdamW masters), "
                    "and at least the type's rounding, instead of the fixed tolerances")
    ap.add_argument("--peer-factor", type=float, default=2.0)
    ap.add_argument("--fp32-peer", action="store_true",
                    help="dc computed in fp32: hold its gradients to --peer-factor times "
                    "PyTorch's own fp32 differences from the float64 reference (the same model, "
                    "weights and batch), and at least --grad-tolerance: fp32's rounding grows "
                    "with the model's sums and the data, which a fixed tolerance does not")
    ap.add_argument("--json", help="write the differences here")
    args = ap.parse_args()
    torch.set_num_threads(1)

    with open(f"{args.weights}/config.json") as f:
        cfg = json.load(f)
    with open(f"{args.dump}/dc_run.json") as f:
        run = json.load(f)
    data_path = args.data or run["data_path"]
    if not data_path:
        raise SystemExit("dc_run.json names no token file: train dc on a --data file to compare")
    data = TokenFile(data_path, run["seq"])
    start = read_model(args.weights)
    params = {n: t.clone().requires_grad_(True) for n, t in start.items()}
    report = {}
    failures = []

    loss = step_loss(params, cfg, run, data, run["step"])
    loss.backward()
    print(f"loss: reference {loss.item():.9f}" +
          (f", dc {args.dc_loss:.9f}" if args.dc_loss is not None else ""))
    if args.peer_dtype and (args.dc_loss is None or args.eval_data):
        raise SystemExit("--peer-dtype needs --dc-loss and takes no --eval-data")
    if args.dc_loss is not None and not args.peer_dtype:
        d = abs(args.dc_loss - loss.item()) / abs(loss.item())
        report["loss"] = d
        print(f"loss: relative difference {d:.3g}")
        if not d <= args.grad_tolerance:
            failures.append(f"loss differs by {d:.3g} relative (tolerance {args.grad_tolerance:g})")
    if args.eval_data:
        # Forward only, from the same weights: global batch k of the held-out file is what a
        # training step k would read of it.
        held_out = TokenFile(args.eval_data, run["seq"])
        with torch.no_grad():
            eval_loss = sum(step_loss(start, cfg, run, held_out, k)
                            for k in range(args.eval_batches)) / args.eval_batches
        print(f"eval loss: reference {eval_loss.item():.9f}" +
              (f", dc {args.dc_eval_loss:.9f}" if args.dc_eval_loss is not None else ""))
        if args.dc_eval_loss is not None:
            d = abs(args.dc_eval_loss - eval_loss.item()) / abs(eval_loss.item())
            report["eval_loss"] = d
            print(f"eval loss: relative difference {d:.3g}")
            if not d <= args.grad_tolerance:
                failures.append(f"eval loss differs by {d:.3g} relative "
                                f"(tolerance {args.grad_tolerance:g})")
    grads = {n: p.grad.detach() for n, p in params.items()}
    dc_grads = read_safetensors(f"{args.dump}/grads.safetensors")
    if args.peer_dtype:
        # PyTorch in the peer type, from the same start: its loss and gradients' differences
        # from the float64 reference set the bar for dc's.
        peer_type = {"bf16": torch.bfloat16}[args.peer_dtype]
        rounding = 2.0 ** -8  # bf16's unit roundoff: 8 significant bits
        peer = {n: t.to(peer_type).requires_grad_(True) for n, t in start.items()}
        peer_loss = step_loss(peer, cfg, run, data, run["step"])
        peer_loss.backward()
        peer_d = abs(peer_loss.item() - loss.item()) / abs(loss.item())
        d = abs(args.dc_loss - loss.item()) / abs(loss.item())
        tolerance = max(args.peer_factor * peer_d, rounding)
        report["loss"], report["peer_loss"] = d, peer_d
        print(f"loss: relative difference dc {d:.3g}, PyTorch {args.peer_dtype} {peer_d:.3g} "
              f"(tolerance {tolerance:.3g})")
        if not d <= tolerance:
            failures.append(f"loss differs by {d:.3g} relative (tolerance {tolerance:.3g})")
        peer_grads = {n: p.grad.detach().to(DTYPE) for n, p in peer.items()}
        failures += compare_to_peer("grads", dc_grads, peer_grads, grads, args.peer_factor,
                                    rounding, report, relative_difference)
    elif args.fp32_peer:
        peer = {n: t.float().requires_grad_(True) for n, t in start.items()}
        step_loss(peer, cfg, run, data, run["step"]).backward()
        peer_grads = {n: p.grad.detach().to(DTYPE) for n, p in peer.items()}
        failures += compare_to_peer("grads", dc_grads, peer_grads, grads, args.peer_factor,
                                    args.grad_tolerance, report, relative_difference)
    else:
        failures += compare("grads", dc_grads, grads, args.grad_tolerance, report)

    if args.after:
        params = {n: t.clone().requires_grad_(True) for n, t in start.items()}
        opt = dc_adamw(params, run)
        # dc's --clip-grad-norm: clip_grad_norm_ over every param's whole gradient, then AdamW.
        max_norm = run.get("clip_grad_norm", 0.0)
        clipped_steps = 0
        for step in range(run["step"], run["step"] + args.steps):
            opt.zero_grad()
            step_loss(params, cfg, run, data, step).backward()
            if max_norm > 0:
                total = torch.nn.utils.clip_grad_norm_(list(params.values()), max_norm)
                clipped_steps += int(total.item() > max_norm)
                print(f"step {step}: grad norm {total.item():.6g}, clip at {max_norm:g}")
            opt.step()
        if max_norm > 0 and clipped_steps == 0:
            failures.append(f"--clip-grad-norm {max_norm:g} clipped none of the {args.steps} "
                            "steps; set it lower so that the test exercises clipping")
        if args.peer_dtype:
            # PyTorch's mixed precision as dc's: fp32 masters and AdamW, each step's forward and
            # backward in the peer type from the masters rounded to it.
            masters = {n: t.float().requires_grad_(True) for n, t in start.items()}
            peer_opt = dc_adamw(masters, run)
            for step in range(run["step"], run["step"] + args.steps):
                low = {n: p.detach().to(peer_type).requires_grad_(True) for n, p in masters.items()}
                step_loss(low, cfg, run, data, step).backward()
                for n, p in masters.items():
                    p.grad = low[n].grad.float()
                if max_norm > 0:
                    torch.nn.utils.clip_grad_norm_(list(masters.values()), max_norm)
                peer_opt.step()
            ref = {n: p.detach() for n, p in params.items()}
            peer_after = {n: p.detach().to(DTYPE) for n, p in masters.items()}
            failures += compare_to_peer(f"weights after {args.steps} steps (L2)",
                                        read_model(args.after), peer_after, ref, args.peer_factor,
                                        rounding, report, l2_relative_difference)
            return finish(args, report, failures)
        # Adam divides by sqrt(v) + eps: where a gradient is near eps (1e-8) a rounding error in
        # it moves that element's update by up to lr, which momentum carries on; PyTorch's own
        # fp32 AdamW shows the same (README, "Parity with PyTorch"). So the weights are held to
        # 1e-4 in the tensor's L2 norm, and single elements to 1e-3 of the tensor's largest.
        dc = read_model(args.after)
        ref = {n: p.detach() for n, p in params.items()}
        failures += compare(f"weights after {args.steps} steps (L2)", dc, ref,
                            args.weight_tolerance, report, l2_relative_difference)
        failures += compare(f"weights after {args.steps} steps (max)", dc, ref,
                            args.weight_element_tolerance, report)
    return finish(args, report, failures)


def finish(args, report, failures):
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, sort_keys=True)
    for line in failures:
        print("FAIL " + line)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
