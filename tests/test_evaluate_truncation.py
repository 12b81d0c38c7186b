"""lm-evaluation-harness's requests on a model with a context limit (a transformer, a hybrid's attention layers: the
max_seq_length they were trained at) are cut as the harness's own Hugging Face model cuts them, against a full forward
pass over the tokens kept: a log-likelihood's context from the left, to max_seq_length tokens with its continuation;
a generation's context to max_seq_length less max_gen_toks; a document's rolling log-likelihood in the harness's
windows (`lm_eval.utils.get_rolling_token_windows` itself, where the harness is installed). How many were cut is said
once per kind of request. Linear attention has no limit and reads every request whole."""
import pytest
import torch

from fabric_lin.config import Config
from fabric_lin.errors import InvalidValue
from fabric_lin.evaluate import HarnessScorer
from fabric_lin.model import GPT
from helpers import train_sentencepiece

LIMIT = 16
SENTENCE = "the gated linear attention model number {} reads tokens"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from fabric_lin.data import Tokenizer

    directory = tmp_path_factory.mktemp("tokenizer")
    train_sentencepiece(directory, sentence=SENTENCE)
    return Tokenizer(directory)


def model_of(family: str) -> GPT:
    """A small model of `family` (a hybrid: GLA with softmax attention in its second layer) at max_seq_length 16."""
    overrides = dict(vocab_size=64, num_layers=2, max_seq_length=LIMIT)
    if family == "hybrid":
        overrides.update(attn_layers=[1], attn_num_heads=2)
    torch.manual_seed(0)
    return GPT(Config.from_name("gla-debug" if family in ("gla", "hybrid") else "transformer-debug", **overrides)).eval()


def scorer_for(model: GPT, tokenizer, batch_size: int = 2, block_size: int = LIMIT) -> HarnessScorer:
    import lightning_fabric as L

    fabric = L.Fabric(accelerator="cpu", devices=1, precision="32-true")
    return HarnessScorer(fabric, fabric.setup_module(model), tokenizer, batch_size, block_size=block_size)


def logprobs_after(model: GPT, tokens: list) -> torch.Tensor:
    """log p(tokens[t] | tokens[:t]) for t >= 1, from one forward pass over tokens[:-1] (no cache)."""
    ids = torch.tensor(tokens)[None]
    with torch.no_grad():
        logits = model(ids[:, :-1])[0].double()
    return torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None])[:, 0]


def text(words: int, start: int = 0) -> str:
    return " ".join(SENTENCE.format(i) for i in range(start, start + words))


def thes(n: int) -> str:
    """n tokens exactly: "the" is one token of the tokenizer, with or without the space before it."""
    return " ".join(["the"] * n)


@pytest.mark.parametrize("family", ["transformer", "hybrid"])
def test_a_log_likelihood_past_the_limit_reads_the_last_max_seq_length_tokens(tokenizer, capsys, family):
    """The harness's own model reads (context + continuation)[-(max_length + 1):][:-1]: the end-of-text token and the
    context's first tokens fall away, the continuation is scored after the rest. Requests within the limit are read
    whole. A continuation longer than the limit cannot be read so: one line."""
    model = model_of(family)
    requests = [(text(2), " model number 5 reads tokens"), ("the gated", " linear"), (text(1, 7), " model")]
    eos = tokenizer.eos_id
    expected, cut = [], 0
    for context, continuation in requests:
        whole = [eos] + tokenizer.encode(context + continuation).tolist()
        n = len(whole) - 1 - len(tokenizer.encode(context))
        cut += len(whole) - 1 > LIMIT
        expected.append(logprobs_after(model, whole[-(LIMIT + 1):])[-n:].sum().item())
    assert cut == 2
    capsys.readouterr()
    scorer = scorer_for(model, tokenizer)
    got = [logprob for logprob, _ in scorer.loglikelihood(requests)]
    assert got == pytest.approx(expected, abs=1e-4)
    trained = "this transformer was" if family == "transformer" else "this hybrid's softmax-attention layers were"
    assert capsys.readouterr().out == (
        f"lm-evaluation-harness: 2 of 3 loglikelihood requests are longer than the max_seq_length of 16 that {trained} "
        f"trained at: their contexts are cut from the left to fit, as the harness's own Hugging Face model reads them\n")
    assert scorer.cut == {"loglikelihood": 2}
    with pytest.raises(InvalidValue, match=rf"^lm-evaluation-harness asks for the log-likelihood of a continuation of "
                                           rf"\d+ tokens, longer than the max_seq_length of 16 that {trained} trained at: "
                                           rf"no context can be cut to fit it$"):
        scorer.loglikelihood([("the", " " + text(3))])


