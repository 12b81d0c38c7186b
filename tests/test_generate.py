"""Decoding against independent references: incremental decoding (GLA state, GDN state and convolution cache,
transformer KV cache) against a full forward pass, `generate_tokens` against argmax / sampling of full-forward
logits, the decoding step against a float64 loop, the text printed once a character's bytes are all there, and the
errors for bad arguments (before the model is loaded) and for a tokenizer that is not the model's."""
import math

import pytest
import torch
import torch.nn.functional as F

from fabric_lin.config import Config
from fabric_lin.generate import generate_tokens, sample
from fabric_lin.model import GPT
from fabric_lin.ops.gla import recurrent_gla_step
from helpers import cli_error, make_model_dir, small_config

NAMES = ["gla-debug", "gdn-debug", "deltanet-debug", "transformer-debug"]
# around the chunk size of 64: one token, one short of a chunk, a full chunk, one over, two chunks and a bit
PROMPT_LENGTHS = [1, 63, 64, 65, 130]


def debug_model(name: str, seed: int = 0, fused: bool = False) -> GPT:
    torch.manual_seed(seed)
    return GPT(Config.from_name(name), fused=fused).eval()


def prefill_then_steps(model: GPT, ids: torch.Tensor, prompt: int):
    """(logits of the first `prompt` tokens in one pass, then one token at a time through the cache; logits
    of one full forward pass over ids)."""
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache()
        steps = [model(ids[:, :prompt], cache=cache)]
        steps += [model(ids[:, t : t + 1], cache=cache) for t in range(prompt, ids.shape[1])]
    return torch.cat(steps, dim=1), full


@pytest.fixture(scope="module", params=NAMES)
def model(request):
    return debug_model(request.param)


@pytest.mark.parametrize("prompt", PROMPT_LENGTHS)
def test_prefill_then_steps_match_full_forward(model, prompt):
    ids = torch.randint(0, model.config.vocab_size, (2, prompt + 4), generator=torch.Generator().manual_seed(prompt))
    decoded, full = prefill_then_steps(model, ids, prompt)
    torch.testing.assert_close(decoded, full, rtol=1e-4, atol=1e-4)


def test_every_token_decoded_one_at_a_time_matches_full_forward(model):
    # no chunked prefill at all: the decoding step alone carries the state across two chunk boundaries
    ids = torch.randint(0, model.config.vocab_size, (1, 130), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache()
        steps = [model(ids[:, t : t + 1], cache=cache) for t in range(ids.shape[1])]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-4)


def test_prompts_appended_to_a_gla_state_match_full_forward():
    model = debug_model("gla-debug")
    ids = torch.randint(0, model.config.vocab_size, (2, 140), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache()
        parts = [model(ids[:, a:b], cache=cache) for a, b in [(0, 65), (65, 66), (66, 140)]]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("prompt", [1, 65, 130])
def test_greedy_generation_is_argmax_of_full_forward(model, prompt):
    ids = torch.randint(0, model.config.vocab_size, (prompt,), generator=torch.Generator().manual_seed(3))
    new = generate_tokens(model, ids, max_new_tokens=5, temperature=0.0)
    assert new.shape == (5,)
    with torch.no_grad():
        logits = model(torch.cat([ids, new])[None])[0]
    # the token at step i is the argmax of the full forward's logits at the position before it
    assert new.tolist() == logits[prompt - 1 : -1].argmax(-1).tolist()


def test_sampling_equals_sampling_full_forward_logits_with_the_same_generator(model):
    temperature, top_k, n = 0.7, 20, 6
    ids = torch.randint(0, model.config.vocab_size, (65,), generator=torch.Generator().manual_seed(4))
    new = generate_tokens(model, ids, n, temperature, top_k, generator=torch.Generator().manual_seed(5))

    g = torch.Generator().manual_seed(5)
    seq = ids
    with torch.no_grad():
        for _ in range(n):
            logits = model(seq[None])[0, -1].double() / temperature
            kth = logits.sort(descending=True).values[top_k - 1]
            probs = F.softmax(logits.masked_fill(logits < kth, -math.inf), dim=-1)
            seq = torch.cat([seq, torch.multinomial(probs.float(), 1, generator=g)])
    assert new.tolist() == seq[len(ids) :].tolist()


def test_sample_follows_softmax_of_logits_over_temperature_within_top_k():
    logits = torch.tensor([0.0, 1.0, 2.0, 3.0])
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([sample(logits, 0.5, 2, g) for _ in range(3000)])
    frequencies = torch.bincount(draws, minlength=4) / 3000
    # softmax([4, 6]) over the two kept tokens: 0.1192, 0.8808
    torch.testing.assert_close(frequencies, torch.tensor([0.0, 0.0, 0.1192, 0.8808]), rtol=0, atol=0.02)
    assert sample(logits, 0.0, None).item() == 3


def test_a_top_k_above_the_vocabulary_keeps_every_token():
    # the generate command's default of 50 with a smaller vocabulary: no filter, the same draws as without one
    logits = torch.tensor([0.0, 1.0, 2.0])
    for seed in range(20):
        assert sample(logits, 1.0, 50, torch.Generator().manual_seed(seed)) == sample(
            logits, 1.0, None, torch.Generator().manual_seed(seed))


def test_growing_text_prints_a_character_once_all_its_bytes_came():
    from fabric_lin.generate import GrowingText

    class ByteTokenizer:  # a token per byte of UTF-8: a character of two or three bytes takes as many tokens
        def decode(self, ids):
            return bytes(ids).decode("utf-8", errors="replace")

    text = GrowingText(ByteTokenizer(), list(b"caf"))
    assert [text.add(torch.tensor(byte)) for byte in "é €!".encode()] == ["", "é", " ", "", "", "€", "!"]
    assert text.text == "café €!"


def test_a_temperature_near_zero_samples_the_most_likely_token():
    """Logits over a temperature of 1e-40 overflow fp32 (30 / 1e-40 is inf, and the softmax of two infinities NaN):
    torch.multinomial's RuntimeError, where the most likely token is what such a temperature means."""
    logits = torch.tensor([1.0, 30.0, -5.0, 29.9])
    for temperature in (1e-30, 1e-40, 1e-45):
        for top_k in (None, 2):
            assert sample(logits, temperature, top_k, torch.Generator().manual_seed(0)).item() == 1


def test_generation_stops_after_eos_and_keeps_it():
    model = debug_model("gla-debug")
    ids = torch.tensor([5, 6, 7])
    greedy = generate_tokens(model, ids, 4, temperature=0.0)
    eos = greedy[1].item()
    assert eos != greedy[0].item()
    assert generate_tokens(model, ids, 4, temperature=0.0, eos_id=eos).tolist() == greedy[:2].tolist()


def count_forward_calls(model: GPT) -> list:
    calls = []
    model.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[1]))
    return calls


