"""`fabric-lin generate`: sample text from a model directory, a training checkpoint or an fla export (read as
`fabric-lin evaluate` reads them: fabric_lin.checkpoint_kinds).

GLA decodes with its recurrent state (one [B, H, K, V] tensor per layer, whatever the length);
the transformer baseline with a growing key/value cache.
"""
import json
import math
import re
import sys
import time
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Union

import torch

from fabric_lin.config import Config
from fabric_lin.errors import InvalidValue, UserError
from fabric_lin.model import GPT


def generate_tokens(
    model: GPT,
    prompt: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    eos_id: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
    vocab_size: Optional[int] = None,
    top_p: float = 1.0,
) -> torch.Tensor:
    """prompt: [T] token ids. Returns the new tokens [<= max_new_tokens] (stops after eos_id). With
    `vocab_size`, only ids below it are sampled: a model may have more rows than its tokenizer has pieces
    (a padded vocabulary), and those ids decode to nothing."""
    new_tokens = list(stream_tokens(model, prompt, max_new_tokens, temperature, top_k, eos_id, generator, vocab_size,
                                    top_p))
    return torch.stack(new_tokens) if new_tokens else prompt.new_empty(0)


@torch.no_grad()
def stream_tokens(
    model: GPT,
    prompt: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    eos_id: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
    vocab_size: Optional[int] = None,
    top_p: float = 1.0,
) -> Iterator[torch.Tensor]:
    """`generate_tokens`, one new token (a 0-d tensor) at a time, as each is sampled."""
    check_generation_args(max_new_tokens, temperature, top_k, top_p=top_p)
    if prompt.dim() != 1 or len(prompt) == 0:
        raise InvalidValue(f"prompt must be a 1-D tensor of at least one token id, got shape {tuple(prompt.shape)}")
    check_context_length(model.config, len(prompt), max_new_tokens)
    cache = model.new_cache()
    input_ids = prompt[None]  # the whole prompt in one chunked pass, then one token at a time
    for step in range(max_new_tokens):  # a pass only when its logits are sampled: none after the last token
        logits = model(input_ids, cache=cache)[0, -1][:vocab_size]
        if not torch.isfinite(logits).all():  # NaN would be argmax's pick, or torch.multinomial's RuntimeError
            raise InvalidValue(
                f"the model's logits for new token {step + 1} are not finite (NaN or inf): its weights hold NaN or inf, "
                f"or its activations overflow {str(logits.dtype).removeprefix('torch.')} (float16's range ends at 65504: "
                f"bfloat16 or float32, --precision bf16-true or 32-true, go past 1e38)"
            )
        token = sample(logits, temperature, top_k, generator, top_p)
        yield token
        if eos_id is not None and token.item() == eos_id:
            return
        input_ids = token.view(1, 1)


class GrowingText:
    """The text of a prompt and the tokens added to it so far. A piece decodes into more than its own text
    (SentencePiece joins words, and one character can take several byte tokens), so the whole text is
    decoded after each token, and what lies past the text given so far is new; a character still missing
    bytes waits for them."""

    def __init__(self, tokenizer, prompt_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.ids = [int(t) for t in prompt_ids]
        self.text = tokenizer.decode(self.ids)

    def add(self, token: torch.Tensor) -> str:
        """The new text that `token` completes ("" while it completes none)."""
        self.ids.append(int(token))
        text = self.tokenizer.decode(self.ids)
        if not text.startswith(self.text) or text.endswith("\ufffd"):
            return ""
        new, self.text = text[len(self.text):], text
        return new


def sample(logits: torch.Tensor, temperature: float, top_k: Optional[int], generator=None,
           top_p: float = 1.0) -> torch.Tensor:
    """One token from `logits` [V]: greedy at temperature <= 0, else among the `top_k` most likely
    tokens (None or 0: all of them, as in Hugging Face's `generate`), and of those the fewest most likely whose
    probability adds up to `top_p` at least (nucleus sampling; 1: all of them)."""
    logits = logits.float()
    if temperature <= 0:
        return logits.argmax(dim=-1)
    # the largest logit made 0 first: a temperature near 0 then sends the others to -inf, where dividing the logits
    # themselves would overflow to inf (and the softmax of two infinities is NaN); the distribution is the same
    logits = (logits - logits.max()) / temperature
    if top_k and top_k < logits.shape[-1]:
        threshold = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        # a token is kept while the tokens more likely than it hold less than top_p: the most likely one always is
        sorted_probs, order = torch.sort(probs, descending=True)
        dropped = sorted_probs.cumsum(-1) - sorted_probs >= top_p
        probs = probs.masked_fill(dropped.scatter(0, order, dropped), 0.0)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)


