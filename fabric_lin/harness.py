"""lm-evaluation-harness in `fabric-lin evaluate --tasks`: the task names found (`find_tasks`), the tasks built with
their datasets and each one's few-shot examples counted (`load_tasks`), both before the model is loaded, then run on
the model in memory (`run_tasks`, through `HarnessScorer`: what the harness asks of a model). The harness itself is the
optional extra (`pip install -e '.[eval]'`), imported only here, and only when tasks are asked for."""
import difflib
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from fabric_lin.errors import InvalidValue, MissingFile, MissingPackage

LOGIT_ROWS = 4096  # logits computed this many tokens at a time: [rows, vocab] in fp32 at most, never [B, T, vocab]


def is_task_file(name: str) -> bool:
    """Whether a --tasks entry names a task YAML file rather than a task, group or tag of the harness."""
    return name.endswith((".yaml", ".yml"))


class HarnessScorer:
    """What lm-evaluation-harness asks of a model (`lm_eval.api.model.LM`), on the model in memory; the text in
    and out of the harness's requests, the tokens in between through the checkpoint's tokenizer.

    Every sequence starts with the end-of-text token: the training data is documents joined by it (no BOS), so a
    text that starts a document follows one. Linear attention has no context limit (a state of one size), so nothing
    is truncated: a continuation is scored after its whole context, and a document's rolling log-likelihood scores
    every token once, after every token before it, `block_size` tokens per forward pass with the recurrent state
    carried from one block to the next. A model with softmax attention reads no more positions than it was trained
    at (`context_limit`, `max_length`), and its requests are cut as the harness's own Hugging Face model cuts them: a
    context from the left, to `max_length` tokens with the continuation, or `max_length` less the tokens to generate;
    a document scored in windows of `max_length` tokens, each from a fresh cache, each token once, after the window's
    tokens before it. How many were cut is said once per kind of request, and kept in `cut`."""

    def __init__(self, fabric, model, tokenizer, batch_size: int = 1, block_size: int = 2048):
        from fabric_lin.generate import context_limit, limited_by

        if tokenizer.eos_id is None:
            raise InvalidValue(f"{tokenizer.model_path} defines no end-of-text token, which starts every request's tokens")
        self.fabric, self.model, self.tokenizer = fabric, model, tokenizer
        self.batch_size, self.block_size = batch_size, block_size
        self.max_length = context_limit(model.config)
        # as lines name the limit: "the max_seq_length of 2048 that this transformer was trained at"
        self.limit_said = f"the max_seq_length of {self.max_length} that {limited_by(model.config)} trained at"
        self.cut: Dict[str, int] = {}  # requests cut to max_length, by the harness's name of their kind

    def say_cut(self, kind: str, cut: int, total: int, how: str) -> None:
        """Say (once per kind of request: the harness asks for all of a kind at once) how many of `total` requests were
        longer than `max_length`, and `how` they are read; keep the count for the results."""
        if not cut:
            return
        self.cut[kind] = self.cut.get(kind, 0) + cut
        print(f"lm-evaluation-harness: {cut} of {total} {kind} requests are longer than {self.limit_said}: {how}, as the "
              f"harness's own Hugging Face model reads them", flush=True)

    def encode(self, text: str) -> List[int]:
        return self.tokenizer.encode(text).tolist()

    def split(self, context: str, continuation: str) -> Tuple[List[int], List[int]]:
        """The tokens of context and of continuation. Spaces at the end of the context belong to the continuation
        (a SentencePiece word carries the space before it); the continuation is what the tokens of the whole text
        hold after those of the context, so that it is tokenized as it would be in running text."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        context_ids = self.encode(context) if context else []
        whole = self.encode(context + continuation)
        return whole[: len(context_ids)], whole[len(context_ids):]

    @torch.no_grad()
    def loglikelihood(self, requests: Sequence[Tuple[str, str]]) -> List[Tuple[float, bool]]:
        """(log-probability of the continuation given the context, whether greedy decoding gives it) per
        (context, continuation). Batches of `batch_size` requests of similar length, padded at the end (the
        model is causal: padding after a sequence does not change it)."""
        from tqdm import tqdm

        eos, limit = self.tokenizer.eos_id, self.max_length
        sequences = []  # (tokens, number of continuation tokens at their end)
        cut = 0
        for context, continuation in requests:
            context_ids, continuation_ids = self.split(context, continuation)
            tokens = [eos] + context_ids + continuation_ids
            if limit is not None and len(tokens) - 1 > limit:  # the last token is a target alone, read at no position
                if len(continuation_ids) > limit:
                    raise InvalidValue(f"lm-evaluation-harness asks for the log-likelihood of a continuation of "
                                       f"{len(continuation_ids)} tokens, longer than {self.limit_said}: no context can "
                                       f"be cut to fit it")
                tokens, cut = tokens[-(limit + 1):], cut + 1
            sequences.append((tokens, len(continuation_ids)))
        self.say_cut("loglikelihood", cut, len(requests), "their contexts are cut from the left to fit")
        answers: List[Tuple[float, bool]] = [(0.0, True)] * len(sequences)
        order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i][0]))
        with tqdm(desc="loglikelihood", total=sum(len(s) for s, _ in sequences), unit="tok", unit_scale=True,
                  dynamic_ncols=True) as progress:
            for first in range(0, len(order), self.batch_size):
                chosen = order[first : first + self.batch_size]
                # the inputs: each sequence but its last token, which is predicted and read at no position
                longest = len(sequences[chosen[0]][0])
                ids = torch.full((len(chosen), max(longest - 1, 1)), eos, dtype=torch.long)
                rows, positions, targets = [], [], []
                for row, i in enumerate(chosen):
                    tokens, n = sequences[i]
                    ids[row, : len(tokens) - 1] = torch.tensor(tokens[:-1])
                    # the continuation's tokens are predicted at the positions before them
                    rows += [row] * n
                    positions += range(len(tokens) - n - 1, len(tokens) - 1)
                    targets += tokens[len(tokens) - n:]
                ids = ids.to(self.fabric.device)
                with self.fabric.autocast():
                    hidden = self.model(ids, return_hidden=True)
                    logprobs, greedy = self.target_logprobs(hidden[rows, positions],
                                                            torch.tensor(targets, dtype=torch.long, device=ids.device))
                logprobs, greedy = logprobs.tolist(), greedy.tolist()
                taken = 0
                for i in chosen:
                    n = sequences[i][1]
                    answers[i] = (float(sum(logprobs[taken : taken + n])), all(greedy[taken : taken + n]))
                    taken += n
                progress.update(sum(len(sequences[i][0]) for i in chosen))
        return answers

    @torch.no_grad()
    def loglikelihood_rolling(self, texts: Sequence[str]) -> List[float]:
        """The log-probability of each whole text, every token scored once after all of the text before it, or, past
        `max_length`, after the tokens of its window before it (`rolling_windows`)."""
        from tqdm import tqdm

        eos = self.tokenizer.eos_id
        documents = [[eos] + self.encode(text) for text in texts]
        if self.max_length is not None:
            self.say_cut("loglikelihood_rolling", sum(len(d) - 1 > self.max_length for d in documents), len(documents),
                         f"they are scored in windows of {self.max_length} tokens, each token once, after the tokens "
                         f"of its window before it")
        answers = []
        with tqdm(desc="loglikelihood_rolling", total=sum(len(d) - 1 for d in documents), unit="tok", unit_scale=True,
                  dynamic_ncols=True) as progress:
            for tokens in documents:
                ids = torch.tensor(tokens, device=self.fabric.device)
                # linear attention: the state carried from one block to the next; softmax attention: each window afresh
                cache = self.model.new_cache() if self.max_length is None else None
                total = 0.0
                for start, end, first in self.rolling_windows(len(tokens) - 1):
                    with self.fabric.autocast():
                        hidden = self.model(ids[None, start:end], cache=cache, return_hidden=True)[0]
                        logprobs, _ = self.target_logprobs(hidden[first - start:], ids[first + 1 : end + 1])
                    total += float(logprobs.double().sum())
                    progress.update(end - first)
                answers.append(total)
        return answers

    def rolling_windows(self, n: int) -> Iterator[Tuple[int, int, int]]:
        """The forward passes that score the `n` tokens of a document after its first (the end-of-text token): each
        (start, end, first) reads the tokens start:end and scores the targets first + 1 to end, each once. Without
        `max_length`, blocks of `block_size` tokens one after the other (the state carried from one to the next); with
        it, windows of `max_length` positions whose targets are the `max_length` past the last window's (the harness's
        rolling windows with a context of 1, `lm_eval.utils.get_rolling_token_windows`): the first window reads from
        the document's start, the others end `max_length` targets apart, and the last reads back `max_length` tokens."""
        step = self.block_size if self.max_length is None else self.max_length
        for first in range(0, n, step):
            end = min(first + step, n)
            yield (first if self.max_length is None else max(0, end - self.max_length)), end, first

    def target_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """log p(target) (fp32) and whether the target is the most likely token, for hidden states [N, d]."""
        logprobs, greedy = [], []
        for start in range(0, hidden.shape[0], LOGIT_ROWS):
            logits = F.linear(hidden[start : start + LOGIT_ROWS], self.model.output_weight).float()
            part = targets[start : start + LOGIT_ROWS]
            logprobs.append(torch.log_softmax(logits, dim=-1).gather(1, part[:, None])[:, 0])
            greedy.append(logits.argmax(dim=-1) == part)
        if not logprobs:
            return hidden.new_zeros(0, dtype=torch.float32), torch.zeros(0, dtype=torch.bool, device=hidden.device)
        return torch.cat(logprobs), torch.cat(greedy)

    @torch.no_grad()
    def generate_until(self, requests: Sequence[Tuple[str, dict]]) -> List[str]:
        """The text generated after each context, up to the first of its `until` strings (left out), the
        end-of-text token or `max_gen_toks` tokens (default 256); greedy unless do_sample with a temperature, then
        within the request's top_k and top_p where it gives them (as Hugging Face's `generate` reads them)."""
        from tqdm import tqdm

        from fabric_lin.generate import GrowingText, stream_tokens

        eos, limit = self.tokenizer.eos_id, self.max_length
        prompts = []  # (the prompt's tokens, those of the context it holds, the request's options)
        cut = 0
        for context, options in requests:
            options = dict(options or {})
            context_ids = self.encode(context)
            prompt = [eos] + context_ids
            if limit is not None:  # room for the context and for max_gen_toks new tokens
                room = limit - int(options.get("max_gen_toks", 256))
                if room < 1:
                    raise InvalidValue(f"lm-evaluation-harness asks for up to {limit - room} generated tokens (a task's "
                                       f"max_gen_toks), and the model reads no more than {self.limit_said}: no room is "
                                       f"left for a context before them")
                if len(prompt) > room:
                    context_ids = prompt = context_ids[-room:]
                    cut += 1
            prompts.append((prompt, context_ids, options))
        self.say_cut("generate_until", cut, len(requests),
                     "their contexts are cut from the left to leave room for the tokens to generate (max_gen_toks)")
        answers = []
        generator = torch.Generator().manual_seed(1234)
        with tqdm(prompts, desc="generate_until", dynamic_ncols=True) as progress:
            for prompt, context_ids, options in progress:
                until = options.get("until") or []
                until = [until] if isinstance(until, str) else list(until)
                max_new_tokens = int(options.get("max_gen_toks", 256))
                temperature = float(options.get("temperature", 0.0)) if options.get("do_sample") else 0.0
                top_p = float(options["top_p"]) if options.get("do_sample") and options.get("top_p") is not None else 1.0
                text = GrowingText(self.tokenizer, context_ids)
                generated = ""
                prompt = torch.tensor(prompt, device=self.fabric.device)
                with self.fabric.autocast():
                    for token in stream_tokens(self.model, prompt, max_new_tokens, temperature, options.get("top_k"), eos,
                                               generator, vocab_size=self.tokenizer.vocab_size, top_p=top_p):
                        if int(token) == eos:
                            break
                        generated += text.add(token)
                        stops = [generated.find(s) for s in until if s and s in generated]
                        if stops:
                            generated = generated[: min(stops)]
                            break
                answers.append(generated)
        return answers


