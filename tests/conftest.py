import contextlib
import functools
import json
import math
import os
import warnings

import pytest
import torch
import torch.nn.functional as F

import fabric_lin_process

pytest_plugins = ["pytester"]  # test_fabric_lin_process runs two tests with this conftest

# Without a GPU the Triton kernels run in Triton's interpreter. The variable must be set before any
# kernel is defined, and fabric_lin.model imports the fused kernels, so it is set here, before any
# test module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    import triton_interpreter

    triton_interpreter.skip_repatching_in_helper_calls()
    triton_interpreter.reuse_type_objects()
    triton_interpreter.share_tensor_shapes()
    triton_interpreter.skip_unasserted_overflow_checks()
    triton_interpreter.skip_broadcasting_equal_shapes()

MAX_WORKERS = 4  # pytest-xdist's `-n auto` (pyproject's addopts): one worker per core, at most this many


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# Under pytest-xdist each worker computes with its share of the cores, and so do the subprocesses it starts
# (pretrain honours OMP_NUM_THREADS): more threads than cores only spin-wait on each other, many times slower.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1 and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, usable_cores() // _workers))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: a worker per core the process may use, at most MAX_WORKERS (each holds torch and a model or two;
    the two-process tests start two more). PYTEST_XDIST_AUTO_NUM_WORKERS, where set, decides instead."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    return min(usable_cores(), MAX_WORKERS)


@functools.lru_cache(maxsize=None)
def modules_with_module_fixtures() -> frozenset:
    """The test modules (paths relative to the repository) that define a module-scoped fixture, read from their
    source (the controller of pytest-xdist collects nothing)."""
    import ast
    from pathlib import Path

    here = Path(__file__).parent
    found = set()
    for path in here.glob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            for decorator in getattr(node, "decorator_list", ()):
                if isinstance(decorator, ast.Call) and any(
                        k.arg == "scope" and getattr(k.value, "value", None) == "module" for k in decorator.keywords):
                    found.add(f"{here.name}/{path.name}")
    return frozenset(found)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """(pytest-xdist's controller) Each worker is told the modules whose tests go to one worker together, for its
    order of the tests (pytest_collection_modifyitems)."""
    node.workerinput["modules_with_module_fixtures"] = sorted(modules_with_module_fixtures())


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist, the slow tests (subprocesses that train) first, then the modules whose tests go to one
    worker together (pytest_xdist_make_scheduler), then the other tests, so that no worker starts a long one, or a
    module's share, when the others have run out of work: the work left at the end is single tests (the order within
    each kind kept; in one process, the order of the files)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        together = set(getattr(config, "workerinput", {}).get("modules_with_module_fixtures", ()))

        def kind(item) -> int:
            if item.get_closest_marker("slow") is not None:
                return 0
            return 1 if item.nodeid.split("::", 1)[0] in together else 2

        items.sort(key=kind)