def test_linear_attention_reads_a_long_request_whole(tokenizer, capsys):
    model = model_of("gla")
    context, continuation = text(3), " " + text(1, 5)
    whole = [tokenizer.eos_id] + tokenizer.encode(context + continuation).tolist()
    n = len(whole) - 1 - len(tokenizer.encode(context))
    assert len(whole) - 1 > 2 * LIMIT
    capsys.readouterr()
    scorer = scorer_for(model, tokenizer)
    [(logprob, _)] = scorer.loglikelihood([(context, continuation)])
    assert logprob == pytest.approx(logprobs_after(model, whole)[-n:].sum().item(), abs=1e-4)
    assert capsys.readouterr().out == "" and scorer.cut == {}


def test_a_rolling_log_likelihood_past_the_limit_is_read_in_the_harness_s_windows(tokenizer, capsys):
    """A document of 41 tokens after its end-of-text token, at a limit of 16: targets 1-16 after the tokens from the
    document's start, 17-32 after the 16 tokens before the 32nd, 33-41 after the 16 tokens before the 41st, each from
    a fresh forward pass. A document within the limit is read whole."""
    model = model_of("transformer")
    document = text(2) + " the gated linear attention"
    tokens = [tokenizer.eos_id] + tokenizer.encode(document).tolist()
    assert len(tokens) == 1 + 41
    # the windows are the limit's whatever the block size (that of linear attention's blocks)
    scorer = scorer_for(model, tokenizer, batch_size=1, block_size=LIMIT // 2)
    assert list(scorer.rolling_windows(41)) == [(0, 16, 0), (16, 32, 16), (25, 41, 32)]
    expected = (logprobs_after(model, tokens[0:17]).sum() + logprobs_after(model, tokens[16:33]).sum()
                + logprobs_after(model, tokens[25:42])[-9:].sum()).item()
    short = "the gated linear"
    short_tokens = [tokenizer.eos_id] + tokenizer.encode(short).tolist()
    capsys.readouterr()
    got = scorer.loglikelihood_rolling([document, short])
    assert got == pytest.approx([expected, logprobs_after(model, short_tokens).sum().item()], abs=1e-4)
    assert capsys.readouterr().out.startswith(
        "lm-evaluation-harness: 1 of 2 loglikelihood_rolling requests are longer than the max_seq_length of 16 that this "
        "transformer was trained at: they are scored in windows of 16 tokens")
    assert scorer.cut == {"loglikelihood_rolling": 1}


@pytest.mark.parametrize("n", [1, 15, 16, 17, 31, 32, 33, 40, 100])
def test_the_rolling_windows_are_the_harness_s_own(tokenizer, n):
    """lm_eval.utils.get_rolling_token_windows with a context of 1, as its Hugging Face model calls it: the tokens each
    window reads and those it scores."""
    pytest.importorskip("lm_eval")
    from lm_eval.utils import get_rolling_token_windows

    ids = list(range(n + 1))  # 0: the end-of-text token before the document's tokens 1..n
    harness = list(get_rolling_token_windows(token_list=ids[1:], prefix_token=0, max_seq_len=LIMIT, context_len=1))
    ours = [(ids[start:end], ids[first + 1 : end + 1])
            for start, end, first in scorer_for(model_of("transformer"), tokenizer).rolling_windows(n)]
    assert ours == [(list(inputs), list(targets)) for inputs, targets in harness]


def test_a_generation_past_the_limit_reads_the_context_s_last_tokens(tokenizer, capsys):
    """max_gen_toks 4 at a limit of 16: the context's last 12 tokens (the end-of-text token fallen away) and the greedy
    tokens after them; a context that fits keeps its end-of-text token. max_gen_toks at the limit leaves no room: one
    line."""
    model = model_of("transformer")
    context = text(3)
    context_ids = tokenizer.encode(context).tolist()
    assert len(context_ids) > LIMIT
    kept, new = context_ids[-12:], []
    with torch.no_grad():
        for _ in range(4):
            new.append(int(model(torch.tensor([kept + new]))[0, -1, :tokenizer.vocab_size].argmax()))
            if new[-1] == tokenizer.eos_id:
                new.pop()
                break
    expected = tokenizer.decode(kept + new)[len(tokenizer.decode(kept)):]
    capsys.readouterr()
    scorer = scorer_for(model, tokenizer, batch_size=1)
    assert scorer.generate_until([(context, {"until": ["never there"], "max_gen_toks": 4})]) == [expected]
    assert capsys.readouterr().out.startswith(
        "lm-evaluation-harness: 1 of 1 generate_until requests are longer than the max_seq_length of 16 that this "
        "transformer was trained at: their contexts are cut from the left to leave room for the tokens to generate")
    assert scorer.cut == {"generate_until": 1}
    scorer.generate_until([(context, {"until": ["never there"], "max_gen_toks": 4})])
    assert scorer.cut == {"generate_until": 2}  # counted over every call, as run_tasks keeps them
    with pytest.raises(InvalidValue, match=r"^lm-evaluation-harness asks for up to 16 generated tokens \(a task's "
                                           r"max_gen_toks\), and the model reads no more than the max_seq_length of 16 "
                                           r"that this transformer was trained at: no room is left for a context before "
                                           r"them$"):
        scorer.generate_until([("the", {"max_gen_toks": 16})])


def test_requests_at_the_limit_are_read_whole_and_not_counted_as_cut(tokenizer, capsys):
    """The boundaries, a token either side: a log-likelihood of max_seq_length tokens after the end-of-text token, a
    document of max_seq_length tokens and a generation's prompt (the end-of-text token counted) of max_seq_length less
    max_gen_toks are read whole, keep their end-of-text token and are not counted; one token more is cut. A continuation
    of max_seq_length tokens is scored after the last context token, one of max_seq_length + 1 is refused."""
    model = model_of("transformer")
    eos = tokenizer.eos_id
    scorer = scorer_for(model, tokenizer)
    assert len(tokenizer.encode(thes(LIMIT + 1))) == LIMIT + 1
    capsys.readouterr()

    [the] = tokenizer.encode("the").tolist()
    at, past = [eos] + [the] * LIMIT, [eos] + [the] * (LIMIT + 1)
    got = [logprob for logprob, _ in scorer.loglikelihood([(thes(LIMIT - 1), " the"), (thes(LIMIT), " the"),
                                                            ("the", " " + thes(LIMIT))])]
    expected = [logprobs_after(model, at)[-1].item(), logprobs_after(model, past[1:])[-1].item(),
                logprobs_after(model, past[1:]).sum().item()]
    assert got == pytest.approx(expected, abs=1e-4)
    assert scorer.cut == {"loglikelihood": 2}
    with pytest.raises(InvalidValue, match=r"a continuation of 17 tokens, longer than the max_seq_length of 16"):
        scorer.loglikelihood([("the", " " + thes(LIMIT + 1))])

    got = scorer.loglikelihood_rolling([thes(LIMIT), thes(LIMIT + 1)])
    expected = [logprobs_after(model, at).sum().item(),
                (logprobs_after(model, past[:-1]).sum() + logprobs_after(model, past[1:])[-1]).item()]
    assert got == pytest.approx(expected, abs=1e-4)
    assert scorer.cut["loglikelihood_rolling"] == 1

    def greedy(prompt: list, n: int) -> str:
        new = []
        with torch.no_grad():
            for _ in range(n):
                new.append(int(model(torch.tensor([prompt + new]))[0, -1, :tokenizer.vocab_size].argmax()))
                if new[-1] == eos:
                    new.pop()
                    break
        context = [t for t in prompt if t != eos]
        return tokenizer.decode(context + new)[len(tokenizer.decode(context)):]

    fits, cut = at[: LIMIT - 4], at[: LIMIT - 3]  # the prompts' tokens, the end-of-text token first
    options = {"until": ["never there"], "max_gen_toks": 4}
    got = scorer.generate_until([(thes(LIMIT - 5), options), (thes(LIMIT - 4), options)])
    assert got == [greedy(fits, 4), greedy(cut[1:], 4)]
    assert scorer.cut["generate_until"] == 1
    capsys.readouterr()


def test_a_generation_without_max_gen_toks_leaves_room_for_the_harness_s_256(tokenizer):
    """The harness's default max_gen_toks, 256, is that of a request that gives none: past a limit of 16, no room."""
    scorer = scorer_for(model_of("transformer"), tokenizer)
    with pytest.raises(InvalidValue, match=r"^lm-evaluation-harness asks for up to 256 generated tokens"):
        scorer.generate_until([("the", {"until": ["never there"]})])
