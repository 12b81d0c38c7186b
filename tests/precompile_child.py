"""Run by tests/test_precompile.py in a process of its own, without Triton's interpreter: the kernels are compiled
Triton functions, as on a GPU, and benchmarks/kernel_registers.py's compile-only driver answers Triton's questions
about the device as an H100 would (device 0, compute capability 9.0). A launch then gets as far as its compile and
no further, which is as far as fabric_lin.precompile lets one go; the compiles themselves run for real (Triton's
CUDA backend and its ptxas need no GPU). The fused ops run their Triton path on the CPU tensors as they do in the
interpreter.

    python tests/precompile_child.py find '[{"model": "gla-debug", "batch": 2, "seq": 128}, {"model": "gdn-debug"}]'
    python tests/precompile_child.py compile '{"model": "gla-debug", "kernels": ["_norm_fwd_kernel"], "workers": 2}'

`find` returns, for each model, the kernels found with it cut to one Block of each kind and as a whole; `compile`
has the kernels named compiled by workers, then by this process. With a GPU, `gpu` takes the real driver and
checks that a training step after `precompile_first_step` compiles none of fabric-lin's kernels (eager, then with
compiled Blocks). Each prints one JSON document on its last line.
"""
import json
import os
import sys
import time
from pathlib import Path

assert os.environ.get("TRITON_INTERPRET", "0") != "1", "run without Triton's interpreter"

import torch  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402

import fabric_lin.ops.backend  # noqa: E402
from fabric_lin.config import Config  # noqa: E402
from fabric_lin.model import GPT  # noqa: E402
from fabric_lin.precompile import Precompile, find_kernels, one_block_of_each_kind  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from kernel_registers import CompileOnlyDriver  # noqa: E402


def config_of(spec):
    config = Config.from_name(spec["model"])
    return Config(**{**config.to_dict(), **spec["config"]}) if spec.get("config") else config


def kernels_of(spec, full=False):
    config = config_of(spec)
    if not full:
        config = one_block_of_each_kind(config)
    torch.manual_seed(0)
    model = GPT(config, fused=True)
    input_ids = torch.full((spec.get("batch", 2), spec.get("seq", 128)), 1, dtype=torch.int64)
    rng = torch.get_rng_state()
    kernels, error = find_kernels(model, input_ids, spec.get("eos_id"))
    assert error is None, error
    assert torch.equal(rng, torch.get_rng_state()), "the pass drew from the generator"
    assert all(p.grad is None for p in model.parameters()), "the pass left gradients"
    return kernels


def cache_entries():
    root = os.environ["TRITON_CACHE_DIR"]
    return sorted(os.listdir(root)) if os.path.isdir(root) else []


def our_kernel_entries():
    """The cache's entries that hold a kernel of fabric-lin's (Inductor's own are named triton_*)."""
    root = os.environ["TRITON_CACHE_DIR"]
    return sorted(entry for entry in cache_entries() for name in os.listdir(os.path.join(root, entry))
                  if name.endswith(".json") and name.startswith("_") and not name.startswith("__"))


def gpu(spec):
    import lightning_fabric as L

    from fabric_lin.model import Launches
    from fabric_lin.precompile import precompile_first_step

    fabric = L.Fabric(accelerator="cuda", devices=1, precision="bf16-mixed")
    config, batch, seq = config_of(spec), spec.get("batch", 4), spec.get("seq", 256)
    rng = (torch.get_rng_state(), torch.cuda.get_rng_state())
    logged = []
    precompile = precompile_first_step(fabric, config, dict(fused=True, float8=False, fp8_products=False,
                                                            launch=Launches()), batch, seq, None, logged.append)
    same_rng = torch.equal(rng[0], torch.get_rng_state()) and torch.equal(rng[1], torch.cuda.get_rng_state())
    precompile.wait_for(None)
    found = our_kernel_entries()
    result = {"found": len(precompile.kernels), "log": logged, "same_rng": same_rng, "precompiled": found}
    input_ids = torch.full((batch, seq), 1, dtype=torch.int64, device="cuda")
    for compiled in (False, True):
        with fabric.init_tensor():
            model = GPT(config, fused=True)
        if compiled:
            for block in model.layers:
                block.compile()
        model = fabric.setup(model)
        loss = model(input_ids, targets=input_ids)
        fabric.backward(loss)
        torch.cuda.synchronize()
        result["compiled" if compiled else "eager"] = {"loss": loss.item(), "new": sorted(set(our_kernel_entries()) - set(found))}
    print(json.dumps(result))


def main():
    mode, spec = sys.argv[1], json.loads(sys.argv[2])
    if mode == "gpu":
        return gpu(spec)
    driver.set_active(CompileOnlyDriver())
    fabric_lin.ops.backend._interpreting = lambda: True  # the ops' Triton path takes CPU tensors
    if mode == "find":
        print(json.dumps([{"kernels": [[k.name, k.specialization] for k in kernels_of(one)],
                           "whole_model": [[k.name, k.specialization] for k in kernels_of(one, full=True)]}
                          for one in spec]))
        return
    kernels = kernels_of(spec)
    kernels = [k for k in kernels if k.name.rsplit(".", 1)[1] in spec["kernels"]]
    logged = []
    start = time.time()
    precompile = Precompile(kernels, spec["workers"], log=logged.append)
    hooked = all(len(k.fn.pre_run_hooks) == 1 for k in kernels)
    precompile.wait_for(None)
    seconds = time.time() - start
    after_workers = cache_entries()
    # this process compiling the same specializations, as a launch would, must find every one in the cache
    for kernel in kernels:
        kernel.fn.preload(kernel.specialization)
    print(json.dumps({"names": [k.name for k in kernels], "hooked": hooked,
                      "hooks_left": sum(len(k.fn.pre_run_hooks) for k in kernels), "log": logged,
                      "entries": after_workers, "entries_after_this_process": cache_entries(), "seconds": seconds}))


if __name__ == "__main__":
    main()