def check_generation_args(max_new_tokens: int, temperature: float, top_k: Optional[int], option_prefix: str = "",
                          top_p: float = 1.0) -> None:
    """Refuse a value that cannot be sampled with, named as the caller gave it: `option_prefix` "--" for the command
    line's options, "" for the Python arguments."""
    if max_new_tokens < 0:
        raise InvalidValue(f"{option_prefix}max_new_tokens {max_new_tokens}: expected 0 or a positive number of tokens")
    # NaN fails both comparisons; an infinite temperature would sample every token alike, top_k or not
    if not (temperature >= 0 and math.isfinite(temperature)):
        raise InvalidValue(f"{option_prefix}temperature {temperature:g}: expected a finite number >= 0 (0: greedy)")
    if top_k is not None and top_k < 0:
        no_value = "null" if option_prefix else "None"
        raise InvalidValue(f"{option_prefix}top_k {top_k}: expected a positive number of tokens, or 0 or {no_value} for "
                           "no top-k filter")
    if not 0 < top_p <= 1:  # NaN too; 0 would keep no token
        raise InvalidValue(f"{option_prefix}top_p {top_p:g}: expected a probability in (0, 1]: the share of the probability "
                           "that the tokens sampled among hold (1: every token)")


def context_limit(config: Config) -> Optional[int]:
    """The most positions a model with softmax attention (a transformer, or a hybrid's attention layers) reads: the
    max_seq_length it was trained at, past which its rotary positions were never trained and its output is noise
    (LitGPT refuses them too). None for linear attention, which carries a state of one size whatever the length."""
    if config.block_type != "transformer" and not config.attn_layers:
        return None
    return config.max_seq_length


def limited_by(config: Config) -> str:
    """What was trained at the `context_limit` of `config`, as a line names it ("... that {limited_by} trained at")."""
    return "this transformer was" if config.block_type == "transformer" else "this hybrid's softmax-attention layers were"


def check_context_length(config: Config, prompt_length: int, max_new_tokens: int, option_prefix: str = "") -> None:
    """Refuse a prompt and new tokens longer than the `context_limit` of a model with softmax attention; linear
    attention has none. `option_prefix` as for `check_generation_args`; from the command line, the prompt's length
    counts the end-of-text token put before it."""
    limit, total = context_limit(config), prompt_length + max_new_tokens
    if limit is None or max_new_tokens == 0 or total <= limit:  # no new token, no position past the prompt's read
        return
    what = limited_by(config)
    counted = " (the end-of-text token before it included)" if option_prefix else ""
    head = (f"{option_prefix}max_new_tokens {max_new_tokens}: a prompt of {prompt_length} tokens{counted} and {max_new_tokens} "
            f"new ones are {total} positions, past the max_seq_length of {limit} that {what} trained at")
    if prompt_length < limit:
        raise InvalidValue(f"{head}: give {option_prefix}max_new_tokens {limit - prompt_length} or less, or a shorter prompt")
    raise InvalidValue(f"{head}: give a prompt shorter than {limit} tokens")


# The escapes of a --stop string that a shell leaves as typed (bash's "\n" is a backslash and an n)
STOP_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def stop_string(typed: str) -> str:
    """--stop as the user meant it: \\n a new line, \\t a tab, \\r a carriage return, \\\\ a backslash; a backslash
    before any other character is itself."""
    return re.sub(r"\\([ntr\\])", lambda m: STOP_ESCAPES[m.group(1)], typed)


