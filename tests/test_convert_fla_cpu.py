"""CPU check of convert_to_hf against flash-linear-attention (fla) itself: an exported GLA or Gated DeltaNet
model, loaded by fla's `AutoModelForCausalLM.from_pretrained`, gives fabric-lin's logits in fp32.

fla's layers are Triton kernels, so without CUDA they run in Triton's interpreter
(TRITON_INTERPRET=1, fp32, on small models), with conftest.fla_in_interpreter's two adjustments. The
comparison runs in a subprocess, so that the interpreter setting stays out of the pytest process.

fla's kernels themselves run unchanged. fla picks its fused_recurrent mode for T <= 64 and the chunked
mode (chunk 64) above, so each case is run at both. Skips when fla or transformers is not installed
(pip install flash-linear-attention transformers) and when CUDA is present (test_convert_fla_gpu.py
covers that). As a script it prints one JSON line per case and length:

    TRITON_INTERPRET=1 python tests/test_convert_fla_cpu.py
"""
import os
import sys

if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported: jit decides at decoration time

import importlib.util  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from fabric_lin.config import Config  # noqa: E402

SEQ_LENS = (100, 40)  # chunked mode over two chunks (the second partial), and fused_recurrent
TOL = 1e-4


def base(**overrides) -> Config:
    return Config.from_name("gla-debug", num_layers=2, vocab_size=512, **overrides)


CASES = {  # name: (config, sequence lengths)
    # fla's head norm uses norm_eps, as fabric-lin's does by default: the two models are the same function
    "gla": (lambda: base(), SEQ_LENS),
    "gqa": (lambda: base(num_heads=4, num_kv_heads=2), SEQ_LENS),
    "tied": (lambda: base(tie_embeddings=True), SEQ_LENS),
    "gdn": (lambda: base(block_type="gdn", head_dim=48, expand_v=2.0), SEQ_LENS),
    "gdn-tied": (lambda: base(block_type="gdn", head_dim=32, expand_v=1.5, tie_embeddings=True), SEQ_LENS[1:]),
    # fla's chunked DeltaNet kernel refuses fp32: its recurrent one runs every length (compare_with_fla)
    "deltanet": (lambda: base(block_type="deltanet", expand_k=1.0, expand_v=1.0), SEQ_LENS),
    # a checkpoint trained with another head-norm eps (1e-5, an earlier default) against fla's norm_eps 1e-6:
    # where a head's output is near zero (the first tokens), the eps moves its normed value a lot, so logits
    # differ by up to about their std at this init scale. fla's logits equal those of this model run with
    # head_norm_eps = norm_eps. One length keeps the test fast.
    "own-head-eps": (lambda: base(head_norm_eps=1e-5), SEQ_LENS[1:]),
}


def fla_installed() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("fla", "transformers"))


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
            "fla_mode": "fused_recurrent" if seq_len <= 64 or config.block_type == "deltanet" else exported["attn_mode"],
            "block_type": config.block_type, "num_heads": config.num_heads, "num_kv_heads": config.num_kv_heads,
            "tie_embeddings": config.tie_embeddings,
            "norm_eps": config.norm_eps, "head_norm_eps": config.head_norm_eps, "batch": batch, "seq_len": seq_len,
            "max_abs_diff": diff.max().item(), "mean_abs_diff": diff.mean().item(),
            "logits_std": ours.std().item(), **fla_eps, "seconds": round(time.perf_counter() - start, 2),
        })
    return results


def generate_with_fla(config: Config, prompt_len: int = 20, new_tokens: int = 6, seed: int = 0) -> dict:
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


def run_interpreted(timeout: float = 600) -> list:
    """This file as a script in a subprocess; its JSON lines."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, test_convert_fla_gpu.py runs fla's compiled kernels")
@pytest.mark.skipif(not fla_installed(), reason="needs flash-linear-attention (fla) and transformers")
def test_exported_models_match_fla_interpreted():
    results = run_interpreted()
    generated = [r for r in results if r.get("case") == "gdn-generate"]
    results = [r for r in results if r.get("case") != "gdn-generate"]
    assert len(generated) == 1 and len(generated[0]["fla_generate"]) == 6  # fla's generate runs on the export
    assert generated[0]["ours"] == generated[0]["fla_argmax_on_ours"]  # our decoding is fla's model's greedy path
    for r in results:
        print(json.dumps(r))
    assert {(r["case"], r["seq_len"]) for r in results} == {(c, t) for c, (_, lens) in CASES.items() for t in lens}
    for r in results:
        if r["head_norm_eps"] == r["norm_eps"]:
            assert r["max_abs_diff"] < TOL, r
        else:  # the whole difference is the head norm's eps
            assert r["max_abs_diff_ours_at_fla_head_eps"] < TOL, r


if __name__ == "__main__":
    if not fla_installed():
        raise SystemExit("needs flash-linear-attention: pip install flash-linear-attention transformers")
    from conftest import fla_in_interpreter

    with fla_in_interpreter():
        for case, (make, seq_lens) in CASES.items():
            for result in compare_with_fla(make(), seq_lens):
                print(json.dumps({"case": case, **result}), flush=True)
        print(json.dumps({"case": "gdn-generate", **generate_with_fla(CASES["gdn"][0]())}), flush=True)