def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's default distribution (`--dist load`), except that the tests of a module with a module-scoped
    fixture (a corpus, a tokenizer, a training run) go to one worker together, which builds it once; every other test
    goes to whichever worker is free (the e2e runs' session fixtures are built at most once per worker). Work is handed
    out in the workers' order (slow tests first, then such modules: pytest_collection_modifyitems), not by the size
    of each module's share. An explicit --dist keeps xdist's own scheduler. (xdist's `--dist loadgroup` does not
    group under pytest 9.2: pytest-dev/pytest-xdist#1386.)"""
    if config.getoption("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    whole = modules_with_module_fixtures()
    config.option.loadscopereorder = False

    class ModuleFixturesTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if module in whole else nodeid

    return ModuleFixturesTogether(config, log)


@pytest.fixture(autouse=True)
def no_process_left():
    """Whatever a test's outcome, no process it started through fabric_lin_process (nor any those started) outlives
    it: a rank left waiting for a peer that hung would hold a core until its process group's timeout, and keep pytest
    from exiting. One whose main process was still running is named in a warning: the test neither waited for it
    nor stopped it."""
    yield
    for job in fabric_lin_process.stop_all():
        warnings.warn(f"still running at the end of the test, killed: {fabric_lin_process.describe([job])}")


def restore_environment(before: dict) -> None:
    """os.environ back to `before`, but for PYTEST_CURRENT_TEST (pytest's own)."""
    for key in set(os.environ) - set(before) - {"PYTEST_CURRENT_TEST"}:
        del os.environ[key]
    for key, value in before.items():
        if os.environ.get(key) != value and key != "PYTEST_CURRENT_TEST":
            os.environ[key] = value


@pytest.fixture(autouse=True)
def environment_kept():
    """What a test changes in os.environ is undone after it. Lightning's seed_everything (pretrain's main,
    build_model) sets PL_GLOBAL_SEED and PL_SEED_WORKERS, Fabric's launch WORLD_SIZE, LOCAL_RANK and more: left
    set, a later `--devices 2` run takes itself for a launched rank, and every run a later test of this worker starts
    differs from an environment copied before (helpers.CPU_ONLY), so that it starts as a new Python instead of a fork
    (fabric_lin_process.forkable): ~4 s of imports each, for each process of a run."""
    before = dict(os.environ)
    yield
    restore_environment(before)


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    """What a module- or session-scoped fixture changes in os.environ while it is set up is undone once it is: such
    a fixture is set up before the first test that uses it, outside that test's environment_kept, and one that trains
    in this process (evaluate's training run) would leave Lightning's variables set for the rest of the worker. (No
    fixture here sets a variable for the tests that use it; one that did would have to set it in each test.)"""
    if fixturedef.scope == "function":
        return (yield)
    before = dict(os.environ)
    try:
        return (yield)
    finally:
        restore_environment(before)


@pytest.fixture(scope="module")
def one_thread():
    """For modules of many tiny tensor ops (token-by-token recurrences, the Triton interpreter's programs):
    intra-op threads only add synchronisation, and on a shared CPU their spin-waiting slows them many times."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def block_elements(config) -> int:
    """The elements of one program's block under a Triton autotuning config: the product of its integer
    meta-parameters (BD, BK, BV, BT, ...)."""
    return math.prod(v for v in config.kwargs.values() if isinstance(v, int) and not isinstance(v, bool))


@contextlib.contextmanager
def fla_in_interpreter():
    """Within: flash-linear-attention's (fla's) kernels run in Triton's interpreter (TRITON_INTERPRET=1), where two
    things of compiled Triton that fla relies on are missing; both are put back on leaving.

    - autotuning: the interpreter has no benchmarker (Triton raises "0 active drivers"), so each autotuned kernel
      runs with the config of the largest blocks (the product of its block sizes; the first such). Block sizes
      change the order of fp32 sums, not the function; the interpreter runs a kernel's programs one after another,
      each tensor operation costing about the same whatever its size, so fewer and larger programs are faster
      (fla's short convolution: 8 times fewer programs with blocks of 128 channels than of 16).
    - loop variables: compiled Triton makes a `for i in range(n)` variable a tensor, the interpreter a Python int,
      so fla's `i_t.to(tl.int64)` in chunk_fwd_kernel_h (the chunked mode, T > 64) fails with "'int' object has no
      attribute 'to'". Loop variables are converted to tensors as the interpreter already does for every
      assignment. (The interpreter rewrites a kernel once, at its first run: one first run inside keeps the
      conversion, which changes nothing of what a kernel computes.)

    fla's kernels themselves run unchanged."""
    import ast

    import triton.runtime.autotuner as autotuner
    import triton.runtime.interpreter as interpreter

    prune = autotuner.Autotuner.prune_configs
    transformer = interpreter.FunctionRewriter.ast_transformer

    class LoopVariablesAsTensors(interpreter.ASTTransformer):
        def visit_For(self, node):
            self.generic_visit(node)
            if isinstance(node.target, ast.Name):
                name = node.target.id
                same = ast.Assign(targets=[ast.Name(id=name, ctx=ast.Store())], value=ast.Name(id=name, ctx=ast.Load()))
                node.body.insert(0, self.visit_Assign(same))  # i = to_tensor(i)
            return node

    autotuner.Autotuner.prune_configs = lambda self, kwargs: [max(prune(self, kwargs), key=block_elements)]
    interpreter.FunctionRewriter.ast_transformer = LoopVariablesAsTensors()
    try:
        yield
    finally:
        autotuner.Autotuner.prune_configs = prune
        interpreter.FunctionRewriter.ast_transformer = transformer


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative RMS error of a against the reference b, in fp32."""
    a, b = a.float(), b.float()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-12)).item()


def check_against_fp32(a, b, dtype, name):
    """a (computed in dtype) against b (the reference computed in fp32 from the same inputs): element-wise in
    fp32; in bf16 by relative RMS error, since a sum over many rows (a norm weight's gradient) in bf16 can
    put single elements well off while the whole is as close as bf16 allows."""
    from helpers import check

    if dtype == torch.float32:
        check(a, b, dtype, name)
        return
    error = rel_rms(a, b)
    assert error <= 1e-2, f"{name}: relative RMS error {error:.4f} against the fp32 reference (at most 0.01)"


def compiled_graph_ops(f, *inputs, graphs=None):
    """Compile f with AOT autograd, run it forward and backward on `inputs` (leaves that need grad; the
    output a scalar) and return (the compiled output, the op names called in the forward graph, those
    in the backward graph): what torch.compile kept as whole ops. graphs: a dict that is given the graph
    modules themselves, {"forward": [...], "backward": [...]}."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    graphs = graphs if graphs is not None else {}
    graphs.update(forward=[], backward=[])

    def capture(kind):
        def compiler(gm, example_inputs):
            graphs[kind].append(gm)
            return make_boxed_func(gm.forward)
        return compiler

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=capture("forward"), bw_compiler=capture("backward"))
    out = torch.compile(f, backend=backend, fullgraph=True)(*inputs)
    out.backward()
    names = {
        kind: {str(node.target) for gm in gms for node in gm.graph.nodes if node.op == "call_function"}
        for kind, gms in graphs.items()
    }
    return out, names["forward"], names["backward"]


def gated_delta_rule_fp64(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=True, cu_seqlens=None,
                          use_qk_l2norm=False):
    """S_t = exp(g_t) S_{t-1}; S_t += beta_t k_t (v_t - S_t^T k_t)^T; o_t = S_t^T (scale q_t), token by token in
    fp64, documents of cu_seqlens each from their own initial state; the ops' test reference (output_final_state is
    taken for their signature: the final state is always returned). Returns (o, final state [N, H, K, V])."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    if use_qk_l2norm:  # fla's l2norm: eps inside the square root
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = 1 / math.sqrt(K) if scale is None else scale
    spans = [(0, T)] if cu_seqlens is None else list(zip(cu_seqlens.tolist()[:-1], cu_seqlens.tolist()[1:]))
    outputs, finals = [], []
    for i, (start, end) in enumerate(spans):
        if initial_state is None:
            S = q.new_zeros(B, H, K, V)
        else:
            S = initial_state.double() if cu_seqlens is None else initial_state[i : i + 1].double()
        for t in range(start, end):
            S = torch.exp(g[:, t, :, None, None]) * S
            error = v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], S)
            S = S + torch.einsum("bhk,bhv->bhkv", k[:, t], beta[:, t, :, None] * error)
            outputs.append(torch.einsum("bhk,bhkv->bhv", scale * q[:, t], S))
        finals.append(S)
    o = torch.stack(outputs, dim=1) if outputs else q.new_zeros(B, 0, H, V)
    return o, torch.cat(finals)


def delta_rule_fp64(q, k, v, beta, scale=None, initial_state=None, output_final_state=True, cu_seqlens=None,
                    use_qk_l2norm=False):
    """DeltaNet's delta rule from its definition, token by token in fp64, per head:
        S_t = S_{t-1} + beta_t k_t (v_t - S_{t-1}^T k_t)^T,    o_t = S_t^T (scale q_t),
    q and k L2-normalised first where asked (fla's eps 1e-6 inside the square root); documents of cu_seqlens each
    from their own initial state (zeros without one). The test reference of the gated delta rule's ops called with
    g=None, written apart from gated_delta_rule_fp64 and fabric_lin/ops/gdn/naive.py: no decay appears in it at all.
    output_final_state is taken for the ops' signature (the final state is always returned).
    Returns (o [B, T, H, V], final state [N, H, K, V])."""
    q, k, v, beta = (x.double() for x in (q, k, v, beta))
    if use_qk_l2norm:
        q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    bounds = [0, T] if cu_seqlens is None else cu_seqlens.tolist()
    rows, finals = [], []
    for n, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        if initial_state is None:
            S = torch.zeros(B, H, K, V, dtype=torch.float64)
        else:
            S = (initial_state if cu_seqlens is None else initial_state[n : n + 1]).double()
        for t in range(start, end):
            k_t, v_t = k[:, t, :, :, None], v[:, t, :, None, :]  # [B, H, K, 1], [B, H, 1, V]
            predicted = (S * k_t).sum(-2, keepdim=True)  # S_{t-1}^T k_t: [B, H, 1, V]
            S = S + beta[:, t, :, None, None] * k_t * (v_t - predicted)
            rows.append((S * (scale * q[:, t, :, :, None])).sum(-2))  # [B, H, V]
        finals.append(S)
    o = torch.stack(rows, dim=1) if rows else torch.zeros(B, 0, H, V, dtype=torch.float64)
    return o, torch.cat(finals)


def gated_linear_attention_fp64(q, k, v, gk, scale=None, initial_state=None, cu_seqlens=None):
    """S_t = diag(exp(gk_t)) S_{t-1} + k_t^T v_t; o_t = (scale q_t) S_t, token by token in fp64, documents of cu_seqlens
    each from their own initial state: the GLA ops' test reference, written apart from fabric_lin/ops/gla/naive.py.
    Returns (o, final state [N, H, K, V])."""
    q, k, v, gk = (x.double() for x in (q, k, v, gk))
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = 1 / math.sqrt(K) if scale is None else scale
    spans = [(0, T)] if cu_seqlens is None else list(zip(cu_seqlens.tolist()[:-1], cu_seqlens.tolist()[1:]))
    outputs, finals = [], []
    for i, (start, end) in enumerate(spans):
        if initial_state is None:
            S = q.new_zeros(B, H, K, V)
        else:
            S = initial_state.double() if cu_seqlens is None else initial_state[i : i + 1].double()
        for t in range(start, end):
            S = torch.exp(gk[:, t, :, :, None]) * S + k[:, t, :, :, None] * v[:, t, :, None, :]
            outputs.append(torch.einsum("bhk,bhkv->bhv", scale * q[:, t], S))
        finals.append(S)
    return torch.stack(outputs, dim=1), torch.cat(finals)


# GLA's kernel tests (test_gla_triton.py, test_gla_triton_gpu.py): their inputs, the op and its references,
# run forward and backward


def gla_inputs(B, T, H, K, V, N=None, seed=0, device="cpu", dtype=torch.float32, gate_logit=None):
    """GLA's q, k, v (in `dtype`), the log gate gk = logsigmoid(logits) / 16 in fp32 (logits standard normal, or all
    `gate_logit`) and N (by default B) initial states [N, H, K, V], on `device`."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=g)
    k = torch.randn(B, T, H, K, generator=g)
    v = torch.randn(B, T, H, V, generator=g)
    logits = torch.randn(B, T, H, K, generator=g) if gate_logit is None else torch.full((B, T, H, K), gate_logit)
    gk = F.logsigmoid(logits) / 16
    h0 = torch.randn(N or B, H, K, V, generator=g)
    q, k, v = (x.to(device=device, dtype=dtype) for x in (q, k, v))
    return q, k, v, gk.to(device), h0.to(device)


def gla_forward_backward(fn, q, k, v, gk, h0, cu_seqlens, seed=1):
    """Output, final state and gradients of sum(o * do) + sum(ht * dht), inputs taken as leaves."""
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, gk)]
    h0 = None if h0 is None else h0.detach().clone().requires_grad_(True)
    o, ht = fn(*leaves, initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens)
    g = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=g).to(o.device)
    dht = torch.randn(ht.shape, generator=g).to(o.device)
    ((o.float() * do).sum() + (ht * dht).sum()).backward()
    grads = [x.grad for x in leaves] + ([h0.grad] if h0 is not None else [])
    return [o, ht] + grads