def harness_model(scorer: HarnessScorer):
    """`scorer` as an `lm_eval.api.model.LM`, which the harness's `simple_evaluate` takes in place of a model name."""
    from lm_eval.api.model import LM

    class FabricLinLM(LM):
        def loglikelihood(self, requests, disable_tqdm: bool = False):
            return scorer.loglikelihood([request.args for request in requests])

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            return scorer.loglikelihood_rolling([request.args[0] for request in requests])

        def generate_until(self, requests, disable_tqdm: bool = False):
            return scorer.generate_until([request.args for request in requests])

    return FabricLinLM()


def find_tasks(names: List[str], task_dir: Optional[Path]):
    """The harness's TaskManager that knows every name of `names` (a task, group or tag, or a task YAML file),
    or an error naming those it does not know. The built-in tasks (thousands of YAML files, seconds to index)
    are left out when `task_dir` and the YAML files given hold every task asked for."""
    try:
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise MissingPackage("--tasks needs lm-evaluation-harness: pip install -e '.[eval]' (or pip install lm-eval)") from None
    if task_dir is not None and not Path(task_dir).is_dir():
        raise MissingFile(f"--task_dir {task_dir} is not a directory (expected task YAML files)")
    for name in names:  # no harness task is named so: the path of a file meant, before the harness indexes its tasks
        if is_task_file(name) and not Path(name).exists():
            raise MissingFile(f"--tasks {name}: no such task file (a task of your own: the path of its YAML file, or its "
                              f"name with --task_dir DIR)")

    def unknown(manager) -> List[str]:
        return [n for n in names if n not in manager.all_tasks and not (is_task_file(n) and Path(n).is_file())]

    if task_dir is not None:
        manager = TaskManager(include_path=str(task_dir), include_defaults=False)
        if not unknown(manager):
            return manager
    elif all(is_task_file(n) and Path(n).is_file() for n in names):
        return TaskManager(include_defaults=False)
    manager = TaskManager(include_path=str(task_dir) if task_dir is not None else None)
    missing = unknown(manager)
    folders = [name for name in missing if Path(name).is_dir()]  # a harness task of the same name was taken above
    if folders:
        raise InvalidValue(f"--tasks {folders[0]} is a directory, not a task: give it as --task_dir {folders[0]} and name "
                           f"the tasks of its YAML files in --tasks")
    if missing:
        close = difflib.get_close_matches(missing[0], manager.all_tasks, n=3, cutoff=0.6)
        raise InvalidValue(
            f"--tasks: lm-evaluation-harness has no task, group or tag named {', '.join(map(repr, missing))}"
            + (f" (did you mean {', '.join(close)}?)" if close else "")
            + "; `lm-eval ls tasks` lists them; a task of your own: the path of its YAML file, or --task_dir DIR"
        )
    return manager


