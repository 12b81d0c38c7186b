"""CPU check of convert_to_hf against flash-linear-attention (fla) itself, for every family (GLA, Gated DeltaNet,
the transformer baseline, and the hybrids with softmax-attention layers): fla builds each exported config with the
model's parameter names, shapes and count (at the shipped sizes too), and an exported model, loaded by fla's
`AutoModelForCausalLM.from_pretrained`, gives fabric-lin's logits in fp32; tutorials/convert.md's lines that load an
export in fla run as written.

fla's layers are Triton kernels, so without CUDA they run in Triton's interpreter (TRITON_INTERPRET=1, fp32, on
small models), with conftest.fla_in_interpreter's two adjustments. fla's softmax-attention layer refuses to be built
without flash-attn, which has no CPU build: for it, flash-attn's `flash_attn_func` is stood in by PyTorch's causal
scaled_dot_product_attention (what it computes; fla's own code does the rest: projections, rotary embedding, heads).
The checks run in one subprocess, so that the interpreter setting and the stand-in stay out of the pytest process.

fla's kernels themselves run unchanged. fla picks its fused_recurrent mode for T <= 64 and the chunked mode (chunk
64) above, so each linear-attention case is run at both. Skips when fla or transformers is not installed and when
CUDA is present (test_convert_fla_gpu.py covers that). As a script it prints one JSON line per case and length:

    TRITON_INTERPRET=1 python tests/test_convert_fla_cpu.py [CASE ... | gdn-generate | parameters | convert-md]
"""
import os
import sys

if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported: jit decides at decoration time

import importlib.util  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from fabric_lin.config import Config  # noqa: E402

SEQ_LENS = (100, 40)  # chunked mode over two chunks (the second partial), and fused_recurrent
# fla's GDN fused_recurrent kernel costs about 0.4 s per token in the interpreter (its GLA one a tenth of that)
GDN_SEQ_LENS = (100, 16)
TOL = 1e-4


def base(**overrides) -> Config:
    return Config.from_name("gla-debug", num_layers=2, vocab_size=512, **overrides)


CASES = {  # name: (config, sequence lengths)
    # fla's head norm uses norm_eps, as fabric-lin's does by default: the two models are the same function
    "gla": (lambda: base(), SEQ_LENS),
    "gqa": (lambda: base(num_heads=4, num_kv_heads=2), SEQ_LENS),
    "tied": (lambda: base(tie_embeddings=True), SEQ_LENS),
    "gdn": (lambda: base(block_type="gdn", head_dim=48, expand_v=2.0), GDN_SEQ_LENS),
    "gdn-tied": (lambda: base(block_type="gdn", head_dim=32, expand_v=1.5, tie_embeddings=True), GDN_SEQ_LENS[1:]),
    # fla's chunked DeltaNet kernel refuses fp32: its recurrent one runs every length (compare_with_fla)
    "deltanet": (lambda: base(block_type="deltanet", expand_k=1.0, expand_v=1.0), GDN_SEQ_LENS[:1]),
    # a checkpoint trained with another head-norm eps (1e-5, an earlier default) against fla's norm_eps 1e-6:
    # where a head's output is near zero (the first tokens), the eps moves its normed value a lot, so logits
    # differ by up to about their std at this init scale. fla's logits equal those of this model run with
    # head_norm_eps = norm_eps. One length keeps the test fast.
    "own-head-eps": (lambda: base(head_norm_eps=1e-5), SEQ_LENS[1:]),
    # softmax attention: fla's layer around flash_attn_func's stand-in
    "transformer": (lambda: base(block_type="transformer", num_heads=4, rope_base=500.0), SEQ_LENS[1:]),
    "transformer-gqa": (lambda: base(block_type="transformer", num_heads=4, num_kv_heads=2, rope_base=500.0), SEQ_LENS[1:]),
    "gla-hybrid": (lambda: base(attn_layers=[1], attn_num_heads=4, attn_num_kv_heads=2, rope_base=500.0), SEQ_LENS[:1]),
    "gdn-hybrid": (lambda: base(block_type="gdn", head_dim=32, expand_v=1.5, attn_layers=[0], attn_num_heads=2), GDN_SEQ_LENS[:1]),
}
FAMILIES = {  # the cases each test checks (all of them computed in one subprocess: fla_results)
    "gla": ["gla", "gqa", "tied", "own-head-eps", "gla-hybrid"],
    "gdn": ["gdn", "gdn-tied", "gdn-hybrid", "gdn-generate"],
    "transformer": ["transformer", "transformer-gqa"],
    "deltanet": ["deltanet"],
}
# fla builds these from their exported config.json: every family at its shipped size, and the small hybrids
PARAMETER_MODELS = {
    "gla-340M": lambda: Config.from_name("gla-340M"),
    "gla-340M-tied": lambda: Config.from_name("gla-340M", tie_embeddings=True),
    "gla-7B": lambda: Config.from_name("gla-7B"),
    "gdn-340M": lambda: Config.from_name("gdn-340M"),
    "gdn-1.3B": lambda: Config.from_name("gdn-1.3B"),
    "gdn-340M-conv-2": lambda: Config.from_name("gdn-340M", conv_size=2),
    "transformer-340M": lambda: Config.from_name("transformer-340M"),
    "deltanet-340M": lambda: Config.from_name("deltanet-340M"),
    "deltanet-1.3B": lambda: Config.from_name("deltanet-1.3B"),
    "gla-hybrid": CASES["gla-hybrid"][0],
    "gdn-hybrid": CASES["gdn-hybrid"][0],
}


