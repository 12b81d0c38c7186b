"""Sampling's options against independent references: top_p (nucleus sampling) keeps the tokens that Hugging Face's
formulation keeps (those outside the least likely ones whose probability adds up to 1 - top_p at most), after the
temperature and top_k, in `sample`, the generate command and the harness's generate_until; a top_p outside (0, 1]
is one line."""
import pytest
import torch

from fabric_lin.generate import generate_tokens, sample
from helpers import cli_error, make_model_dir, small_config


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """`probs` within top_p as Hugging Face's TopPLogitsWarper reads it: sorted from the least likely, the tokens whose
    cumulative probability is at most 1 - top_p are left out (the most likely one never), the rest renormalized."""
    ascending, order = torch.sort(probs.double())
    left_out = ascending.cumsum(0) <= 1 - top_p
    left_out[-1] = False
    kept = probs.double().clone()
    kept[order[left_out]] = 0
    return kept / kept.sum()


def frequencies(logits, temperature, top_k, top_p, draws=4000):
    g = torch.Generator().manual_seed(0)
    tokens = torch.stack([sample(logits, temperature, top_k, g, top_p) for _ in range(draws)])
    return torch.bincount(tokens, minlength=len(logits)).double() / draws


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, None, 0.7), (1.0, None, 0.95), (0.5, None, 0.9),
                                                       (1.0, 3, 0.9), (2.0, 4, 0.5), (1.0, None, 0.2)])
def test_top_p_samples_the_tokens_hugging_face_s_nucleus_keeps(temperature, top_k, top_p):
    logits = torch.tensor([0.0, 1.0, 2.0, 3.0, 0.5, 2.5])
    probs = torch.softmax(logits.double() / temperature, 0)
    if top_k:
        probs[probs < probs.topk(top_k).values[-1]] = 0
        probs /= probs.sum()
    expected = nucleus(probs, top_p)
    got = frequencies(logits, temperature, top_k, top_p)
    assert ((got > 0) == (expected > 0)).all(), (got, expected)
    torch.testing.assert_close(got, expected, rtol=0, atol=0.025)


def test_top_p_of_one_is_no_filter_and_a_tiny_one_is_the_most_likely_token():
    logits = torch.tensor([0.0, 1.0, 2.0, 0.3])
    for seed in range(20):
        assert sample(logits, 1.0, None, torch.Generator().manual_seed(seed), 1.0) == sample(
            logits, 1.0, None, torch.Generator().manual_seed(seed))
        assert sample(logits, 1.0, None, torch.Generator().manual_seed(seed), 1e-6).item() == 2



@pytest.mark.parametrize("top_p, kept", [(0.25, 1), (0.5, 2), (0.75, 3), (0.76, 4)])
def test_a_token_whose_more_likely_tokens_hold_top_p_exactly_is_left_out(top_p, kept):
    """Four tokens of probability 1/4 each (exact in floating point): the tokens before one hold 0, 1/4, 1/2 and 3/4,
    and where that is top_p or more it is left out, as Hugging Face's formulation (`nucleus`) leaves it out."""
    logits, probs = torch.zeros(4), torch.full((4,), 0.25, dtype=torch.float64)
    assert int((nucleus(probs, top_p) > 0).sum()) == kept
    assert int((frequencies(logits, 1.0, None, top_p, draws=400) > 0).sum()) == kept

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("sampling") / "model"
    make_model_dir(directory, small_config())
    return directory


def test_generate_top_p_samples_within_the_nucleus(model_dir, capsys):
    from fabric_lin.generate import main as generate

    greedy = generate(model_dir, prompt="the model", max_new_tokens=8, temperature=0.0, device="cpu")
    # the nucleus of a tiny top_p is the most likely token alone: sampling at any temperature is greedy
    assert generate(model_dir, prompt="the model", max_new_tokens=8, temperature=1.5, top_k=0, top_p=1e-6,
                    device="cpu") == greedy
    seeds = [generate(model_dir, prompt="the model", max_new_tokens=8, temperature=1.5, top_p=0.9, seed=seed,
                      device="cpu") for seed in range(4)]
    assert all(text.startswith("the model") for text in seeds) and len(set(seeds)) > 1


@pytest.mark.parametrize("value", ["0", "-0.1", "1.5", "nan"])
def test_a_top_p_outside_zero_to_one_is_one_line(model_dir, capsys, value):
    err = cli_error(["generate", str(model_dir), "--top_p", value], capsys)
    assert err == (f"fabric-lin generate: error: --top_p {float(value):g}: expected a probability in (0, 1]: the share of "
                   f"the probability that the tokens sampled among hold (1: every token)\n")
    config = model_dir.parent / "sampling.yaml"  # a config file's, named with the file
    config.write_text(f"top_p: {value if value != 'nan' else '.nan'}\n")
    assert cli_error(["generate", str(model_dir), "--config", str(config)], capsys) == (
        f"fabric-lin generate: error: top_p {float(value):g}: expected a probability in (0, 1]: the share of the "
        f"probability that the tokens sampled among hold (1: every token) (in {config})\n")
    with pytest.raises(ValueError, match=r"^top_p 0: expected a probability in \(0, 1\]"):  # checked before the model
        generate_tokens(None, torch.tensor([1]), 1, top_p=0.0)


def test_the_harness_s_generate_until_samples_within_a_task_s_top_p(model_dir):
    """A task that samples (do_sample, a temperature) with a tiny top_p: its nucleus is the most likely token alone,
    so the text is the greedy one, as Hugging Face's generate gives it; without top_p it samples."""
    import lightning_fabric as L

    from fabric_lin.config import Config
    from fabric_lin.data import Tokenizer
    from fabric_lin.harness import HarnessScorer
    from fabric_lin.model import GPT

    model = GPT(Config.from_checkpoint(model_dir))
    model.load_state_dict(torch.load(model_dir / "lit_model.pth"))
    fabric = L.Fabric(accelerator="cpu", devices=1, precision="32-true")
    scorer = HarnessScorer(fabric, fabric.setup_module(model.eval()), Tokenizer(model_dir), batch_size=1, block_size=32)
    context = "the model reads"
    greedy = {"until": ["never there"], "max_gen_toks": 10}
    sampled = {**greedy, "do_sample": True, "temperature": 2.0}
    (expected,) = scorer.generate_until([(context, greedy)])
    assert scorer.generate_until([(context, {**sampled, "top_p": 1e-6})]) == [expected]
    assert scorer.generate_until([(context, sampled)]) != [expected]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_model_whose_logits_are_not_finite_is_one_line(model_dir, tmp_path, capsys, temperature):
    """Weights holding a NaN (or a float16 overflow): sampling raised torch.multinomial's RuntimeError, and greedy
    decoding printed the tokens that argmax picks among NaNs."""
    import shutil

    broken = tmp_path / "model"
    shutil.copytree(model_dir, broken)
    state = torch.load(broken / "lit_model.pth")
    name = next(name for name in state if name.endswith("norm.weight"))
    state[name][0] = float("nan")
    torch.save(state, broken / "lit_model.pth")
    err = cli_error(["generate", str(broken), "--temperature", str(temperature), "--device", "cpu"], capsys)
    assert err == ("fabric-lin generate: error: the model's logits for new token 1 are not finite (NaN or inf): its "
                   "weights hold NaN or inf, or its activations overflow float32 (float16's range ends at 65504: bfloat16 "
                   "or float32, --precision bf16-true or 32-true, go past 1e38)\n")