@pytest.mark.parametrize("max_new_tokens", [0, 1, 3])
def test_generation_runs_no_forward_pass_whose_logits_are_unused(max_new_tokens):
    # one pass for the prompt, one per new token after the first; a last step's logits would be thrown away
    model = debug_model("gla-debug")
    calls = count_forward_calls(model)
    new = generate_tokens(model, torch.tensor([5, 6, 7]), max_new_tokens, temperature=0.0)
    assert len(new) == max_new_tokens
    assert calls == ([3] + [1] * (max_new_tokens - 1) if max_new_tokens else [])


@pytest.mark.parametrize(
    "prompt, kwargs, match",
    [
        (torch.tensor([], dtype=torch.long), {}, "prompt"),
        (torch.tensor([[1, 2, 3]]), {}, "prompt"),
        (torch.tensor([1, 2, 3]), {"max_new_tokens": -1}, "^max_new_tokens -1: expected 0 or a positive number of tokens$"),
        (torch.tensor([1, 2, 3]), {"temperature": -0.5}, r"^temperature -0\.5: expected a finite number >= 0 \(0: greedy\)$"),
        (torch.tensor([1, 2, 3]), {"temperature": float("nan")}, r"^temperature nan: expected a finite number >= 0 "),
        (torch.tensor([1, 2, 3]), {"temperature": float("inf")}, r"^temperature inf: expected a finite number >= 0 "),
    ],
    ids=["empty-prompt", "batched-prompt", "negative-max-new-tokens", "negative-temperature", "nan-temperature",
         "inf-temperature"],
)
def test_bad_arguments_are_refused_by_name(prompt, kwargs, match):
    model = debug_model("gla-debug")
    kwargs = {"max_new_tokens": 3, **kwargs}
    with pytest.raises(ValueError, match=match):
        generate_tokens(model, prompt, **kwargs)


def test_generate_cli_refuses_negative_max_new_tokens(tmp_path):
    from fabric_lin.generate import main as generate

    make_model_dir(tmp_path / "model", small_config())
    with pytest.raises(ValueError, match="^--max_new_tokens -2: expected 0 or a positive number of tokens$"):
        generate(tmp_path / "model", prompt="the model", max_new_tokens=-2, device="cpu")


def float64_steps(q, k, v, gk, state):
    """The recurrence token by token in float64: q, k, gk [B, T, H, K], v [B, T, H, V]."""
    q, k, v, gk, state = (x.double() for x in (q, k, v, gk, state))
    outs = []
    for t in range(q.shape[1]):
        state = gk[:, t].exp()[..., None] * state + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * q.shape[-1] ** -0.5, state))
    return torch.stack(outs, dim=1), state