def fla_installed() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("fla", "transformers"))


def import_fla_with_flash_attn_stand_in() -> None:
    """Import fla with flash-attn's `flash_attn_func` stood in by PyTorch's causal attention (flash-attn has no CPU
    build, and fla's softmax-attention layer refuses to be built without it). The stand-in is in sys.modules only
    while fla imports: transformers, which looks for flash-attn too, sees none (it looks before, here)."""
    import types

    import torch.nn.functional as F
    import transformers.activations  # noqa: F401  (transformers' own look for flash-attn happens here)
    import transformers.modeling_utils  # noqa: F401

    def flash_attn_func(q, k, v, causal=False, window_size=(-1, -1), **kwargs):
        """q [B, T, H, D], k and v [B, T, H_kv, D]; query head h reads key/value head h // (H / H_kv)."""
        if not causal or tuple(window_size) != (-1, -1) or kwargs:
            raise NotImplementedError(f"the stand-in computes causal attention over the whole context only: {kwargs}")
        groups = q.shape[2] // k.shape[2]
        k, v = (x.repeat_interleave(groups, dim=2) for x in (k, v))
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return o.transpose(1, 2)

    def flash_attn_varlen_func(*args, **kwargs):
        raise NotImplementedError("the stand-in has no varlen attention (fla calls it for padded or packed input)")

    stand_in = types.ModuleType("flash_attn")
    stand_in.flash_attn_func, stand_in.flash_attn_varlen_func = flash_attn_func, flash_attn_varlen_func
    sys.modules["flash_attn"] = stand_in
    try:
        import fla  # noqa: F401  (registers fla's model types with transformers; fla.layers.attn keeps the stand-in)
    finally:
        del sys.modules["flash_attn"]


