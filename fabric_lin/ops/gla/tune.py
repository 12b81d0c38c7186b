"""Opt-in search over the GLA kernels' launch table (`LAUNCH` in chunk.py).

The shipped table needs no search, so nothing is timed at start-up. `tune_launch` is for those who want
the last few percent on a new GPU or layer shape: it times forward+backward at one shape for each
setting of SEARCH_SPACE and keeps the fastest whose output and gradients agree with those of the table
in place at the start (the shipped one, unless changed).

The settings act mostly on separate kernels (state passes, output, dv, dq/dk) whose times add up, so
each group is searched exhaustively with the others held, and the groups are swept again until nothing
improves: close to the best of the full product of every setting, at a fraction of its cost.

Results are keyed by what decides the kernels' code and tiling - GPU, dtype, heads, key and value
dims, Triton version - and not by batch size or sequence length: a run with a new batch size or
context reuses the settings found (`cache_file`), it does not search again.
"""
import json
import os
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
import triton

from fabric_lin.ops.gla import chunk

# one group per kernel (or structural choice); within a group every combination is tried
SEARCH_SPACE: List[Dict[str, tuple]] = [
    # sequential state passes; narrow tiles give a long single sequence (few heads) more programs; the next
    # chunk's loads issued early (prefetch) took the place of a second pipeline stage, which lost
    {"state_BK": (64, 32), "state_BV": (64, 128, 32), "state_warps": ("auto", 4, 8), "state_prefetch": (True, False)},
    # forward output kernel; and below, dq/dk. 16 warps hold the same tiles in half the registers per thread
    # (benchmarks/kernel_registers.py: 128 per thread, one 16-warp program per SM where there are two 4-warp
    # output programs or one 8-warp dq/dk program); on an H200 they lost at every shape (run AA1: 1.39 and
    # 1.52 against 1.37 ms at the gla-340M layer, 4.29 and 5.03 against 4.18 at 8K)
    {"output_warps": (8, 4, 16), "BV_out": (128, 256), "separate_scores": (False, True)},
    {"scores_warps": (4, 8)},  # the separate score kernel, where chosen
    # a register cap (0: none) gives dv three programs per multiprocessor; on dq/dk and the output kernel
    # caps spilled and lost on an H200 (tutorials/performance.md), as did a second pipeline stage for dq/dk,
    # so the search leaves those keys as the table has them
    {"dv_warps": (4, 8), "dv_maxnreg": (168, 0)},
    {"dqk_warps": (8, 4, 16), "single_dqk_warps": (4, 8)},
    # dq/dk's levels inside 16- or 32-row blocks as products batched over the blocks (0: as 64x64 products),
    # with the chunk's own tiles loaded before or after its state part (Triton 3.6: 42 spilled registers at
    # 8K with 16-row blocks and the loads after it, 54 for 64x64 products; 46 against 26 at the gla-340M
    # layer); the forward's scores split the same way
    {"dqk_fine_rows": (0, 16, 32), "dqk_early_loads": ("auto", False)},
    {"output_fine_rows": (0, 16, 32)},
    # the decayed keys formed once in the backward pass or by each of its kernels ("saved" trades memory for
    # speed, so the search leaves it to the user)
    {"decayed_keys": ("backward", "recompute")},
    # key tiles of the chunk-parallel kernels: 32 gives dq/dk twice the programs, each holding smaller tiles
    {"BK": (64, 32)},
    {"stages": (1, 2)},  # pipelining of the other chunk-parallel kernels
    {"fused_bwd_states": (True, False), "both_states_warps": ("auto", 8), "separate_cumsum": (True, False),
     "state_split": (False, True)},
]


def launch_key(H: int, K: int, V: int, dtype: torch.dtype, device: torch.device) -> str:
    """What the result depends on; batch size and sequence length are left out on purpose."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return f"{name}|{dtype}|H={H}|K={K}|V={V}|triton={triton.__version__}"


def _combinations(group: Dict[str, tuple]) -> List[Dict]:
    combos = [{}]
    for key, values in group.items():
        combos = [dict(c, **{key: v}) for c in combos for v in values]
    return combos


def rel_rms(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative RMS difference of x from ref (in fp32)."""
    x, ref = x.float(), ref.float()
    return ((x - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-12)).item()