def triton_gla(*args, **kwargs):
    """chunk_gla on its Triton kernels (in the interpreter without a GPU)."""
    from fabric_lin.ops.gla import chunk_gla

    return chunk_gla(*args, backend="triton", **kwargs)


GLA_NAMES = ["o", "ht", "dq", "dk", "dv", "dgk", "dh0"]  # gla_forward_backward's outputs, in order


def gpu_of(monkeypatch, multiprocessors):
    """The launch decisions made for a GPU of this many multiprocessors (the interpreter counts one): with many,
    a state pass of few programs takes the split form (chunk-parallel updates and a scan)."""
    from fabric_lin.ops import launch

    monkeypatch.setattr(launch, "multiprocessors", lambda device: multiprocessors)


def naive_from_logits(q, k, v, logits, **kwargs):
    """The naive recurrence with the gate given as logits: gk = logsigmoid(logits) / 16."""
    from fabric_lin.ops.gla import naive_recurrent_gla

    return naive_recurrent_gla(q, k, v, F.logsigmoid(logits.float()) / 16, **kwargs)


def triton_from_logits(q, k, v, logits, **kwargs):
    """chunk_gla_from_logits (normalizer 16) on its Triton kernels."""
    from fabric_lin.ops.gla import chunk_gla_from_logits

    return chunk_gla_from_logits(q, k, v, logits, 16, backend="triton", **kwargs)