def stop_strings(stop: Union[str, List[str]]) -> List[str]:
    """--stop as the list of stop strings it gives: one string (none where empty), or a list of them in brackets, each
    as `stop_string` reads it. A value in brackets that YAML does not read as a list of strings (`[Q:, A:]`, an item
    with a colon and a space; `[3]`, a number) reaches here as text, and is refused with how to quote its items."""
    if isinstance(stop, str):
        text = stop.strip()
        if text.startswith("[") and text.endswith("]"):
            quoted = ", ".join(json.dumps(item.strip()) for item in text[1:-1].split(","))
            raise InvalidValue(f"--stop {stop} is in brackets, as a list of stop strings is, but YAML does not read it as "
                               f"a list of strings: quote its items, --stop '[{quoted}]', or, to stop at the text "
                               f"{text} itself, --stop '[{json.dumps(text)}]'")
        return [stop_string(stop)] if stop else []
    if not all(isinstance(item, str) and item for item in stop):
        raise InvalidValue(f"--stop {stop}: expected a list of stop strings, none of them empty")
    return [stop_string(item) for item in stop]


class StopString:
    """Generated text as it may be printed, up to the first occurrence of any of the strings `stops`, which is left
    out: text that may begin one of them is held back until the next text tells (or the generation ends, `rest`)."""

    def __init__(self, stops: List[str]):
        self.stops, self.held, self.found = stops, "", False

    def add(self, new: str) -> str:
        """What of the generated text so far can be printed now, besides what was; "" once `found`."""
        if self.found:
            return ""
        text = self.held + new
        at = min((i for i in (text.find(stop) for stop in self.stops) if i >= 0), default=-1)
        if at >= 0:
            self.found, self.held = True, ""
            return text[:at]
        # the longest end of the text that a stop string begins with waits (no earlier end of the text can begin one:
        # it would have waited, being longer)
        held = max(next((k for k in range(min(len(text), len(stop) - 1), 0, -1) if stop.startswith(text[-k:])), 0)
                   for stop in self.stops)
        self.held = text[len(text) - held:] if held else ""
        return text[:len(text) - held]

    def rest(self) -> str:
        """The text held back, once nothing follows it."""
        rest, self.held = self.held, ""
        return rest


def read_prompt_file(path: Path) -> str:
    """The prompt in the file `path` (`-`: standard input): UTF-8 text (a byte order mark at its start left out), less
    the one line end at its end that an editor adds to a file it saves. An empty file is an empty prompt, as an empty
    --prompt is."""
    from fabric_lin.data.raw_files import OTHER_UNICODE_MARKS
    from fabric_lin.errors import MissingFile

    if str(path) == "-":
        data, named = sys.stdin.buffer.read(), "- (standard input)"
    else:
        named = str(path)
        if not path.exists():
            raise MissingFile(f"--prompt_file {path} does not exist: expected a text file holding the prompt")
        if not path.is_file():
            raise InvalidValue(f"--prompt_file {path} is a directory: expected a text file holding the prompt")
        data = path.read_bytes()
    for mark, encoding in OTHER_UNICODE_MARKS:
        if data.startswith(mark):
            raise InvalidValue(f"--prompt_file {named} is {encoding} text (it starts with {encoding}'s byte order mark), "
                               f"expected UTF-8: convert it first, e.g. iconv -f {encoding} -t UTF-8")
    if b"\0" in data:  # no text file holds one: weights, a tokenizer, a compressed file given by mistake
        raise InvalidValue(f"--prompt_file {named} is not a text file (it holds a NUL byte at byte {data.index(0)}): "
                           f"expected a UTF-8 text file holding the prompt")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise InvalidValue(f"--prompt_file {named} is not UTF-8 text: byte 0x{data[e.start]:02x} at byte {e.start} (a "
                           f"file in another encoding, e.g. Latin-1?); save it as UTF-8") from None
    return text.removesuffix("\n").removesuffix("\r")