def tune_launch(
    B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype = torch.bfloat16, device: str = "cuda",
    max_rel_error: float = 0.02, max_rounds: int = 2, log: Callable[[str], None] = print,
    bench: Optional[Callable] = None,
) -> Dict:
    """Search LAUNCH at shape (B, T, H, K, V); leaves the best setting in chunk.LAUNCH and returns
    {"launch", "fwd_bwd_ms", "shipped_fwd_bwd_ms", "tried"}. A setting whose output or any gradient is
    further than max_rel_error (relative RMS) from the table in place at the start is rejected, as is one
    that fails to compile. `bench(fn, leaves)` gives fn's milliseconds (default: triton.testing.do_bench)."""
    if bench is None:
        from triton.testing import do_bench

        def bench(fn, leaves):
            return do_bench(fn, warmup=10, rep=40, grad_to_none=leaves)

    torch.manual_seed(0)
    q, k = (torch.randn(B, T, H, K, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    v = torch.randn(B, T, H, V, device=device, dtype=dtype, requires_grad=True)
    gk = (F.logsigmoid(torch.randn(B, T, H, K, device=device)) / 16).requires_grad_(True)
    do = torch.randn(B, T, H, V, device=device, dtype=dtype)
    leaves = [q, k, v, gk]

    def outputs():
        for x in leaves:
            x.grad = None
        o, _ = chunk.chunk_gla_triton(q, k, v, gk)
        o.backward(do)
        return [o.detach()] + [x.grad for x in leaves]

    def fwd_bwd():
        chunk.chunk_gla_triton(q, k, v, gk)[0].backward(do)

    start = dict(chunk.LAUNCH)
    reference = outputs()
    tried = []

    def measure(setting: Dict) -> Optional[float]:
        chunk.LAUNCH.clear()
        chunk.LAUNCH.update(setting)
        try:
            errors = [rel_rms(x, ref) for x, ref in zip(outputs(), reference)]
            worst = max(errors)
            if not worst <= max_rel_error:  # also rejects NaN
                tried.append({"setting": setting, "rejected": f"relative RMS error {worst:.3g} > {max_rel_error}"})
                return None
            ms = bench(fwd_bwd, leaves)
        except Exception as e:  # shared memory or registers exceeded: not a candidate
            tried.append({"setting": setting, "rejected": f"{type(e).__name__}: {str(e)[:200]}"})
            return None
        tried.append({"setting": setting, "fwd_bwd_ms": ms})
        return ms

    best, best_ms = dict(start), measure(dict(start))
    if best_ms is None:
        raise RuntimeError(f"the launch table in place does not run at shape {(B, T, H, K, V)}: {tried[-1]}")
    shipped_ms = best_ms
    for _ in range(max_rounds):
        improved = False
        for group in SEARCH_SPACE:
            for change in _combinations(group):
                candidate = dict(best, **change)
                if candidate == best:
                    continue
                ms = measure(candidate)
                if ms is not None and ms < best_ms:
                    best, best_ms, improved = candidate, ms, True
        if not improved:
            break
    chunk.LAUNCH.clear()
    chunk.LAUNCH.update(best)
    changed = {k: v for k, v in best.items() if start.get(k) != v}
    log(f"GLA launch search at {(B, T, H, K, V)} {dtype}: {len(tried)} settings, forward+backward "
        f"{shipped_ms:.3f} ms -> {best_ms:.3f} ms with {changed or 'the table unchanged'}")
    return {"launch": best, "fwd_bwd_ms": best_ms, "shipped_fwd_bwd_ms": shipped_ms, "tried": tried}


def tuned_launch(
    B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype, cache_file: Optional[Path] = None,
    device: str = "cuda", log: Callable[[str], None] = print, **search,
) -> Dict:
    """The launch table for (H, K, V, dtype) on this GPU: read from cache_file when it holds this key,
    searched (tune_launch at B, T) and written there otherwise. Installs it in chunk.LAUNCH."""
    key = launch_key(H, K, V, dtype, torch.device(device))
    cached = {}
    if cache_file is not None and Path(cache_file).exists():
        try:
            cached = json.loads(Path(cache_file).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{cache_file}: not a JSON launch cache ({e}); delete it to search again") from e
    if key in cached:
        unknown = set(cached[key]) - set(chunk.LAUNCH)
        if unknown:
            raise ValueError(f"{cache_file}: entry {key!r} has unknown launch keys {sorted(unknown)}; delete it to search again")
        chunk.LAUNCH.update(cached[key])
        log(f"GLA launch settings for {key} from {cache_file}")
        return dict(chunk.LAUNCH)
    result = tune_launch(B, T, H, K, V, dtype, device, log=log, **search)
    if cache_file is not None:
        cached[key] = result["launch"]
        Path(cache_file).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(f"{cache_file}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(cached, indent=1) + "\n")
        tmp.replace(cache_file)  # atomic: a reader never sees half a file
    return result["launch"]