def mixed_spread_gates(T, H, K, strong_rows, strong_cols, seed=0, strong_logit=-30.0):
    """Gates of logsigmoid(randn) / 16 (a spread of ~2 over a chunk), but logsigmoid(strong_logit) / 16 at the
    strong rows and columns: -30 decays by ~1.9 per step, a spread of ~60 from the chunk's middle row, past
    the single-reference limit; -20 by ~1.25, a spread of ~40, just inside it."""
    logits = torch.randn(1, T, H, K, generator=torch.Generator().manual_seed(seed))
    logits[:, strong_rows, :, strong_cols] = strong_logit
    return F.logsigmoid(logits) / 16


def gated_delta_rule_inputs(B, T, H, K, V, gate="mixed", normalized_keys=True, n_states=None, seed=0, device="cpu",
                            dtype=torch.float32):
    """q, k, v, beta in `dtype`, g and h0 in fp32, on `device` (drawn on the CPU, so the same values anywhere). Gates: slow, g ~ -0.01 per step (the state carries across many
    chunks); fast, ~ -5 per step (exp(g) ~ 0.007: the state forgets within a few tokens; in-chunk cumulative
    sums reach ~-320, where an exp(-b) anywhere would overflow fp32); forgetting, uniform over -40 to -10 per step
    (exp(g) < 5e-5: the state is gone after one token, and the true gradient of g is tiny, ~1e-7, beside the
    O(1) terms a chunked backward pass assembles it from); mixed, log-uniform over -1e-3 to -8, fast and slow
    tokens side by side in a chunk. normalized_keys: |k| <= 1, keeping beta |k|^2 < 2 where the delta rule
    contracts (raw Gaussian keys are for use_qk_l2norm, normalised inside the op)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, H, K, generator=gen)
    if normalized_keys:
        k = F.normalize(k, dim=-1) * (0.5 + 0.5 * torch.rand(B, T, H, 1, generator=gen))
    v = torch.randn(B, T, H, V, generator=gen)
    u = torch.rand(B, T, H, generator=gen)
    if gate == "fast":
        g = -5.0 * (0.5 + u)
    elif gate == "slow":
        g = -0.01 * (0.5 + u)
    elif gate == "forgetting":
        g = -10.0 - 30.0 * u
    else:
        g = -torch.exp(math.log(1e-3) + u * (math.log(8.0) - math.log(1e-3)))
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    h0 = torch.randn(n_states or B, H, K, V, generator=gen)
    q, k, v, beta = (x.to(device=device, dtype=dtype) for x in (q, k, v, beta))
    return q, k, v, g.to(device), beta, h0.to(device)


def gdn_step_reference(q, k, v, g, beta, state, scale, use_qk_l2norm):
    """One token of the gated delta rule in fp64, head by head: the fused decoding step's test reference."""
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    B, H, K = q.shape
    V = v.shape[-1]
    if use_qk_l2norm:  # fla's l2norm: eps inside the square root
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    S = torch.zeros(B, H, K, V, dtype=torch.float64) if state is None else state.double().clone()
    o = torch.zeros(B, H, V, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            s = S[b, h] * torch.exp(g[b, h])  # [K, V]
            kk = k[b, h][:, None]  # [K, 1]
            s = s + beta[b, h] * kk @ (v[b, h][None, :] - kk.T @ s)
            S[b, h] = s
            o[b, h] = (scale * q[b, h])[None, :] @ s
    return o, S


def gdn_inputs(B, H, K, V, seed=0, gate="slow", T=None):
    """The decoding step's q, k, v, the log decay g, beta and a state; [B, H, ...] per token (with T: [B, T, H, ...])."""
    gen = torch.Generator().manual_seed(seed)
    lead = (B, H) if T is None else (B, T, H)
    q, k = torch.randn(*lead, K, generator=gen), torch.randn(*lead, K, generator=gen)
    v = torch.randn(*lead, V, generator=gen)
    u = torch.rand(*lead, generator=gen)
    g = -0.02 * u if gate == "slow" else -4.0 - 4.0 * u  # exp(g): 0.98..1, or 0.0003..0.02
    beta = torch.rand(*lead, generator=gen)
    state = torch.randn(B, H, K, V, generator=gen)
    return q, k, v, g, beta, state


def export_model(model, config, out_dir, dtype: str = "float32"):
    """`model`'s weights written as a model directory (out_dir/model) and exported into out_dir/hf as `fabric-lin
    convert_to_hf` does; returns the export's directory."""
    from pathlib import Path

    from fabric_lin.convert.hf import convert_to_hf
    from fabric_lin.convert.model_dir import save_model_dir

    model_dir, hf_dir = Path(out_dir) / "model", Path(out_dir) / "hf"
    model_dir.mkdir(parents=True)
    save_model_dir({k: v.detach().cpu() for k, v in model.state_dict().items()}, config, model_dir)
    convert_to_hf(model_dir, hf_dir, dtype=dtype)
    return hf_dir


def export_to_fla(model, config, dtype: str = "float32", **fla_config):
    """fla's model (on the CPU, in `dtype`) loaded from `model`'s weights exported as `fabric-lin convert_to_hf`
    does, and the config.json the export wrote. `fla_config`: fields of fla's config set otherwise when it loads
    (attn_mode, e.g.: fla's chunked DeltaNet kernel refuses fp32)."""
    import json
    import tempfile

    from transformers import AutoModelForCausalLM

    import fla  # noqa: F401  (registers fla's model types with transformers)

    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = export_model(model, config, tmp, dtype)
        exported = json.loads((hf_dir / "config.json").read_text())
        fla_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=getattr(torch, dtype), **fla_config).eval()
    return fla_model, exported