def fla_parameters(name: str, config: Config) -> dict:
    """fla's model built (on the meta device) from the config.json convert_to_hf writes for `config`, against
    fabric-lin's: parameter names (as exported) with their shapes, and counts."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from fabric_lin.convert.hf import fla_config, to_hf_name
    from fabric_lin.model import GPT

    exported = fla_config(config)
    fields = {k: v for k, v in exported.items() if k not in ("architectures", "model_type", "fabric_lin")}
    with torch.device("meta"):
        ours = GPT(config)
        theirs = AutoModelForCausalLM.from_config(AutoConfig.for_model(exported["model_type"], **fields))
    ours_shapes = {to_hf_name(n): list(p.shape) for n, p in ours.named_parameters()}
    theirs_shapes = {n: list(p.shape) for n, p in theirs.named_parameters()}
    return {
        "model": name, "block_type": config.block_type, "fla_class": type(theirs).__name__,
        "architecture": exported["architectures"][0], "parameters": len(ours_shapes),
        "missing_in_fla": sorted(set(ours_shapes) - set(theirs_shapes)),
        "only_in_fla": sorted(set(theirs_shapes) - set(ours_shapes)),
        "other_shapes": sorted(n for n in set(ours_shapes) & set(theirs_shapes) if ours_shapes[n] != theirs_shapes[n]),
        "count": sum(p.numel() for p in ours.parameters()), "fla_count": sum(p.numel() for p in theirs.parameters()),
    }


def compare_with_fla(config: Config, seq_lens=SEQ_LENS, batch: int = 1, seed: int = 0) -> list:
    from conftest import export_to_fla, perturb_vectors
    from fabric_lin.model import GPT

    torch.manual_seed(seed)
    model = GPT(config).eval()
    perturb_vectors(model)
    # fla's chunked DeltaNet kernel refuses fp32; its recurrent kernel is the same function at every length
    fla_model, exported = export_to_fla(model, config, **({"attn_mode": "fused_recurrent"} if config.block_type == "deltanet" else {}))
    results = []
    for seq_len in seq_lens:
        ids = torch.randint(0, config.vocab_size, (batch, seq_len))
        start = time.perf_counter()
        with torch.no_grad():
            fla_logits = fla_model(input_ids=ids, use_cache=False).logits.float()
            ours = model(ids).float()
            fla_eps = {}
            if config.head_norm_eps != config.norm_eps:  # ours with fla's head-norm eps
                for block in model.layers:
                    block.attn.g_norm.eps = config.norm_eps
                fla_eps["max_abs_diff_ours_at_fla_head_eps"] = (fla_logits - model(ids).float()).abs().max().item()
                for block in model.layers:
                    block.attn.g_norm.eps = config.head_norm_eps
        diff = (fla_logits - ours).abs()
        results.append({
            "fla_class": type(fla_model).__name__,
            "fla_mode": "softmax" if config.block_type == "transformer" else
                        "fused_recurrent" if seq_len <= 64 or config.block_type == "deltanet" else exported["attn_mode"],
            "block_type": config.block_type, "num_heads": config.num_heads, "num_kv_heads": config.num_kv_heads,
            "attn_layers": config.attn_layers, "tie_embeddings": config.tie_embeddings,
            "norm_eps": config.norm_eps, "head_norm_eps": config.head_norm_eps, "batch": batch, "seq_len": seq_len,
            "max_abs_diff": diff.max().item(), "mean_abs_diff": diff.mean().item(),
            "logits_std": ours.std().item(), **fla_eps, "seconds": round(time.perf_counter() - start, 2),
        })
    return results


def generate_with_fla(config: Config, prompt_len: int = 8, new_tokens: int = 4, seed: int = 0) -> dict:
    """fla's `generate` on an exported model, and fabric-lin's greedy tokens checked against fla's full forward
    (each token the argmax of fla's logits at its position). In the interpreter fla's own cached decoding
    does not reproduce its full forward, so its tokens are reported, not compared."""
    from conftest import export_to_fla
    from fabric_lin.generate import generate_tokens
    from fabric_lin.model import GPT

    torch.manual_seed(seed)
    model = GPT(config).eval()
    fla_model = export_to_fla(model, config)[0]
    prompt = torch.randint(0, config.vocab_size, (1, prompt_len))
    fla_tokens = fla_model.generate(prompt, max_new_tokens=new_tokens, do_sample=False)[0, prompt_len:].tolist()
    ours = generate_tokens(model, prompt[0], max_new_tokens=new_tokens, temperature=0.0)
    with torch.no_grad():
        fla_logits = fla_model(input_ids=torch.cat([prompt[0], ours])[None], use_cache=False).logits[0]
    return {"fla_generate": fla_tokens, "ours": ours.tolist(),
            "fla_argmax_on_ours": fla_logits[prompt_len - 1 : -1].argmax(-1).tolist()}


def load_as_convert_md_says() -> dict:
    """tutorials/convert.md's Python lines that load an export in fla, run as written on a small GLA's export (in
    bf16, as convert.md exports) in place of hf/gla-340M: what they loaded, and what transformers warned of."""
    import logging
    import re
    import tempfile
    from pathlib import Path

    from safetensors.torch import load_file

    from conftest import export_model
    from fabric_lin.model import GPT

    text = (Path(__file__).resolve().parents[1] / "tutorials" / "convert.md").read_text(encoding="utf-8")
    (snippet,) = [block for block in re.findall(r"```python\n(.*?)```", text, re.S) if "from_pretrained" in block]
    config = base()
    warnings = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("transformers").addHandler(handler)  # the logger of every transformers module
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = export_model(GPT(config), config, tmp, dtype="bfloat16")
        namespace = {}
        exec(snippet.replace('"hf/gla-340M"', repr(str(hf_dir))), namespace)
        model, exported = namespace["model"], load_file(hf_dir / "model.safetensors")
    logging.getLogger("transformers").removeHandler(handler)
    state = model.state_dict()
    return {"fla_class": type(model).__name__, "dtype": str(model.dtype), "device": str(model.device),
            "weights_as_exported": sorted(state) == sorted(exported) and all(torch.equal(state[k], v) for k, v in exported.items()),
            "warnings": warnings}


def run_interpreted(*cases: str, timeout: float = 1200) -> list:
    """This file as a script in a process of its own (forked from an interpreter that has imported torch and Triton,
    with TRITON_INTERPRET=1 as here: fabric_lin_process); its JSON lines."""
    import fabric_lin_process

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = fabric_lin_process.run([sys.executable, __file__, *cases], timeout, env, scripts=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, test_convert_fla_gpu.py runs fla's compiled kernels"),
    pytest.mark.skipif(not fla_installed(), reason="needs flash-linear-attention (fla) and transformers"),
    pytest.mark.slow,
]


@pytest.fixture(scope="module")
def fla_results() -> list:
    """Every check of this file, run in one subprocess (fla's and transformers' import, ~6 s, paid once)."""
    # convert-md first: transformers warns of a thing once per process
    return run_interpreted("convert-md", *(case for cases in FAMILIES.values() for case in cases), "parameters")


@pytest.mark.parametrize("family", FAMILIES)
def test_exported_models_match_fla_interpreted(fla_results, family):
    cases = FAMILIES[family]
    results = [r for r in fla_results if r["case"] in cases]
    generated = [r for r in results if r.get("case") == "gdn-generate"]
    results = [r for r in results if r.get("case") != "gdn-generate"]
    if "gdn-generate" in cases:
        assert len(generated) == 1 and len(generated[0]["fla_generate"]) == 4  # fla's generate runs on the export
        assert generated[0]["ours"] == generated[0]["fla_argmax_on_ours"]  # our decoding is fla's model's greedy path
    for r in results:
        print(json.dumps(r))
    assert {(r["case"], r["seq_len"]) for r in results} == {(c, t) for c in cases if c in CASES for t in CASES[c][1]}
    for r in results:
        if r["head_norm_eps"] == r["norm_eps"] or r["block_type"] == "transformer":
            assert r["max_abs_diff"] < TOL, r
        else:  # the whole difference is the head norm's eps
            assert r["max_abs_diff_ours_at_fla_head_eps"] < TOL, r


def test_fla_builds_the_exports_with_their_parameter_names_and_count(fla_results):
    results = {r["model"]: r for r in fla_results if r["case"] == "parameters"}
    assert sorted(results) == sorted(PARAMETER_MODELS)
    assert {r["block_type"] for r in results.values()} == {"gla", "gdn", "transformer", "deltanet"}  # every family
    for r in results.values():
        print(json.dumps(r))
        assert r["fla_class"] == r["architecture"], r  # the architecture config.json names
        assert (r["missing_in_fla"], r["only_in_fla"], r["other_shapes"]) == ([], [], []), r
        assert r["count"] == r["fla_count"] and r["parameters"] > 0, r


def test_convert_md_loads_an_export_in_fla_as_written(fla_results):
    """tutorials/convert.md's lines that load an export in fla run on the CPU as written: fla's model, in bf16,
    holds the exported weights, and transformers warns of nothing (a deprecated argument, e.g.)."""
    (result,) = [r for r in fla_results if r["case"] == "convert-md"]
    assert result == {"case": "convert-md", "fla_class": "GLAForCausalLM", "dtype": "torch.bfloat16", "device": "cpu",
                      "weights_as_exported": True, "warnings": []}


if __name__ == "__main__":
    if not fla_installed():
        raise SystemExit("needs flash-linear-attention: pip install flash-linear-attention transformers")
    from conftest import fla_in_interpreter

    import_fla_with_flash_attn_stand_in()
    with fla_in_interpreter():
        for case in sys.argv[1:] or [*CASES, "gdn-generate", "parameters"]:
            if case == "convert-md":
                print(json.dumps({"case": case, **load_as_convert_md_says()}), flush=True)
            elif case == "parameters":
                for name, make in PARAMETER_MODELS.items():
                    print(json.dumps({"case": case, **fla_parameters(name, make())}), flush=True)
            elif case == "gdn-generate":
                print(json.dumps({"case": case, **generate_with_fla(CASES["gdn"][0]())}), flush=True)
            else:
                make, seq_lens = CASES[case]
                for result in compare_with_fla(make(), seq_lens):
                    print(json.dumps({"case": case, **result}), flush=True)