def step_inputs(B, T, H, K, V, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, T, H, K, generator=g), torch.randn(B, T, H, K, generator=g)
    v = torch.randn(B, T, H, V, generator=g)
    # gate logits from strongly closed (-20) to open: decays from ~exp(-1.25) to ~1 per step
    gk = F.logsigmoid(torch.randn(B, T, H, K, generator=g) * 8) / 16
    return q, k, v, gk, torch.randn(B, H, K, V, generator=g)


def run_steps(step, q, k, v, gk, state):
    outs = []
    for t in range(q.shape[1]):
        o, state = step(q[:, t], k[:, t], v[:, t], gk[:, t], state)
        outs.append(o)
    return torch.stack(outs, dim=1), state


def test_recurrent_step_matches_float64_loop():
    q, k, v, gk, h0 = step_inputs(2, 40, 3, 24, 20)
    o, s = run_steps(recurrent_gla_step, q, k, v, gk, h0)
    o_ref, s_ref = float64_steps(q, k, v, gk, h0)
    assert s.dtype == torch.float32
    torch.testing.assert_close(o, o_ref.float(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s, s_ref.float(), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the kernel in Triton's interpreter, on CPU-only machines")
@pytest.mark.parametrize("K,V", [(32, 64), (256, 80)])  # 256: gla-1.3B's head width, the narrower value tiles
def test_fused_step_matches_float64_loop(K, V):
    from fabric_lin.ops.gla import fused_recurrent_gla_step

    q, k, v, gk, h0 = step_inputs(1, 6, 2, K, V)
    o, s = run_steps(lambda *a: fused_recurrent_gla_step(*a, backend="triton"), q, k, v, gk, h0)
    o_ref, s_ref = float64_steps(q, k, v, gk, h0)
    torch.testing.assert_close(o, o_ref.float(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s, s_ref.float(), rtol=1e-4, atol=1e-4)
    # from no state: the first step of a sequence
    o, s = fused_recurrent_gla_step(q[:, 0], k[:, 0], v[:, 0], gk[:, 0], None, backend="triton")
    o_ref, s_ref = float64_steps(q[:, :1], k[:, :1], v[:, :1], gk[:, :1], torch.zeros_like(h0))
    torch.testing.assert_close(o, o_ref[:, 0].float(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s, s_ref.float(), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the kernels in Triton's interpreter, on CPU-only machines")
@pytest.mark.parametrize("prompt", [1, 65])
def test_fused_decoding_path_matches_full_forward(prompt):
    # the model's CUDA path (fused norms, Triton prefill from no state, the fused step) in the interpreter
    torch.manual_seed(0)
    model = GPT(Config.from_name("gla-debug", num_layers=1), fused=True).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, prompt + 3), generator=torch.Generator().manual_seed(prompt))
    decoded, full = prefill_then_steps(model, ids, prompt)
    torch.testing.assert_close(decoded, full, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", NAMES)
def test_gpu_decoding_matches_full_forward(name, dtype):
    # the CUDA path: fused norms, the Triton chunked prefill and the fused decoding step
    from conftest import rel_rms

    model = debug_model(name, fused=True).to("cuda", dtype)
    for prompt in PROMPT_LENGTHS:
        g = torch.Generator().manual_seed(prompt)
        ids = torch.randint(0, model.config.vocab_size, (2, prompt + 4), generator=g).cuda()
        decoded, full = (x.float() for x in prefill_then_steps(model, ids, prompt))
        assert rel_rms(decoded, full) < (1e-3 if dtype == torch.float32 else 3e-2), (prompt, rel_rms(decoded, full))
    if dtype == torch.float32:
        ids = torch.arange(65, device="cuda") * 7
        new = generate_tokens(model, ids, max_new_tokens=5, temperature=0.0)
        with torch.no_grad():
            logits = model(torch.cat([ids, new])[None])[0]
        assert new.tolist() == logits[64:-1].argmax(-1).tolist()


def test_generate_prints_the_text_as_it_is_sampled_and_ctrl_c_keeps_it(tmp_path):
    """The prompt, then each token's text as it comes; a Ctrl-C (SIGINT to the foreground job) stops at once,
    keeping what was printed, with the count of tokens and exit code 130. (The command is forked as the suite's
    fabric-lin runs are, fabric_lin_process: its output goes to a file, read here while it runs.)"""
    import os

    import fabric_lin_process
    from helpers import ctrl_c, wait_for

    make_model_dir(tmp_path / "model", small_config())
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    proc = fabric_lin_process.start(
        [*fabric_lin_process.FABRIC_LIN, "generate", str(tmp_path / "model"), "--prompt", "the model",
         "--max_new_tokens", "1000000", "--device", "cpu", "--top_k", "0"],
        out, {**os.environ, "OMP_NUM_THREADS": "1"}, err_log=err)
    # the prompt, then text of sampled tokens, while it runs
    assert wait_for(lambda: len(out.read_bytes()) > len("the model") + 20, proc, timeout=60), err.read_text()
    printed = out.read_bytes()
    assert proc.poll() is None and printed.startswith(b"the model")
    ctrl_c(proc)
    assert proc.wait(60) == 130
    assert out.read_bytes().startswith(printed) and out.read_bytes().endswith(b"\n")  # the text kept, its line ended
    lines = err.read_text().splitlines()
    assert "Traceback" not in err.read_text()
    assert lines[-1] == "fabric-lin generate: interrupted"
    count = int(lines[-2].split(" tokens in ")[0])
    assert 0 < count < 1000000


def test_generate_top_k_zero_is_no_filter_and_negative_is_refused(tmp_path):
    from fabric_lin.generate import main as generate, sample

    logits = torch.tensor([0.0, 1.0, 2.0, 3.0])
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([sample(logits, 1.0, 0, g) for _ in range(3000)])
    frequencies = torch.bincount(draws, minlength=4) / 3000
    # softmax([0, 1, 2, 3]): every token drawn, none filtered
    torch.testing.assert_close(frequencies, torch.tensor([0.0321, 0.0871, 0.2369, 0.6439]), rtol=0, atol=0.02)
    assert {sample(logits, 1.0, 1, g).item() for _ in range(20)} == {3}

    make_model_dir(tmp_path / "model", small_config())
    text = generate(tmp_path / "model", prompt="the model", max_new_tokens=4, temperature=1.0, top_k=0, device="cpu")
    assert text.startswith("the model")
    with pytest.raises(ValueError, match=r"^--top_k -1: expected a positive number of tokens, or 0 or null for no top-k filter$"):
        generate(tmp_path / "model", prompt="the model", max_new_tokens=4, top_k=-1, device="cpu")


def test_generate_samples_only_ids_the_tokenizer_has(tmp_path):
    """A model with more vocabulary rows than its tokenizer has pieces: the extra ids (here made the most
    likely ones) are never sampled, so every token decodes."""
    from fabric_lin.data import Tokenizer
    from fabric_lin.generate import main as generate

    config = Config.from_name("gla-debug", vocab_size=128, num_layers=2)
    state = make_model_dir(tmp_path / "model", config)
    pieces = Tokenizer(tmp_path / "model").vocab_size
    assert pieces < config.vocab_size
    state["lm_head.weight"][pieces:] = 100 * state["lm_head.weight"][:pieces].abs().max()  # dominate the logits
    torch.save(state, tmp_path / "model" / "lit_model.pth")
    for temperature in (0.0, 1.0):
        text = generate(tmp_path / "model", prompt="the model", max_new_tokens=8, temperature=temperature, device="cpu")
        assert text.startswith("the model")


@pytest.mark.parametrize("device,message", [
    ("cuda", "--device cuda: this machine has no CUDA GPU that PyTorch can use; give --device cpu"),
    ("gpu0", "--device 'gpu0': expected cpu, cuda or cuda:<index>"),
    # device types torch parses, which failed inside torch with a traceback once the model was loaded
    ("mps", "--device mps: this PyTorch has no mps device to run on here; expected cpu, cuda or cuda:<index>"),
    ("meta", "--device meta: this PyTorch has no meta device to run on here; expected cpu, cuda or cuda:<index>"),
])
def test_generate_error_device_is_one_line(tmp_path, capsys, monkeypatch, device, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    make_model_dir(tmp_path / "model", small_config())
    err = cli_error(["generate", str(tmp_path / "model"), "--device", device], capsys)
    assert err == f"fabric-lin generate: error: {message}\n"


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_generate_a_seed_past_64_bits_is_one_line(tmp_path, capsys, seed):
    """torch's generator takes 64-bit seeds; a larger one failed with a traceback once the model was loaded."""
    make_model_dir(tmp_path / "model", small_config())
    err = cli_error(["generate", str(tmp_path / "model"), "--device", "cpu", "--seed", str(seed)], capsys)
    assert err == f"fabric-lin generate: error: --seed {seed}: expected a 64-bit seed, 0 to {2**64 - 1}\n"


def test_generate_error_cuda_index_past_the_gpus_is_one_line(monkeypatch):
    from fabric_lin.generate import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=r"^--device cuda:2: this machine has 2 CUDA GPU\(s\), cuda:0 to cuda:1$"):
        resolve_device("cuda:2")


def test_generate_checks_its_arguments_before_the_model_and_the_tokenizer_against_it(tmp_path, capsys):
    """A model of 32 embeddings with a tokenizer of 64 pieces: not its tokenizer, one line; a bad precision or
    temperature is named before that (and before the model is loaded, which takes minutes for a large one)."""
    from fabric_lin.generate import load_model

    make_model_dir(tmp_path / "model", Config.from_name("gla-debug", vocab_size=32, num_layers=2))
    model = str(tmp_path / "model")
    err = cli_error(["generate", model, "--precision", "bf16-mixed"], capsys)
    assert err == "fabric-lin generate: error: --precision bf16-mixed: expected one of 16-true, 32-true, bf16-true\n"
    err = cli_error(["generate", model, "--temperature", "-1"], capsys)
    assert err == "fabric-lin generate: error: --temperature -1: expected a finite number >= 0 (0: greedy)\n"
    err = cli_error(["generate", model, "--device", "cpu"], capsys)
    assert err.startswith(f"fabric-lin generate: error: {model}: its tokenizer has 64 pieces and its model 32 embeddings")
    # on the CPU the model decodes with PyTorch's ops, not the Triton kernels, which need a GPU
    assert not load_model(tmp_path / "model", torch.device("cpu"), torch.float32).fused


def test_a_training_checkpoint_is_refused_by_convert_to_hf_before_its_weights_are_read(tmp_path, capsys, monkeypatch):
    """A run's final/ (its lit_model.pth holds the optimizer's state too, twice the weights and more) is named as a
    training checkpoint from its step.json and manifest.json, with the conversion that makes a model directory of it:
    it was read whole first, minutes and memory for a large model, to be refused by the keys it held. (generate reads
    it, as evaluate does: test_generate_checkpoints.py.)"""
    import fabric_lin.convert.model_dir as model_dir

    checkpoint = tmp_path / "run" / "final"
    state = make_model_dir(checkpoint, small_config())
    torch.save({"model": state, "iter_num": 4}, checkpoint / "lit_model.pth")
    for name in ("step.json", "manifest.json"):
        (checkpoint / name).write_text("{}")

    def not_read(path, *args, **kwargs):
        raise AssertionError(f"{path} was read")

    monkeypatch.setattr(model_dir, "torch_load_tensors", not_read)
    err = cli_error(["convert_to_hf", str(checkpoint), "--output_dir", str(tmp_path / "out")], capsys)
    assert err == (f"fabric-lin convert_to_hf: error: model_dir {checkpoint} is a training checkpoint: convert_to_hf reads "
                   f"a model directory; make one of it with: fabric-lin convert_pretrained_checkpoint {checkpoint} "
                   f"--output_dir <DIR>\n")
    assert not (tmp_path / "out").exists()


def test_generate_a_prompt_that_is_not_utf8_is_one_line(tmp_path, capsys):
    """A prompt typed in a terminal of another encoding (Latin-1's "café"): Python hands its undecodable byte over as
    a surrogate, which SentencePiece's binding cannot take (a traceback); refused naming the byte, before the model."""
    make_model_dir(tmp_path / "model", small_config())
    err = cli_error(["generate", str(tmp_path / "model"), "--prompt", b"caf\xe9".decode("utf-8", "surrogateescape")], capsys)
    assert err == ("fabric-lin generate: error: --prompt is not UTF-8 text: byte 0xe9 at character 3 (a terminal or "
                   "script in another encoding, e.g. Latin-1?); give the prompt as UTF-8\n"), err


def full_forward_continuation(model: GPT, ids: list, max_new_tokens: int, vocab_size: int, eos_id: int, pick) -> list:
    """New tokens, each `pick`ed from the full forward's last logits over the tokenizer's ids (no cache), up to
    and including eos_id."""
    ids, new = list(ids), []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            token = pick(model(torch.tensor([ids]))[0, -1, :vocab_size].double())
            new.append(token)
            ids.append(token)
            if token == eos_id:
                break
    return new


def test_generate_command_continues_the_prompt_as_a_document_start(tmp_path, capsys):
    """`fabric-lin generate`'s text is the prompt and the tokens the model picks after end-of-text and the prompt (a
    document's start), decoded together; greedy at temperature 0, else drawn from the top_k tokens with the seed's
    generator; it stops after end-of-text."""
    from fabric_lin.data import Tokenizer
    from fabric_lin.generate import main as generate

    config = small_config()
    state = make_model_dir(tmp_path / "model", config)
    model = GPT(config).eval()
    model.load_state_dict(state)
    tokenizer = Tokenizer(tmp_path / "model")
    prompt = "the gated model"
    prompt_ids = tokenizer.encode(prompt).tolist()
    after_end_of_text = [tokenizer.eos_id] + prompt_ids

    def continuation(pick, n=8):
        return full_forward_continuation(model, after_end_of_text, n, tokenizer.vocab_size, tokenizer.eos_id, pick)

    greedy = continuation(lambda logits: logits.argmax().item())
    capsys.readouterr()
    text = generate(tmp_path / "model", prompt=prompt, max_new_tokens=8, temperature=0.0, device="cpu")
    assert text == tokenizer.decode(prompt_ids + greedy) and " " in text[len(prompt):]
    assert capsys.readouterr().out == text + "\n"  # printed as it came

    temperature, top_k, seed = 0.8, 3, 7
    generator = torch.Generator().manual_seed(seed)

    def draw(logits):
        logits = logits / temperature
        kth = logits.sort(descending=True).values[top_k - 1]
        probs = F.softmax(logits.masked_fill(logits < kth, -math.inf), dim=-1)
        return torch.multinomial(probs.float(), 1, generator=generator).item()

    sampled = continuation(draw)
    assert sampled != greedy
    text = generate(tmp_path / "model", prompt=prompt, max_new_tokens=8, temperature=temperature, top_k=top_k, seed=seed,
                    device="cpu")
    assert text == tokenizer.decode(prompt_ids + sampled)

    # the head's rows of the first greedy token and of end-of-text swapped: end-of-text comes first, and ends the text
    head = state["lm_head.weight"]
    head[[greedy[0], tokenizer.eos_id]] = head[[tokenizer.eos_id, greedy[0]]]
    torch.save(state, tmp_path / "model" / "lit_model.pth")
    capsys.readouterr()
    assert generate(tmp_path / "model", prompt=prompt, max_new_tokens=8, temperature=0.0, device="cpu") == prompt
    assert capsys.readouterr().err.startswith("1 tokens in ")


def test_readmes_python_lines_run_as_written(tmp_path, capsys):
    """README's "From Python" lines, on a small GLA's model directory in place of checkpoints/gla-340M and its export
    in place of hf/gla-340M: a named model's logits, the directory's greedy decoding (each token the argmax of the
    full forward at the position before it, printed as text) and the export read back into the directory's weights."""
    import re
    from pathlib import Path

    from fabric_lin.convert.hf import convert_to_hf
    from fabric_lin.data.tokenizer import Tokenizer

    readme = (Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8")
    (snippet,) = [block for block in re.findall(r"```python\n(.*?)```", readme, re.S) if "read_fla_checkpoint" in block]
    config = small_config()
    state = make_model_dir(tmp_path / "model", config)
    convert_to_hf(tmp_path / "model", tmp_path / "hf")
    capsys.readouterr()  # the export's lines
    snippet = snippet.replace('"checkpoints/gla-340M"', repr(str(tmp_path / "model")))
    namespace = {}
    exec(snippet.replace('"hf/gla-340M"', repr(str(tmp_path / "hf"))), namespace)

    assert namespace["logits"].shape == (2, 16, Config.from_name("gla-debug").vocab_size)
    tokenizer, reference = Tokenizer(tmp_path / "model"), GPT(config)
    reference.load_state_dict(state)
    ids = [tokenizer.eos_id] + tokenizer.encode("The capital of France").tolist()
    expected = []
    with torch.no_grad():
        for _ in range(20):
            expected.append(int(reference(torch.tensor([ids + expected]))[0, -1, :tokenizer.vocab_size].argmax()))
            if expected[-1] == tokenizer.eos_id:
                break
    assert capsys.readouterr().out == tokenizer.decode(expected) + "\n"
    loaded = namespace["model"].state_dict()
    assert sorted(loaded) == sorted(state) and all(torch.equal(loaded[name], state[name]) for name in state)


def test_generate_reads_the_prompt_from_a_file(tmp_path, capsys):
    """--prompt_file: the file's UTF-8 text is the prompt (less the line end an editor adds; a byte order mark left
    out), `-` standard input; a file that is missing, a directory, in another encoding, or given with --prompt too is
    refused in one line before the model is read."""
    import io
    import sys

    from fabric_lin.generate import main as generate, read_prompt_file

    make_model_dir(tmp_path / "model", small_config())
    expected = generate(tmp_path / "model", prompt="the model", max_new_tokens=6, temperature=0.0, device="cpu")
    for name, content in (("plain.txt", b"the model\n"), ("windows.txt", b"\xef\xbb\xbfthe model\r\n"),
                          ("bare.txt", b"the model")):
        (tmp_path / name).write_bytes(content)
        assert generate(tmp_path / "model", prompt_file=tmp_path / name, max_new_tokens=6, temperature=0.0,
                        device="cpu") == expected, name
    (tmp_path / "two lines.txt").write_bytes(b"the model\n\n")  # one line end left out, not the blank line
    assert read_prompt_file(tmp_path / "two lines.txt") == "the model\n"
    stdin = sys.stdin
    sys.stdin = io.TextIOWrapper(io.BytesIO(b"the model\n"))
    try:
        assert generate(tmp_path / "model", prompt_file="-", max_new_tokens=6, temperature=0.0, device="cpu") == expected
    finally:
        sys.stdin = stdin

    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
    (tmp_path / "utf16.txt").write_bytes("the model".encode("utf-16"))
    model, given = str(tmp_path / "model"), str(tmp_path / "plain.txt")
    for argv, message in (
        (["--prompt", "the model", "--prompt_file", given], "--prompt and --prompt_file both give the prompt: give one "
                                                            "of them"),
        (["--prompt_file", str(tmp_path / "none.txt")], f"--prompt_file {tmp_path / 'none.txt'} does not exist: "
                                                       "expected a text file holding the prompt"),
        (["--prompt_file", str(tmp_path)], f"--prompt_file {tmp_path} is a directory: expected a text file holding the "
                                           "prompt"),
        (["--prompt_file", str(tmp_path / "latin1.txt")], f"--prompt_file {tmp_path / 'latin1.txt'} is not UTF-8 text: "
                                                          "byte 0xe9 at byte 3 (a file in another encoding, e.g. "
                                                          "Latin-1?); save it as UTF-8"),
        (["--prompt_file", str(tmp_path / "utf16.txt")], f"--prompt_file {tmp_path / 'utf16.txt'} is UTF-16 text (it "
                                                         "starts with UTF-16's byte order mark), expected UTF-8: convert "
                                                         "it first, e.g. iconv -f UTF-16 -t UTF-8"),
        (["--prompt_file", model + "/lit_model.pth"], f"--prompt_file {model}/lit_model.pth is not a text file (it "
                                                       "holds a NUL byte at byte 4): expected a UTF-8 text file holding "
                                                       "the prompt"),
    ):
        assert cli_error(["generate", model, *argv], capsys) == f"fabric-lin generate: error: {message}\n", argv


def test_generate_an_empty_prompt_samples_a_document_from_its_start(tmp_path, capsys):
    """An empty --prompt, one the tokenizer makes no token of (spaces, which SentencePiece drops here) and an empty
    --prompt_file alike: the model continues the end-of-text token alone (the full forward's greedy tokens after it),
    and a line on stderr says the prompt is empty."""
    from fabric_lin.data import Tokenizer
    from fabric_lin.generate import main as generate

    config = small_config()
    state = make_model_dir(tmp_path / "model", config)
    model = GPT(config).eval()
    model.load_state_dict(state)
    tokenizer = Tokenizer(tmp_path / "model")
    assert tokenizer.encode("   ").tolist() == []
    greedy = full_forward_continuation(model, [tokenizer.eos_id], 8, tokenizer.vocab_size, tokenizer.eos_id,
                                       lambda logits: logits.argmax().item())
    (tmp_path / "empty.txt").write_bytes(b"\n")
    for kwargs, said in (({"prompt": ""}, "--prompt '' is empty"),
                         ({"prompt": "   "}, "--prompt '   ' gives the tokenizer no token"),
                         ({"prompt_file": tmp_path / "empty.txt"}, f"--prompt_file {tmp_path / 'empty.txt'} is empty")):
        capsys.readouterr()
        text = generate(tmp_path / "model", max_new_tokens=8, temperature=0.0, device="cpu", **kwargs)
        out, err = capsys.readouterr()
        assert text == tokenizer.decode(greedy) and out == text + "\n" and text, kwargs
        assert err.startswith(f"({said}: the model samples a document from its start)\n"), err


def test_generate_an_empty_prompt_without_end_of_text_is_one_line(tmp_path, capsys):
    """A tokenizer without an end-of-text token leaves an empty prompt nothing to continue: one line, not the error of
    a prompt tensor of no token."""
    import sentencepiece as spm

    make_model_dir(tmp_path / "model", small_config())
    (tmp_path / "corpus.txt").write_text("\n".join(f"the gated linear attention model number {i}" for i in range(200)))
    spm.SentencePieceTrainer.Train(input=str(tmp_path / "corpus.txt"), model_prefix=str(tmp_path / "model" / "tokenizer"),
                                   vocab_size=64, model_type="bpe", bos_id=1, eos_id=-1, unk_id=0, pad_id=-1,
                                   minloglevel=2)
    err = cli_error(["generate", str(tmp_path / "model"), "--prompt", "", "--device", "cpu"], capsys)
    assert err.startswith("fabric-lin generate: error: --prompt '' is empty, and the tokenizer has no end-of-text token "
                          f"to start a document after ({tmp_path / 'model' / 'tokenizer.model'} (vocab_size=64"), err
    assert err.endswith("): expected a prompt of at least one token\n"), err


def test_generate_refuses_softmax_attention_past_its_max_seq_length(tmp_path, capsys, monkeypatch):
    """A transformer's and a hybrid's prompt (with the end-of-text token before it) and new tokens past the
    max_seq_length they were trained at: one line naming --max_new_tokens and the most it can be, before the weights
    are read; up to it, the text is generated. GLA keeps a state, not positions, and generates past it."""
    import fabric_lin.checkpoint_kinds as kinds
    import fabric_lin.generate as generate_module
    from fabric_lin.data import Tokenizer

    def config(family):
        overrides = dict(max_seq_length=16)
        if family == "hybrid":
            overrides.update(attn_layers=[1], attn_num_heads=2)
        name = "transformer-debug" if family == "transformer" else "gla-debug"
        return Config.from_name(name, vocab_size=64, num_layers=2, **overrides)

    for family in ("transformer", "hybrid", "gla"):
        make_model_dir(tmp_path / family, config(family))
    prompt_length = 1 + len(Tokenizer(tmp_path / "gla").encode("the model"))  # the end-of-text token first
    room = 16 - prompt_length
    assert room > 0
    for family, trained in (("transformer", "this transformer was"),
                            ("hybrid", "this hybrid's softmax-attention layers were")):
        argv = ["generate", str(tmp_path / family), "--prompt", "the model", "--device", "cpu", "--temperature", "0"]
        with monkeypatch.context() as patch:
            patch.setattr(kinds.FoundCheckpoint, "read", None)  # refused before the weights are read
            err = cli_error(argv + ["--max_new_tokens", str(room + 1)], capsys)
        assert err == (f"fabric-lin generate: error: --max_new_tokens {room + 1}: a prompt of {prompt_length} tokens (the "
                       f"end-of-text token before it included) and {room + 1} new ones are 17 positions, past the "
                       f"max_seq_length of 16 that {trained} trained at: give --max_new_tokens {room} or less, or a "
                       f"shorter prompt\n"), err
        text = generate_module.main(tmp_path / family, prompt="the model", max_new_tokens=room, temperature=0.0,
                                    device="cpu")
        assert text.startswith("the model")
        # the Python function refuses it too, naming its own argument; a prompt of the whole length leaves no room
        model = generate_module.load_model(tmp_path / family, torch.device("cpu"), torch.float32)
        with pytest.raises(ValueError, match=r"^max_new_tokens 5: a prompt of 12 tokens and 5 new ones are 17 "
                                             r"positions, .*: give max_new_tokens 4 or less, or a shorter prompt$"):
            generate_tokens(model, torch.arange(12), 5)
        with pytest.raises(ValueError, match=r"^max_new_tokens 1: a prompt of 16 tokens .*: give a prompt shorter than "
                                             r"16 tokens$"):
            generate_tokens(model, torch.arange(16), 1)
    capsys.readouterr()
    generate_module.main(tmp_path / "gla", prompt="the model", max_new_tokens=24, temperature=0.0, device="cpu")
    assert capsys.readouterr().err.startswith("24 tokens in ")  # 31 positions, no end-of-text token among them


@pytest.mark.parametrize("value, named", [("inf", "inf"), ("nan", "nan"), ("-inf", "-inf"), ("Infinity", "inf"),
                                          ("1e400", "inf"), (".inf", "inf")])
def test_generate_a_temperature_that_is_not_finite_is_one_line(tmp_path, capsys, value, named):
    """jsonargparse refuses inf and nan for a float as "expected float" (which they are), and argparse -inf as an
    option: each is refused as a temperature, a finite number >= 0."""
    make_model_dir(tmp_path / "model", small_config())
    err = cli_error(["generate", str(tmp_path / "model"), "--temperature", value], capsys)
    assert err == f"fabric-lin generate: error: --temperature {named}: expected a finite number >= 0 (0: greedy)\n"


@pytest.mark.parametrize("command, argument", [("generate", "checkpoint_dir"), ("evaluate", "checkpoint_dir"),
                                               ("convert_to_hf", "model_dir")])
def test_a_command_without_its_argument_points_to_its_own_help(capsys, command, argument):
    """`fabric-lin generate` alone: the missing argument named with the command's usage, and the command's --help
    pointed to, not fabric-lin's (where jsonargparse's top-level parser, which finds it missing, pointed)."""
    from fabric_lin.cli import main as cli_main

    with pytest.raises(SystemExit) as info:
        cli_main([command])
    assert info.value.code == 2
    assert capsys.readouterr().err == (f"fabric-lin {command}: error: {argument} is required: fabric-lin {command} "
                                       f"{argument.upper()} [options]\n(fabric-lin {command} --help lists the options)\n")
