"""The GLA gate cumsum kernel alone, at the training shape, over launch settings (one GPU; microseconds per call).

The kernel forms logsigmoid(logits) / 16 from the gate's bf16 logits and writes its in-chunk cumulative sum
in fp32 (the forward pass); the backward pass's call also writes the decayed keys k * exp(b_last - b). Each
setting's outputs are compared with the first setting's. Prints one JSON document.

    python benchmarks/gate_cumsum.py
    python benchmarks/gate_cumsum.py --shape 4,8192,16,128 --launches 128:4,16:2
"""
import argparse
import json

import torch

from fabric_lin.ops.gla import chunk


def time_us(fn, reps=100):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(end) / reps * 1000, 1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="16,2048,4,128", help="B,T,H,K")
    parser.add_argument("--launches", default="128:4,16:2,32:4,32:2", help="key tile:warps, comma separated")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gate_cumsum.py needs a CUDA GPU")
    B, T, H, K = (int(x) for x in args.shape.split(","))
    launches = [tuple(int(x) for x in item.split(":")) for item in args.launches.split(",")]
    torch.manual_seed(0)
    logits = 2 * torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16)
    layout = chunk._chunk_layout(None, B, T)
    copy = torch.empty_like(logits, dtype=torch.float32)
    shipped = chunk.LAUNCH["cumsum_BK"], chunk.LAUNCH["cumsum_warps"]
    result = {"shape": [B, T, H, K], "shipped": list(shipped),
              "copy of the forward's bytes (bf16 -> fp32), us": time_us(lambda: copy.copy_(logits)), "launches": {}}
    first = None
    try:
        for tile, warps in launches:
            chunk.LAUNCH["cumsum_BK"], chunk.LAUNCH["cumsum_warps"] = tile, warps
            gc, kd = torch.empty_like(logits, dtype=torch.float32), torch.empty_like(k)
            row = {
                "from logits, us": time_us(lambda: chunk._gate_cumsum(logits, gc, None, layout, 16.0)),
                "with the decayed keys, us": time_us(lambda: chunk._gate_cumsum(logits, gc, None, layout, 16.0, k, kd)),
            }
            if first is None:
                first = gc.clone(), kd.float()
            else:
                row["max |cumsum - first launch's|"] = (gc - first[0]).abs().max().item()
                row["max |decayed keys - first launch's|"] = (kd.float() - first[1]).abs().max().item()
            result["launches"][f"{tile}:{warps}"] = row
    finally:
        chunk.LAUNCH["cumsum_BK"], chunk.LAUNCH["cumsum_warps"] = shipped
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