def perturb_vectors(model, scale: float = 0.1) -> None:
    """Norm weights and gate biases moved away from their init (ones, zeros), so that a wrong mapping of them shows."""
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * scale)


def logged_data_fingerprints(out_dir) -> dict:
    """step -> the data fingerprint a run logged in its metrics.jsonl (the sum of per-sample checksums of
    the step's batches over micro-batches and processes)."""
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["data_fingerprint"] for r in records if "data_fingerprint" in r}


def litdata_blocks(path, block_size: int) -> list:
    """Every block of a prepared directory as litdata's own loader reads it, in order, as int64 bytes
    (the reference the training stream is checked against)."""
    import numpy as np
    from litdata.streaming import StreamingDataset, TokensLoader

    dataset = StreamingDataset(str(path), item_loader=TokensLoader(block_size=block_size), shuffle=False)
    return [bytes(np.asarray(block).astype(np.int64)) for block in dataset]


# The training run the evaluate tests read (test_evaluate.py, test_evaluate_harness.py, test_evaluate_errors.py):
# each of those modules builds its own with train_evaluate_run in a module-scoped fixture.
TRAIN_LEN = 32
VAL_ITERS = 3
WORDS = "the model reads a line of text and predicts the next word of it".split()


def text_lines(n: int, seed: int) -> list:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=rng.integers(4, 12))) for _ in range(n)]