def run_tasks(scorer: HarnessScorer, names: List[str], task_manager, num_fewshot: Optional[int],
              limit: Optional[float]) -> Dict[str, Any]:
    """The harness's results of `names` (its `simple_evaluate`, on the model in memory), with the count of requests cut
    to the model's max_seq_length where any were (`requests_cut`), and its table printed."""
    import contextlib
    from unittest import mock

    import lm_eval
    import lm_eval.evaluator
    from lm_eval.utils import make_table

    # simple_evaluate records the git commit of the working directory (its results' git_hash, not kept here) by running
    # `git describe`, whose stderr is this command's: "fatal: not a git repository" in a successful evaluation, wherever
    # the working directory is in none
    no_git = (mock.patch.object(lm_eval.evaluator, "get_git_commit_hash", lambda: None)
              if hasattr(lm_eval.evaluator, "get_git_commit_hash") else contextlib.nullcontext())
    with no_git:
        output = lm_eval.simple_evaluate(
            model=harness_model(scorer), tasks=names, task_manager=task_manager, num_fewshot=num_fewshot, limit=limit,
            log_samples=False,
        )
    print(make_table(output))
    from importlib.metadata import version

    kept = ("results", "groups", "group_subtasks", "versions", "n-shot", "n-samples", "higher_is_better")
    # requests cut to the model's max_seq_length: how many of each kind, since the scores are those of the parts read
    cut = {"requests_cut": {"max_length": scorer.max_length, **scorer.cut}} if scorer.cut else {}
    return {"lm_eval_version": version("lm_eval"), **{key: output[key] for key in kept if key in output},
            **({"limit": limit} if limit is not None else {}), **cut}


