"""The gate cumsum kernel alone (fabric_lin/ops/gla/cumsum.py), at the training shape, over launch settings
(one GPU; microseconds per call).

The kernel forms logsigmoid(logits) / 16 from the gate's bf16 logits and writes its in-chunk cumulative sum
in fp32 (the GLA forward pass); the backward pass's call also writes the decayed keys k * exp(b_last - b).
Each setting's outputs are compared with the first setting's. Prints one JSON document.

    python benchmarks/gate_cumsum.py
    python benchmarks/gate_cumsum.py --shape 4,8192,16,128 --launches 128:4,16:2
"""
import argparse

import torch

from common import out_arg, time_ms, write_result
from fabric_lin.ops.chunked.layout import CHUNK_SIZE as BT, chunk_layout
from fabric_lin.ops.gla.cumsum import gate_cumsum
from fabric_lin.ops.gla.launch import SHIPPED
from fabric_lin.ops.launch import KernelLaunch


def time_us(fn):
    return round(1e3 * time_ms(fn, back_to_back=100), 1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="16,2048,4,128", help="B,T,H,K")
    shipped = f"{SHIPPED.cumsum.BK}:{SHIPPED.cumsum.warps}"
    parser.add_argument("--launches", default=f"{shipped},128:4,32:4,32:2",
                        help=f"key tile:warps, comma separated (shipped: {shipped})")
    parser.add_argument("--out", type=out_arg, help="also write the JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gate_cumsum.py needs a CUDA GPU")
    B, T, H, K = (int(x) for x in args.shape.split(","))
    launches = [tuple(int(x) for x in item.split(":")) for item in args.launches.split(",")]
    torch.manual_seed(0)
    logits = 2 * torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16)
    layout = chunk_layout(None, B, T, BT)
    copy = torch.empty_like(logits, dtype=torch.float32)
    result = {"shape": [B, T, H, K], "shipped": shipped,
              "copy of the forward's bytes (bf16 -> fp32), us": time_us(lambda: copy.copy_(logits)), "launches": {}}
    first = None
    for tile, warps in launches:
        launch = KernelLaunch(BK=tile, warps=warps)
        gc, kd = torch.empty_like(logits, dtype=torch.float32), torch.empty_like(k)
        row = {
            "from logits, us": time_us(lambda: gate_cumsum(logits, gc, None, layout, BT, launch, 16.0)),
            "with the decayed keys, us": time_us(lambda: gate_cumsum(logits, gc, None, layout, BT, launch, 16.0, k, kd)),
        }
        if first is None:
            first = gc.clone(), kd.float()
        else:
            row["max |cumsum - first launch's|"] = (gc - first[0]).abs().max().item()
            row["max |decayed keys - first launch's|"] = (kd.float() - first[1]).abs().max().item()
        result["launches"][f"{tile}:{warps}"] = row
    write_result(result, args.out)


if __name__ == "__main__":
    main()