def train_evaluate_run(root):
    """A 2-step gla-debug run in root with a final validation of VAL_ITERS batches on a small corpus of its own
    (a 300-piece tokenizer; 4 chunk files of 1000 tokens each for training and for validation)."""
    import numpy as np

    from fabric_lin.args import EvalArgs, TrainArgs
    from fabric_lin.data import TokenChunks, Tokenizer
    from fabric_lin.data.train_tokenizer import main as train_tokenizer
    from fabric_lin.pretrain import setup
    from helpers import write_prepared

    (root / "raw").mkdir()
    (root / "raw" / "a.txt").write_text("\n".join(text_lines(400, 0)))
    train_tokenizer(root / "raw", root / "tok", vocab_size=300, num_threads=1)
    tokenizer = Tokenizer(root / "tok")
    for name, seed in (("train", 1), ("val", 2)):
        ids = tokenizer.encode_batch(text_lines(900, seed), eos=True, num_threads=1)
        write_prepared(root / name, np.concatenate(ids)[:4000].astype(np.uint16), tokenizer)
    setup(
        model_name="gla-debug", out_dir=root / "out", logger_name="csv", devices=1, tokenizer_dir=root / "tok",
        data=TokenChunks(data_path=root / "train", val_path=root / "val", num_workers=0),
        train=TrainArgs(global_batch_size=2, micro_batch_size=2, max_steps=2, max_seq_length=TRAIN_LEN, save_interval=None,
                        lr_warmup_steps=0),
        eval=EvalArgs(max_iters=VAL_ITERS, interval=1000, final_validation=True),
    )
    return root