def load_tasks(manager, names: List[str], num_fewshot: Optional[int]) -> "LoadedTasks":
    """The tasks of `names` built by the harness from `manager` (`find_tasks`'s): their datasets read (downloaded once,
    then from the harness's cache) and their few-shot examples counted, before the minutes of loading a model. A task
    that would be asked for more few-shot examples than it has is refused here, where the harness itself would fail
    on it only once it builds the task's first request, after the model is loaded and the data evaluated. A dataset
    that cannot be read (the hub out of reach, a data file of a task of one's own missing) and a template that its
    documents cannot fill (the harness fills each with the first document as it builds the task) are one line too."""
    from jinja2 import TemplateError

    listed = ",".join(names)
    try:
        loaded = manager.load(names)
    except OSError as error:  # the datasets library's ConnectionError or FileNotFoundError
        raise InvalidValue(
            f"--tasks {listed}: lm-evaluation-harness could not read a task's dataset: {' '.join(str(error).split())} "
            f"(a built-in task downloads its dataset from the Hugging Face hub once, then reads it from the cache, also "
            f"with HF_DATASETS_OFFLINE=1; a task of your own reads the files its YAML names)"
        ) from None
    except TemplateError as error:  # jinja2's, as the harness fills a template: a typo in a task of one's own
        raise InvalidValue(
            f"--tasks {listed}: a task's template cannot be filled from its documents: {' '.join(str(error).split())} (its "
            f"doc_to_text, doc_to_target or doc_to_choice names what the documents of its dataset do not hold)"
        ) from None
    for task in loaded["tasks"].values():
        shortfall = few_shot_shortfall(task, num_fewshot)
        if shortfall is not None:
            raise InvalidValue(shortfall)
    return LoadedTasks(manager, names, loaded)