def check_prompt(prompt: str) -> None:
    """Refuse a prompt that is not text: a byte of another encoding than the terminal's reaches Python as a surrogate
    (0xDC80 + the byte), which the tokenizer cannot encode."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(prompt[e.start])
        what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"character U+{code:04X}"
        raise InvalidValue(f"--prompt is not UTF-8 text: {what} at character {e.start} (a terminal or script in another "
                           "encoding, e.g. Latin-1?); give the prompt as UTF-8") from None


def load_model(checkpoint_dir: Path, device: torch.device, dtype: torch.dtype) -> GPT:
    """The model of a model directory, a training checkpoint or an fla export, in `dtype` on `device`, for decoding."""
    from fabric_lin.checkpoint_kinds import load_checkpoint

    return decoding_model(load_checkpoint(checkpoint_dir, "generate"), device, dtype)


def decoding_model(checkpoint, device: torch.device, dtype: torch.dtype) -> GPT:
    """The model of `checkpoint` (a `fabric_lin.checkpoint_kinds.Checkpoint`) in `dtype` on `device`, in eval mode: the
    fused kernels on CUDA, their PyTorch references elsewhere."""
    with torch.device("meta"):
        model = GPT(checkpoint.config, fused=device.type == "cuda")
    model.load_state_dict(checkpoint.state_dict, assign=True)
    return model.to(device=device, dtype=dtype).eval()


DEFAULT_PROMPT = "The capital of France"


def main(
    checkpoint_dir: Path,
    prompt: str = DEFAULT_PROMPT,
    prompt_file: Optional[Path] = None,
    max_new_tokens: int = 50,
    stop: Union[str, List[str]] = "",
    temperature: float = 0.8,
    top_k: Optional[int] = 50,
    top_p: float = 1.0,
    seed: int = 1234,
    device: Optional[str] = None,
    precision: Optional[str] = None,
) -> str:
    """Generate text from a model directory, a training checkpoint or an fla export, with its tokenizer files.

    Args:
        checkpoint_dir: a training checkpoint (out_dir/step-XXXXXXXX or out_dir/final, sharded or not), a model
            directory (convert_pretrained_checkpoint's output) or an fla export (convert_to_hf's output), as
            `fabric-lin evaluate` reads them.
        prompt: the text to continue. An empty prompt (or one the tokenizer makes no token of, such as spaces where
            it drops them) samples a document from its start: the model continues the end-of-text token alone, which
            comes before every prompt; a line on stderr says so.
        prompt_file: a UTF-8 text file whose text is the prompt, in place of --prompt (for long or many-line prompts);
            one line end at its end, which editors add, is left out. `-` reads standard input. An empty file is an
            empty prompt.
        max_new_tokens: how many tokens to sample at most (stops early at the end-of-text token).
        stop: stop once the generated text (not the prompt) contains this string, or any string of a list of them
            (--stop '[a, b]', quoted items where one holds a colon, a comma or brackets: '["Q:", "[END]"]'); the text
            printed ends before it, as OpenAI-style APIs and vLLM leave their stop sequences out. \\n in it is a new
            line, \\t a tab, \\r a carriage return and \\\\ a backslash, so --stop '\\n' stops at the end of a line.
        temperature: 0 for greedy decoding; higher is more random (a finite number).
        top_k: sample only among the k most likely tokens; 0 or null: no top-k filter (all tokens).
        top_p: then only among the fewest most likely tokens whose probability adds up to top_p (nucleus sampling,
            0 < top_p <= 1); 1: no filter.
        seed: random seed for sampling.
        device: "cpu", "cuda", ...; default: cuda if available.
        precision: "32-true", "bf16-true" or "16-true"; default bf16-true on CUDA, 32-true on CPU.
    """
    from fabric_lin.checkpoint_kinds import check_checkpoint_dir, find_checkpoint

    checkpoint_dir = Path(checkpoint_dir)
    check_checkpoint_dir(checkpoint_dir)
    device = resolve_device(device)
    precision = precision or ("bf16-true" if device.type == "cuda" else "32-true")
    dtypes = {"32-true": torch.float32, "bf16-true": torch.bfloat16, "16-true": torch.float16}
    if precision not in dtypes:
        raise InvalidValue(f"--precision {precision}: expected one of {', '.join(sorted(dtypes))}")
    check_generation_args(max_new_tokens, temperature, top_k, option_prefix="--", top_p=top_p)  # before loading the model, minutes for a large one
    if not -(2**63) <= seed < 2**64:  # torch.Generator's seeds are 64-bit (a negative one is taken as its two's complement)
        raise InvalidValue(f"--seed {seed}: expected a 64-bit seed, 0 to {2**64 - 1}")
    if prompt_file is not None:
        if prompt != DEFAULT_PROMPT:
            raise InvalidValue("--prompt and --prompt_file both give the prompt: give one of them")
        prompt = read_prompt_file(Path(prompt_file))
    check_prompt(prompt)
    stops = stop_strings(stop)

    # the config and the tokenizer, and what they refuse, before the weights are read (minutes for a large model)
    found = find_checkpoint(checkpoint_dir, "generate", tokenizer_for="generate reads and writes text")
    tokenizer, config = found.tokenizer, found.config
    tokenizer.check_fits(config.vocab_size, checkpoint_dir)
    # Pretraining data is documents joined by end-of-text tokens (no BOS), so a prompt that starts a
    # document is one that follows an end-of-text token.
    prompt_tokens = tokenizer.encode(prompt).to(device=device, dtype=torch.long)
    prompt_ids = prompt_tokens
    if tokenizer.eos_id is not None:
        prompt_ids = torch.cat([prompt_tokens.new_tensor([tokenizer.eos_id]), prompt_tokens])
    if len(prompt_tokens) == 0:
        given = f"--prompt_file {prompt_file}" if prompt_file is not None else f"--prompt {prompt!r}"
        no_token = "is empty" if not prompt else "gives the tokenizer no token"
        if len(prompt_ids) == 0:
            raise InvalidValue(f"{given} {no_token}, and the tokenizer has no end-of-text token to start a document "
                               f"after ({tokenizer.describe()}): expected a prompt of at least one token")
        # given on purpose or by mistake, an empty prompt is said to be one
        print(f"({given} {no_token}: the model samples a document from its start)", file=sys.stderr, flush=True)
    check_context_length(config, len(prompt_ids), max_new_tokens, option_prefix="--")
    model = decoding_model(found.read(), device, dtypes[precision])
    generator = torch.Generator().manual_seed(seed)
    tokens = stream_tokens(
        model, prompt_ids, max_new_tokens, temperature, top_k, tokenizer.eos_id, generator, vocab_size=tokenizer.vocab_size,
        top_p=top_p,
    )
    # printed as it is sampled; after a Ctrl-C what was printed stays (fabric_lin.cli then exits with 130)
    text = GrowingText(tokenizer, prompt_tokens.tolist())
    printed = text.text
    print(printed, end="", flush=True)
    until = StopString(stops) if stops else None
    count, start, failed = 0, time.perf_counter(), False
    try:
        for token in tokens:
            count += 1
            new = text.add(token)
            new = until.add(new) if until is not None else new
            printed += new
            print(new, end="", flush=True)
            if until is not None and until.found:
                break
    except UserError:  # its one line, the last, says what went wrong
        failed = True
        raise
    finally:
        if until is not None:  # held back as the start of the stop string, which did not follow
            rest = until.rest()
            printed += rest
            print(rest, end="")
        elapsed = time.perf_counter() - start
        print(flush=True)
        if not failed:
            print(f"{count} tokens in {elapsed:.2f} s ({count / max(elapsed, 1e-9):.1f} tokens/s)", file=sys.stderr,
                  flush=True)
    return printed


def resolve_device(device: Optional[str]) -> torch.device:
    """--device as a torch.device (default: cuda if there is a GPU), refused in one line where it cannot run."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise InvalidValue(f"--device {device!r}: expected cpu, cuda or cuda:<index>") from None
    if resolved.type not in ("cpu", "cuda"):
        # an accelerator this PyTorch can use (mps on a Mac) runs the PyTorch path; any other device type that torch
        # parses (meta, or mps where there is none) would fail inside torch once the model is loaded
        accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
        if accelerator is None or not accelerator.is_available() or accelerator.current_accelerator().type != resolved.type:
            raise InvalidValue(f"--device {device}: this PyTorch has no {resolved.type} device to run on here; expected cpu, "
                               f"cuda or cuda:<index>")
    if resolved.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise InvalidValue(f"--device {device}: this machine has no CUDA GPU that PyTorch can use; give --device cpu")
        if resolved.index is not None and resolved.index >= count:
            raise InvalidValue(f"--device {device}: this machine has {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}")
    return resolved