def final_weights(run):
    """The model of train_evaluate_run's final checkpoint (a GPT in eval mode), read without evaluate's loader."""
    from fabric_lin.config import Config
    from fabric_lin.model import GPT

    checkpoint = torch.load(run / "out" / "final" / "lit_model.pth", weights_only=False)
    model = GPT(Config.from_checkpoint(run / "out" / "final"))
    model.load_state_dict(checkpoint["model"])
    return model.eval()


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """The uninterrupted debug run (helpers.DEBUG_ARGS), what the stopped and resumed ones must reproduce; with a
    final validation (which changes no weight) to compare with other layouts'."""
    from helpers import debug_run

    out = tmp_path_factory.mktemp("reference") / "out"
    debug_run(out, "--eval.final_validation", "true")
    return out


@pytest.fixture(scope="session")
def reference_workers(tmp_path_factory):
    """The reference with DataLoader worker processes, which a signal to the whole job reaches too."""
    from helpers import LOADER_WORKERS, debug_run

    out = tmp_path_factory.mktemp("reference_workers") / "out"
    debug_run(out, *LOADER_WORKERS)
    return out


@pytest.fixture
def harness_with_hellaswag(monkeypatch):
    """A stand-in for lm-evaluation-harness whose TaskManager knows the task hellaswag: `evaluate --tasks hellaswag`
    gets past its task names to the model, without the optional extra."""
    import sys
    import types

    harness = types.ModuleType("lm_eval")
    harness.tasks = types.ModuleType("lm_eval.tasks")
    harness.tasks.TaskManager = lambda include_path=None, include_defaults=True: types.SimpleNamespace(
        all_tasks=["hellaswag"], load=lambda names: {"tasks": {}, "groups": {}})
    monkeypatch.setitem(sys.modules, "lm_eval", harness)
    monkeypatch.setitem(sys.modules, "lm_eval.tasks", harness.tasks)


@pytest.fixture(scope="session")
def paragraphs_tokenizer(tmp_path_factory):
    """A 500-piece tokenizer trained on 300 paragraphs of the standard library (helpers.paragraphs): the
    preprocessors' tests tokenize with it."""
    from fabric_lin.data.train_tokenizer import main as train_tokenizer
    from helpers import paragraphs

    root = tmp_path_factory.mktemp("paragraphs_tokenizer")
    (root / "raw").mkdir()
    (root / "raw" / "all.txt").write_text("\n".join(paragraphs(300, 99)), encoding="utf-8")
    train_tokenizer(root / "raw", root / "tokenizer", vocab_size=500, num_threads=1)
    return root / "tokenizer"


@pytest.fixture
def prepared_json_reads(monkeypatch):
    """The prepared directories whose prepared.json this test opens, once per opening (open() and pathlib alike)."""
    import builtins
    import io
    from collections import Counter
    from pathlib import Path

    opened = Counter()
    real_open = io.open

    def counted_open(file, *args, **kwargs):
        if isinstance(file, (str, Path)) and Path(file).name == "prepared.json":
            opened[Path(file).parent] += 1
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counted_open)
    monkeypatch.setattr(io, "open", counted_open)
    return opened