class LoadedTasks:
    """The harness's TaskManager with the tasks of this evaluation built already (`load_tasks`): simple_evaluate's load
    of them returns those, their datasets read once; anything else is the manager's own."""

    def __init__(self, manager, names: List[str], loaded: Dict[str, Any]):
        self.manager, self.names, self.loaded = manager, list(names), loaded

    def load(self, task_list):
        return self.loaded if task_list == self.names else self.manager.load(task_list)

    def __getattr__(self, name: str):
        return getattr(self.manager, name)


def few_shot_shortfall(task, num_fewshot: Optional[int]) -> Optional[str]:
    """Where the harness's task `task` (built) would be asked for more few-shot examples than it has (mmlu keeps 5 per
    subject), a line naming the task, the number asked for and the number it has; else None. Asked for: --num_fewshot
    (`num_fewshot`) where given, but by a task whose own num_fewshot is 0, which the harness keeps; else its own. Where
    the examples come from the split the task is evaluated on, the harness leaves the document asked about out of them:
    one fewer."""
    own, name = task.config.num_fewshot, task.config.task
    asked = own if num_fewshot is None or own == 0 else num_fewshot
    if not asked:
        return None
    sampler, fewshot_config = getattr(task, "sampler", None), getattr(task, "fewshot_cfg", None)
    examples = len(sampler.fewshot_docs()) if sampler is not None else 0
    if sampler is not None and fewshot_config is not None and fewshot_config.split == task.config.test_split:
        examples -= 1
    if asked <= examples:
        return None
    shortfall = (f"--num_fewshot {num_fewshot}: task {name} has {examples} few-shot examples" if num_fewshot is not None
                 else f"task {name} asks for {asked} few-shot examples (its num_fewshot) and has {examples}")
    return f"{shortfall}: " + (f"give --num_fewshot {examples} or fewer" if examples else "give --num_fewshot 0")
