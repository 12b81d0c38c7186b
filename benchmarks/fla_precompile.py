"""Compile flash-linear-attention's Triton autotuning candidates ahead of a comparison, in parallel.

flash-linear-attention autotunes each kernel on first use, compiling every candidate config one after
another: on a fresh H200 its gla-340M training step did not start within 260 s. To measure its steady
state within a time limit, this script splits the work: worker i of n compiles every n-th candidate of
each autotuned kernel (the training step of --model's fla counterpart at --batch_size x --seq_len, gla-340M
at 16 x 2048 by default, and for GLA the kernel benchmark's shapes), with its own autotuning results left
unstored (FLA_CACHE_RESULTS=0), into the shared TRITON_CACHE_DIR. A later process using that cache still
autotunes over every candidate - same choice as without this script - but finds each one compiled. Its
first-step time then no longer shows a cold start; first_step.py measures that from an empty cache.

    TRITON_CACHE_DIR=/tmp/fla-cache python benchmarks/fla_precompile.py --workers 6
    TRITON_CACHE_DIR=/tmp/fla-cache python benchmarks/train_throughput.py --models fabric-lin,fla

With --out it also writes a JSON record of the run (workers, exit codes, seconds): a comparison's
result file should say how long the peer's candidates were compiled beforehand.
"""
import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def worker(i: int, n: int, model_name: str, batch_size: int, seq_len: int, kernels_only: bool) -> None:
    os.environ["FLA_CACHE_RESULTS"] = "0"  # read when fla is imported: this worker's choices are not kept
    from triton.runtime.autotuner import Autotuner

    all_candidates = Autotuner.prune_configs

    def my_share(self, kwargs):
        configs = all_candidates(self, kwargs)
        return configs[i::n] or configs[:1]

    Autotuner.prune_configs = my_share
    import torch

    sys.path.insert(0, str(HERE))
    from gla_kernel import SHAPES, gla_inputs, load_fla
    from train_throughput import fla_model

    from fabric_lin.config import Config

    if not kernels_only:
        config = Config.from_name(model_name)
        model, loss_fn = fla_model(config)
        model = model.cuda().to(torch.bfloat16).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
        data = torch.randint(0, config.vocab_size, (batch_size, seq_len + 1), device="cuda")
        loss_fn(data[:, :-1].contiguous(), data[:, 1:].contiguous()).backward()
        optimizer.step()
        torch.cuda.synchronize()
        print(f"worker {i}/{n}: training step {batch_size} x {seq_len} compiled", flush=True)
        del model, optimizer
        torch.cuda.empty_cache()
    if Config.from_name(model_name).block_type != "gla":
        return  # the kernel benchmark's shapes below are chunk_gla's
    fla, error = load_fla()
    if fla is None:
        raise SystemExit(f"flash-linear-attention is not usable: {error}")
    for shape in SHAPES:
        inputs, do = gla_inputs(*shape)
        fla(*inputs).backward(do)
        torch.cuda.synchronize()
        print(f"worker {i}/{n}: chunk_gla {shape} compiled", flush=True)


def main():
    from common import out_arg

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=6, help="processes, spread over the visible GPUs")
    parser.add_argument("--model", default="gla-340M",
                        help="the fabric-lin model name whose fla counterpart's training step is compiled (GLA or GDN)")
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--worker_gib", type=float, default=None,
                        help="GPU memory one worker needs (default: its training step's, 36 at 16 x 2048 and in "
                             "proportion to --batch_size x --seq_len, at least 8; 8 with --kernels_only)")
    parser.add_argument("--kernels_only", action="store_true",
                        help="only chunk_gla at the kernel benchmark's shapes (for gla_kernel.py), not the training step")
    parser.add_argument("--out", type=out_arg, help="also write a JSON record of the run here (with the command, date and machine)")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.workers, args.model, args.batch_size, args.seq_len, args.kernels_only)
        return
    if "TRITON_CACHE_DIR" not in os.environ:
        raise SystemExit("set TRITON_CACHE_DIR: the compiled candidates go there, for the comparison to reuse")
    import torch

    gpus = torch.cuda.device_count()
    if gpus == 0:
        raise SystemExit("needs a CUDA GPU")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(str(g) for g in range(gpus))).split(",")
    # each worker runs a whole training step of the fla model (28.4 GiB at 16 x 2048, 15-17 GiB at 8 x 2048) unless
    # --kernels_only: more workers than fit side by side on the GPUs run out of memory and leave their share uncompiled
    if args.worker_gib is None:
        tokens = args.batch_size * args.seq_len
        args.worker_gib = 8.0 if args.kernels_only else max(8.0, 36.0 * tokens / (16 * 2048))
    per_worker = args.worker_gib * 2**30
    fits = [int(torch.cuda.mem_get_info(g)[0] // per_worker) for g in range(gpus)]
    # one slot per worker that fits, taken GPU by GPU in turn
    slots = [visible[g] for round_ in range(max(fits)) for g in range(gpus) if round_ < fits[g]] or visible[:1]
    if args.workers > len(slots):
        print(f"--workers {args.workers}: only {len(slots)} fit in the free memory of {gpus} GPU(s) at "
              f"{args.worker_gib} GiB each; running {len(slots)}", flush=True)
        args.workers = len(slots)
    start = time.time()
    procs = [
        subprocess.Popen([sys.executable, __file__, "--worker", str(i), "--workers", str(args.workers),
                          "--model", args.model, "--batch_size", str(args.batch_size), "--seq_len", str(args.seq_len)]
                         + (["--kernels_only"] if args.kernels_only else []),
                         env=dict(os.environ, CUDA_VISIBLE_DEVICES=slots[i]))
        for i in range(args.workers)
    ]
    codes = [p.wait() for p in procs]
    seconds = time.time() - start
    print(f"{args.workers} workers on {gpus} GPU(s): exit codes {codes}, {seconds:.0f} s", flush=True)
    if args.out:
        from common import write_result

        write_result({"workers": args.workers, "gpus": gpus, "model": args.model, "batch_size": args.batch_size, "seq_len": args.seq_len,
                      "kernels_only": args.kernels_only, "exit_codes": codes, "seconds": round(seconds)},
                     args.out, fla_ran=True)
    sys.exit(max(codes, key=abs))


if __name__ == "__main__":
    main()
