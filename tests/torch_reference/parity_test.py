#!/usr/bin/python3
"""dc against the PyTorch reference (dc_reference.py) on one model, world size and accumulation:

    parity_test.py BUILD_DIR PRESET WORLD GAS [bf16-weights] [--backend cuda [--dtype bf16]]
                   [--clip-grad-norm MAX] [--peer bf16]

Plans PRESET with dc-plan --synthetic on a small seeded token file, trains one step from dc's
seeded init and exports it (W0, so no param is at its initial value), then from W0 trains 5
more with --dump-grads and --export, and has the reference check the first step's loss and
gradients (1e-5 relative) and the weights after 5 AdamW steps (dc_reference.py's tolerances).
With bf16-weights the start is W0 rounded to bf16 and saved in HF's sharded layout (index and
two files), as a published bf16 checkpoint is: dc widens bf16 exactly, so the same tolerances.
With --backend cuda the plan is for an H100 in fp32 (--dtype f32) and dc-run trains on the GPU:
the same reference and tolerances hold the cuda kernels to PyTorch; with --dtype bf16 the plan
computes in bf16 (fp32 masters), and dc's differences from the float64 reference are held to
twice PyTorch's own in bf16 from the same start (dc_reference.py --peer-dtype), and at least
bf16's rounding (2^-8); --peer bf16 holds any run to that bar instead of the fixed tolerances
(on the cpu backend, which computes in fp32, a looser check that keeps the bf16 comparison's
own code tested where no GPU is). With --clip-grad-norm the
plan clips the grads by their global norm, and the reference applies
torch.nn.utils.clip_grad_norm_ before each AdamW step (it fails if no step clipped).
"""
import json
import os
import struct
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
TOKENS = 16384
VOCAB = 256  # of the tiny presets


def run(command):
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"FAIL {' '.join(command)}:\n{done.stdout}{done.stderr}")
    return done.stdout


def write_safetensors(path, tensors):
    """name -> (dtype name, shape, raw bytes), in name order, as dc's writer lays them out."""
    header, offset = {}, 0
    for name in sorted(tensors):
        dtype, shape, raw = tensors[name]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for name in sorted(tensors):
            f.write(tensors[name][2])


def to_bf16_shards(src, dst):
    """dc's fp32 export as Hugging Face saves a bf16 model in shards: two files and the index."""
    import torch
    sys.path.insert(0, HERE)
    import dc_reference
    os.mkdir(dst)
    tensors = dc_reference.read_safetensors(os.path.join(src, "model.safetensors"))
    shards, weight_map = [{}, {}], {}
    for i, name in enumerate(sorted(tensors)):
        bits = tensors[name].to(torch.bfloat16).view(torch.int16)  # round to nearest even
        file = f"model-0000{i % 2 + 1}-of-00002.safetensors"
        shards[i % 2][name] = ("BF16", list(bits.shape), bits.numpy().tobytes())
        weight_map[name] = file
    for i, shard in enumerate(shards):
        write_safetensors(os.path.join(dst, f"model-0000{i + 1}-of-00002.safetensors"), shard)
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["torch_dtype"] = "bfloat16"
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)


def main():
    args = sys.argv[1:]
    backend = "cpu"
    if "--backend" in args:
        i = args.index("--backend")
        backend = args[i + 1]
        del args[i:i + 2]
    if backend not in ("cpu", "cuda"):
        sys.exit(f"parity_test.py: --backend {backend}: expected cpu or cuda")
    dtype = "f32"
    if "--dtype" in args:
        i = args.index("--dtype")
        dtype = args[i + 1]
        del args[i:i + 2]
    if dtype not in ("f32", "bf16") or (dtype == "bf16" and backend != "cuda"):
        sys.exit(f"parity_test.py: --dtype {dtype}: expected f32, or bf16 with --backend cuda "
                 "(the cpu backend computes in fp32)")
    peer_dtype = dtype if dtype != "f32" else None
    if "--peer" in args:
        i = args.index("--peer")
        peer_dtype = args[i + 1]
        del args[i:i + 2]
        if peer_dtype != "bf16":
            sys.exit(f"parity_test.py: --peer {peer_dtype}: expected bf16")
    clip = []
    if "--clip-grad-norm" in args:
        i = args.index("--clip-grad-norm")
        clip = ["--clip-grad-norm", args[i + 1]]
        del args[i:i + 2]
    build, preset, world, gas = args[0], args[1], args[2], args[3]
    bf16 = len(args) > 4 and args[4] == "bf16-weights"
    hardware = ["--hardware", "cpu"] if backend == "cpu" else ["--hardware", "h100-sxm",
                                                              "--dtype", dtype]
    peer = ["--peer-dtype", peer_dtype] if peer_dtype else []
    steps = "5"
    tools = os.path.join(build, "tools")
    with tempfile.TemporaryDirectory(prefix=f"dc-parity-{preset}-") as d:
        # A learnable token stream: a fixed LCG walk over the vocabulary.
        state, tokens = 12345, []
        for _ in range(TOKENS):
            state = (state * 1103515245 + 12345) % 2**31
            tokens.append((state >> 16) % VOCAB)
        data = os.path.join(d, "tokens.bin")
        with open(data, "wb") as f:
            f.write(struct.pack(f"<{TOKENS}H", *tokens))
        plan = os.path.join(d, "plan.dcplan")
        run([f"{tools}/dc-plan", "--synthetic", *hardware, "--model", preset, "--world", world,
             "--gas", gas, "--data", data, *clip, "--no-cache", "--quiet", "-o", plan])
        w0, w5, grads = (os.path.join(d, n) for n in ("w0", "w5", "grads"))
        dc_run = [f"{tools}/dc-run", "--backend", backend, plan, "--json"]
        run(dc_run + ["--steps", "1", "--export", w0])
        if bf16:  # the start as a bf16 checkpoint in HF's sharded layout
            to_bf16_shards(w0, w0 + "-bf16")
            w0 += "-bf16"
        out = json.loads(run(dc_run + ["--steps", steps, "--init-from", w0, "--dump-grads", grads,
                                        "--export", w5]))
        result = subprocess.run(
            [sys.executable, os.path.join(HERE, "dc_reference.py"), "--weights", w0, "--dump",
             grads, "--dc-loss", repr(out["losses"][0]), "--after", w5, "--steps", steps, *peer])
        return result.returncode


if __name__ == "__main__":
    sys.exit(main())
