"""`fabric-lin evaluate --tasks`: the harness adapter's log-likelihoods equal log-softmax sums of a full forward
pass (all three families, the rolling one across blocks of carried state), greedy only where every continuation token
is the most likely, and its generation stops at the first stop string and samples where asked; three local tasks run
by lm-evaluation-harness itself, against the model's own log-probabilities; too few few-shot examples, unknown or
empty task names, a task file that is not there, a dataset that cannot be read or a template its documents cannot fill,
weights without their tokenizer, --limit and the harness's options without --tasks are one line, the names checked
before the model is read; the data's results are kept, marked partial, where the harness fails or is interrupted;
lm-eval's and LitGPT's names of evaluate's options point to them. The lm-evaluation-harness run itself needs the
optional extra (`pip install -e '.[eval]'`) and is skipped without it."""
import json
import os
import subprocess
import sys
from pathlib import Path

import lightning_fabric as L
import numpy as np
import pytest
import torch

from conftest import TRAIN_LEN, final_weights, text_lines, train_evaluate_run
from fabric_lin.config import Config
from fabric_lin.errors import InvalidValue
from fabric_lin.evaluate import HarnessScorer, main as evaluate
from fabric_lin.model import GPT
from helpers import cli_error


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """conftest's train_evaluate_run, once for this module (a module-scoped fixture keeps the module's tests on one
    pytest-xdist worker: conftest's pytest_xdist_make_scheduler)."""
    return train_evaluate_run(tmp_path_factory.mktemp("evaluate"))


# ---------------------------------------------------------------- the harness adapter, without the harness


def scorer_for(model: GPT, tokenizer, batch_size: int, block_size: int) -> HarnessScorer:
    fabric = L.Fabric(accelerator="cpu", devices=1, precision="32-true")
    return HarnessScorer(fabric, fabric.setup_module(model), tokenizer, batch_size, block_size)


def full_logprobs(model: GPT, tokens: list) -> torch.Tensor:
    """log p(tokens[t] | tokens[:t]) for t >= 1, from one forward pass over the whole sequence."""
    ids = torch.tensor(tokens)[None]
    with torch.no_grad():
        logits = model(ids[:, :-1])[0].double()
    return torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None])[:, 0]


@pytest.fixture(scope="module", params=["gla-debug", "gdn-debug", "transformer-debug"])
def family_model(request):
    torch.manual_seed(0)
    return GPT(Config.from_name(request.param)).eval()


def test_harness_loglikelihood_equals_a_full_forward_log_softmax(run, family_model):
    """Requests of several lengths in padded batches; an empty context (the end-of-text token alone before the
    continuation) and a context ending in spaces (moved to the continuation)."""
    from fabric_lin.data import Tokenizer

    tokenizer = Tokenizer(run / "tok")
    lines = text_lines(7, 5)
    requests = [(lines[0], " " + lines[1]), ("", lines[2]), (lines[3] + "  ", lines[4]), (lines[5] * 3, " next"),
                ("the", " model")]
    got = scorer_for(family_model, tokenizer, batch_size=2, block_size=TRAIN_LEN).loglikelihood(requests)
    eos = tokenizer.eos_id
    for (context, continuation), (logprob, greedy) in zip(requests, got):
        stripped = context.rstrip()
        whole = tokenizer.encode(context + continuation).tolist()
        n = len(whole) - len(tokenizer.encode(stripped).tolist() if stripped else [])
        assert n > 0
        expected = full_logprobs(family_model, [eos] + whole)[-n:]
        assert logprob == pytest.approx(expected.sum().item(), abs=1e-4)
        with torch.no_grad():
            logits = family_model(torch.tensor([eos] + whole)[None, :-1])[0, -n:]
        assert greedy == bool((logits.argmax(-1) == torch.tensor(whole[-n:])).all())


def test_harness_greedy_means_every_continuation_token_is_the_most_likely(run, family_model):
    """A continuation of the model's most likely token and then a token that is not (the tokens given as such): not
    greedy; its first token alone is."""
    from fabric_lin.data import Tokenizer

    tokenizer = Tokenizer(run / "tok")
    context = tokenizer.encode("the model").tolist()
    with torch.no_grad():
        likely = int(family_model(torch.tensor([tokenizer.eos_id] + context)[None])[0, -1].argmax())
        after = int(family_model(torch.tensor([tokenizer.eos_id] + context + [likely])[None])[0, -1].argmax())
    unlikely = (after + 1) % tokenizer.vocab_size
    scorer = scorer_for(family_model, tokenizer, batch_size=2, block_size=TRAIN_LEN)
    continuations = {"both": [likely, unlikely], "first": [likely]}
    scorer.split = lambda context_text, continuation_text: (context, continuations[continuation_text])
    assert [greedy for _, greedy in scorer.loglikelihood([("the model", "both"), ("the model", "first")])] == [False, True]


def test_harness_rolling_loglikelihood_carries_the_state_across_blocks(run, family_model):
    """Blocks of 8 tokens through the decoding cache against one forward pass over the whole document."""
    from fabric_lin.data import Tokenizer

    tokenizer = Tokenizer(run / "tok")
    texts = [" ".join(text_lines(6, 7)), "the", " ".join(text_lines(3, 8))]
    got = scorer_for(family_model, tokenizer, batch_size=1, block_size=8).loglikelihood_rolling(texts)
    for text, logprob in zip(texts, got):
        tokens = [tokenizer.eos_id] + tokenizer.encode(text).tolist()
        assert logprob == pytest.approx(full_logprobs(family_model, tokens).sum().item(), abs=1e-4)
    assert len(tokenizer.encode(texts[0])) > 3 * 8  # several blocks


def test_harness_generate_until_stops_at_the_first_stop_string(run):
    from fabric_lin.data import Tokenizer
    from fabric_lin.generate import generate_tokens

    tokenizer = Tokenizer(run / "tok")
    model = final_weights(run)
    context = "the model reads a line"
    prompt = torch.tensor([tokenizer.eos_id] + tokenizer.encode(context).tolist())
    greedy = generate_tokens(model, prompt, 12, temperature=0, eos_id=tokenizer.eos_id, vocab_size=tokenizer.vocab_size)
    full = tokenizer.decode(prompt[1:].tolist() + greedy.tolist())[len(context):]
    assert len(full.strip()) > 3
    stop = full.strip()[2:4]
    scorer = scorer_for(model, tokenizer, batch_size=1, block_size=TRAIN_LEN)
    got = scorer.generate_until([(context, {"until": [stop, "never there"], "max_gen_toks": 12}),
                                 (context, {"until": "never there", "max_gen_toks": 12})])
    assert got == [full[: full.index(stop)], full]
    # two stop strings that the same token completes: the text ends before the one that begins first
    ending = next(full[i: i + 3] for i in range(2, len(full) - 2) if full.find(full[i + 1: i + 3]) == i + 1)
    assert scorer.generate_until([(context, {"until": [ending[1:], ending], "max_gen_toks": 12})]) == [
        full[: full.index(ending)]]


def test_harness_generate_until_samples_where_asked(run):
    """do_sample with a temperature: the tokens sampled from the model's logits with the harness's seeded generator."""
    from fabric_lin.data import Tokenizer
    from fabric_lin.generate import generate_tokens

    tokenizer = Tokenizer(run / "tok")
    model = final_weights(run)
    context = "the model reads a line"
    prompt = torch.tensor([tokenizer.eos_id] + tokenizer.encode(context).tolist())
    text = {}
    for temperature in (0.0, 1.5):
        tokens = generate_tokens(model, prompt, 12, temperature=temperature, eos_id=tokenizer.eos_id,
                                 generator=torch.Generator().manual_seed(1234), vocab_size=tokenizer.vocab_size)
        text[temperature] = tokenizer.decode(prompt[1:].tolist() + tokens.tolist())[len(context):]
    assert text[1.5] != text[0.0]
    scorer = scorer_for(model, tokenizer, batch_size=1, block_size=TRAIN_LEN)
    options = {"until": "never there", "max_gen_toks": 12, "do_sample": True, "temperature": 1.5}
    assert scorer.generate_until([(context, options)]) == [text[1.5]]


# ---------------------------------------------------------------- lm-evaluation-harness itself (optional extra)


TASKS = {
    "tiny_choice": """
output_type: multiple_choice
doc_to_text: "{{context}}"
doc_to_choice: "{{choices}}"
doc_to_target: label
metric_list: [{metric: acc}]
""",
    "tiny_rolling": """
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{context}}"
metric_list: [{metric: bits_per_byte}]
""",
    "tiny_generate": """
output_type: generate_until
doc_to_text: "{{context}}"
doc_to_target: "{{choices[0]}}"
generation_kwargs: {until: ["\\n"], max_gen_toks: 6}
metric_list: [{metric: exact_match}]
""",
}


def write_tasks(tmp_path: Path, n_docs: int = 4) -> list:
    """TASKS as YAML files in tmp_path/tasks, over `n_docs` documents of tmp_path/docs.jsonl (a test split alone,
    which is also where the harness takes few-shot examples from); returns the documents."""
    lines = text_lines(n_docs + 4, 9)
    docs = [{"context": lines[i], "choices": [lines[i + 1], lines[i + 2]], "label": i % 2} for i in range(n_docs)]
    with open(tmp_path / "docs.jsonl", "w") as f:
        f.writelines(json.dumps(doc) + "\n" for doc in docs)
    (tmp_path / "tasks").mkdir()
    for name, body in TASKS.items():
        (tmp_path / "tasks" / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tmp_path / 'docs.jsonl'}\n"
            f"test_split: test\nmetadata: {{version: 1.0}}\n{body}"
        )
    return docs


def evaluate_in_subprocess(run: Path, tmp_path: Path, *options: str, checkpoint: Path = None) -> subprocess.CompletedProcess:
    """`fabric-lin evaluate` of the run's final checkpoint (or `checkpoint`) with the tasks of `write_tasks`, into
    tmp_path/out, offline, in tmp_path (a directory in no git repository)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_OFFLINE": "1",
           "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1])] + sys.path)}
    return subprocess.run(
        [sys.executable, "-m", "fabric_lin.cli", "evaluate", str(checkpoint or run / "out" / "final"), *options,
         "--task_dir", str(tmp_path / "tasks"), "--out_dir", str(tmp_path / "out")],
        capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path,
    )


@pytest.mark.slow
def test_harness_tasks_on_the_model_in_memory(run, tmp_path):
    """Three local tasks (multiple choice, rolling log-likelihood, generation) through `fabric-lin evaluate --tasks`,
    the results against the model's own log-probabilities."""
    pytest.importorskip("lm_eval")
    from fabric_lin.data import Tokenizer

    docs = write_tasks(tmp_path)
    proc = evaluate_in_subprocess(run, tmp_path, "--max_batches", "0", "--tasks", ",".join(TASKS))
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "out" / "evaluate.json").read_text())["tasks"]["results"]

    tokenizer = Tokenizer(run / "tok")
    model = final_weights(run)
    eos = tokenizer.eos_id
    correct = 0
    for doc in docs:  # the harness joins context and choice with a space (its target_delimiter)
        scores = []
        for choice in doc["choices"]:
            whole = tokenizer.encode(doc["context"] + " " + choice).tolist()
            n = len(whole) - len(tokenizer.encode(doc["context"]).tolist())
            scores.append(full_logprobs(model, [eos] + whole)[-n:].sum().item())
        correct += int(np.argmax(scores) == doc["label"])
    assert results["tiny_choice"]["acc,none"] == pytest.approx(correct / len(docs))
    logprob = sum(full_logprobs(model, [eos] + tokenizer.encode(doc["context"]).tolist()).sum().item() for doc in docs)
    n_bytes = sum(len(doc["context"].encode("utf-8")) for doc in docs)
    assert results["tiny_rolling"]["bits_per_byte,none"] == pytest.approx(-logprob / n_bytes / np.log(2), rel=1e-5)
    assert "exact_match,none" in results["tiny_generate"]
    # the harness's record of the working directory's git commit: `git describe` said it is in no repository
    assert "fatal: not a git repository" not in proc.stderr


@pytest.mark.slow
def test_harness_tasks_on_a_transformer_are_cut_to_its_max_seq_length(run, tmp_path):
    """A transformer trained at 16 positions (its model directory's max_seq_length) through the three local tasks, whose
    requests are longer: cut as the harness's own Hugging Face model cuts them (test_evaluate_truncation.py), said once
    per kind of request and counted in evaluate.json; the generation task ran past 16 positions, which generate
    refuses, and failed."""
    import shutil

    pytest.importorskip("lm_eval")
    from helpers import make_model_dir

    model = tmp_path / "model"
    make_model_dir(model, Config.from_name("transformer-debug", vocab_size=320, num_layers=2, max_seq_length=16))
    shutil.copy(run / "tok" / "tokenizer.model", model)  # the run's, whose 300 pieces are the words of text_lines
    write_tasks(tmp_path)
    words = text_lines(8, 3)
    with open(tmp_path / "docs.jsonl", "w") as f:  # contexts of some 30 tokens and choices of a word or two
        for i in range(4):
            doc = {"context": " ".join(words[2 * i : 2 * i + 3]), "choices": words[2 * i + 1].split()[:2], "label": 0}
            f.write(json.dumps(doc) + "\n")
    proc = evaluate_in_subprocess(run, tmp_path, "--max_batches", "0", "--tasks", ",".join(TASKS), checkpoint=model)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tasks = json.loads((tmp_path / "out" / "evaluate.json").read_text())["tasks"]
    cut = tasks["requests_cut"]
    assert cut.keys() == {"max_length", "loglikelihood", "loglikelihood_rolling", "generate_until"} and cut["max_length"] == 16
    for kind in ("loglikelihood", "loglikelihood_rolling", "generate_until"):
        said = [line for line in proc.stdout.splitlines() if line.startswith(f"lm-evaluation-harness: {cut[kind]} of ")
                and f" {kind} requests are longer than the max_seq_length of 16 that this transformer" in line]
        assert len(said) == 1 and cut[kind] > 0, proc.stdout[-3000:]
    assert set(tasks["results"]) == set(TASKS)


@pytest.mark.slow
def test_a_task_s_dataset_that_cannot_be_read_or_a_template_it_cannot_fill_is_one_line(run, tmp_path):
    """A task of one's own whose data file is not there, or whose template names a field its documents lack (a typo):
    the harness raised datasets' FileNotFoundError or jinja2's UndefinedError as it built the task, a traceback."""
    pytest.importorskip("lm_eval")
    write_tasks(tmp_path)
    tasks = tmp_path / "tasks"
    body = (tasks / "tiny_choice.yaml").read_text()
    (tasks / "tiny_gone.yaml").write_text(body.replace("tiny_choice", "tiny_gone").replace("docs.jsonl", "gone.jsonl"))
    (tasks / "tiny_typo.yaml").write_text(body.replace("tiny_choice", "tiny_typo").replace("{{context}}", "{{contxt}}"))
    proc = evaluate_in_subprocess(run, tmp_path, "--max_batches", "0", "--tasks", "tiny_gone")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1] == (
        f"fabric-lin evaluate: error: --tasks tiny_gone: lm-evaluation-harness could not read a task's dataset: Unable "
        f"to find '{tmp_path / 'gone.jsonl'}' (a built-in task downloads its dataset from the Hugging Face hub once, then "
        f"reads it from the cache, also with HF_DATASETS_OFFLINE=1; a task of your own reads the files its YAML names)")
    proc = evaluate_in_subprocess(run, tmp_path, "--max_batches", "0", "--tasks", "tiny_typo")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1] == (
        "fabric-lin evaluate: error: --tasks tiny_typo: a task's template cannot be filled from its documents: 'contxt' is "
        "undefined (its doc_to_text, doc_to_target or doc_to_choice names what the documents of its dataset do not hold)")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("raised, said", [
    (ConnectionError("Couldn't reach 'allenai/ai2_arc' on the Hub (LocalEntryNotFoundError)"),
     "lm-evaluation-harness could not read a task's dataset: Couldn't reach 'allenai/ai2_arc' on the Hub "
     "(LocalEntryNotFoundError) (a built-in task downloads its dataset from the Hugging Face hub once"),
    ("template", "a task's template cannot be filled from its documents: 'contxt' is undefined (its doc_to_text")])
def test_a_task_the_harness_cannot_build_is_one_line_before_the_model_is_loaded(tmp_path, capsys, monkeypatch, raised,
                                                                                  said):
    """Against a stand-in for the harness's TaskManager whose building of a task fails as the harness's does on a
    machine that cannot reach the hub (a compute node, offline), or on a template naming what the documents lack."""
    import types

    import jinja2

    import fabric_lin.evaluate

    def load(names):
        if raised == "template":
            jinja2.Environment(undefined=jinja2.StrictUndefined).from_string("{{contxt}}").render(context="a")
        raise raised

    harness = types.ModuleType("lm_eval")
    harness.tasks = types.ModuleType("lm_eval.tasks")
    harness.tasks.TaskManager = lambda include_path=None, include_defaults=True: types.SimpleNamespace(
        all_tasks=["arc_easy"], load=load)
    monkeypatch.setitem(sys.modules, "lm_eval", harness)
    monkeypatch.setitem(sys.modules, "lm_eval.tasks", harness.tasks)
    monkeypatch.setattr(fabric_lin.evaluate, "load_checkpoint", lambda *args: pytest.fail("the model was loaded"))
    err = cli_error(["evaluate", str(tmp_path), "--tasks", "arc_easy"], capsys)
    assert err.startswith(f"fabric-lin evaluate: error: --tasks arc_easy: {said}"), err


@pytest.mark.slow
def test_unknown_task_name_is_one_line(run, capsys):
    pytest.importorskip("lm_eval")
    err = cli_error(["evaluate", str(run / "out" / "final"), "--tasks", "hellaswagg"], capsys)
    assert "lm-evaluation-harness has no task, group or tag named 'hellaswagg' (did you mean hellaswag" in err


@pytest.mark.slow
def test_too_few_few_shot_examples_are_one_line_before_the_model_is_loaded(run, tmp_path):
    """--num_fewshot 5 of a task of 4 documents (its few-shot examples from them): one line naming the task,
    --num_fewshot and how many examples the task has, before the weights are read (here those of a copy of the
    checkpoint whose weights are damaged, which evaluate would name first had it read them) and before the data is
    evaluated: nothing is written. The harness itself is the reference: --num_fewshot 4 runs."""
    import shutil

    pytest.importorskip("lm_eval")
    write_tasks(tmp_path)
    damaged = tmp_path / "damaged"
    shutil.copytree(run / "out" / "final", damaged)
    (damaged / "lit_model.pth").write_bytes(b"not the weights")
    proc = evaluate_in_subprocess(run, tmp_path, "--max_batches", "1", "--tasks", "tiny_choice", "--num_fewshot", "5",
                                  checkpoint=damaged)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.endswith("fabric-lin evaluate: error: --num_fewshot 5: task tiny_choice has 4 few-shot examples: "
                                "give --num_fewshot 4 or fewer\n"), proc.stderr[-3000:]
    assert not (tmp_path / "out").exists()
    assert evaluate_in_subprocess(run, tmp_path, "--max_batches", "1", "--tasks", "tiny_choice",
                                  "--num_fewshot", "4").returncode == 0


def test_a_failure_of_the_harness_keeps_the_data_s_results(run, tmp_path, monkeypatch, harness_with_hellaswag):
    """The harness failing after the data was evaluated (minutes or hours of it): evaluate.json holds the data's results,
    equal to those of the data alone, and the tasks marked failed; the failure itself is raised."""
    import fabric_lin.evaluate

    def failing(*args):
        raise RuntimeError("the harness failed")

    for module in ("matplotlib", "matplotlib.figure"):  # no plot: this test does not look at it
        monkeypatch.setitem(sys.modules, module, None)
    monkeypatch.setattr(fabric_lin.evaluate, "run_tasks", failing)
    with pytest.raises(RuntimeError, match="the harness failed"):
        evaluate(run / "out" / "final", max_batches=1, tasks="hellaswag", out_dir=tmp_path / "out")
    results = json.loads((tmp_path / "out" / "evaluate.json").read_text())
    assert results["tasks"] == {"failed": "RuntimeError: the harness failed"}
    assert results["partial"] == ("lm-evaluation-harness failed before its tasks finished: the validation data's results "
                                  "are whole, the tasks have none")
    alone = evaluate(run / "out" / "final", max_batches=1, out_dir=tmp_path / "alone")
    assert results["lengths"][0]["loss"] == alone["lengths"][0]["loss"]


@pytest.mark.parametrize("said, how, line, exit_code", [("", "Ctrl-C", "interrupted", 130),
                                                      ("SIGTERM", "SIGTERM", "stopped by SIGTERM", 143)])
def test_ctrl_c_during_the_tasks_keeps_the_data_s_results_marked_partial(run, tmp_path, capsys, monkeypatch,
                                                                         harness_with_hellaswag, said, how, line,
                                                                         exit_code):
    """Ctrl-C (or SIGTERM) while the harness runs the tasks, after the data was evaluated (minutes or hours of it):
    evaluate.json holds the data's results, those of the data alone, marked partial first thing in the file and the
    tasks interrupted; the last line says where they are and how to go on (it said that nothing was written), and an
    evaluation into the same out_dir names them partial. With no data evaluated, nothing is written, as it says."""
    import fabric_lin.evaluate
    from fabric_lin.cli import main as cli_main

    def interrupted(*args):
        raise KeyboardInterrupt(said)

    def last_line(argv) -> str:
        capsys.readouterr()
        with pytest.raises(SystemExit) as info:
            cli_main(argv)
        assert info.value.code == exit_code
        err = capsys.readouterr().err
        assert "Traceback" not in err, err
        return err.splitlines()[-1]

    for module in ("matplotlib", "matplotlib.figure"):  # no plot: this test does not look at it
        monkeypatch.setitem(sys.modules, module, None)
    monkeypatch.setattr(fabric_lin.evaluate, "run_tasks", interrupted)
    final, out = run / "out" / "final", tmp_path / "out"
    assert last_line(["evaluate", str(final), "--max_batches", "1", "--tasks", "hellaswag", "--out_dir", str(out)]) == (
        f"fabric-lin evaluate: {line}: the validation data's results are in {out / 'evaluate.json'}, marked partial (the "
        f"tasks have none): run the tasks alone with --max_batches 0 and another --out_dir, or everything again with "
        f"--overwrite true")
    results = json.loads((out / "evaluate.json").read_text())
    assert next(iter(results)) == "partial"
    assert results["partial"] == (f"the lm-evaluation-harness tasks were interrupted ({how}): the validation data's "
                                  f"results are whole, the tasks have none")
    assert results["tasks"] == {"interrupted": how}
    alone = evaluate(final, max_batches=1, out_dir=tmp_path / "alone")["lengths"][0]
    kept = results["lengths"][0]
    assert (kept["loss"], kept["data_fingerprint"], kept["tokens"]) == (alone["loss"], alone["data_fingerprint"],
                                                                         alone["tokens"])
    assert cli_error(["evaluate", str(final), "--max_batches", "1", "--out_dir", str(out)], capsys) == (
        f"fabric-lin evaluate: error: {out / 'evaluate.json'} holds the partial results of an earlier evaluation (its "
        f"tasks did not finish): write this one to another --out_dir, or replace them with --overwrite true\n")
    tasks_only = tmp_path / "tasks-only"
    assert last_line(["evaluate", str(final), "--max_batches", "0", "--tasks", "hellaswag", "--out_dir", str(tasks_only)]) == (
        f"fabric-lin evaluate: {line}: nothing half-written is left; run the same command again")
    assert not tasks_only.exists()


# ---------------------------------------------------------------- --tasks and the harness's options, checked first


@pytest.mark.parametrize("limit,refused", [(0.5, False), (1.0, False), (20, False), (1.5, True), (0.0, True), (-2, True)])
def test_limit_is_a_fraction_below_one_or_a_whole_count(limit, refused):
    """lm-evaluation-harness reads a --limit of 1 or more as a count and cuts it to a whole one: 1.5 (one and a half
    percent?) ran 1 example per task."""
    from fabric_lin.evaluate import check_arguments

    if refused:
        with pytest.raises(InvalidValue, match=rf"^--limit must be a fraction below 1 or a whole count of examples per "
                                               rf"task \(e\.g\. 0\.1 or 100\); got {limit}$"):
            check_arguments(None, None, None, None, None, None, limit)
    else:
        check_arguments(None, None, None, None, None, None, limit)


@pytest.mark.parametrize("tasks", ["", ",", " , "])
def test_tasks_that_name_no_task_are_one_line(run, tmp_path, capsys, tasks):
    """--tasks given with no name in it (an empty shell variable, say) evaluated the data alone, as if no task was
    asked for."""
    err = cli_error(["evaluate", str(run / "out" / "final"), "--max_batches", "1", "--out_dir", str(tmp_path / "eval"),
                     "--tasks", tasks], capsys)
    assert err == (f"fabric-lin evaluate: error: --tasks {tasks!r} names no task: give task, group or tag names "
                   "separated by commas (e.g. hellaswag,arc_easy), or leave --tasks out\n")
    assert not (tmp_path / "eval").exists()


@pytest.mark.parametrize("tasks, entry", [("hellaswag,,arc_easy", "entry 2 of 3"), ("hellaswag, ,arc_easy", "entry 2 of 3"),
                                          ("hellaswag,", "entry 2 of 2"), (",hellaswag,arc_easy", "entry 1 of 3"),
                                          ("[hellaswag, '', arc_easy]", "entry 2 of 3")])
def test_tasks_with_an_empty_entry_are_refused(tmp_path, capsys, tasks, entry):
    """An empty entry among the names (a shell variable left unset: --tasks "hellaswag,$MORE,arc_easy") was dropped, and
    fewer tasks than meant were evaluated; lm-eval refuses it (no task is named ''). Refused before a model is read."""
    err = cli_error(["evaluate", str(tmp_path / "no checkpoint"), "--tasks", tasks], capsys)
    given = repr(tasks) if not tasks.startswith("[") else "['hellaswag', '', 'arc_easy']"
    assert err == (f"fabric-lin evaluate: error: --tasks {given}: {entry} is empty (a shell variable left unset, or a "
                   f"comma too many?): every entry between commas names a task, group or tag, e.g. --tasks "
                   f"{'hellaswag' if tasks == 'hellaswag,' else 'hellaswag,arc_easy'}\n")


def test_task_names_are_checked_before_the_model_is_loaded(tmp_path, capsys, monkeypatch):
    """Against a stand-in for the harness's TaskManager (its index of task names): an unknown name is one line with
    the close ones; names all in --task_dir (or YAML files) leave the built-in tasks unindexed."""
    import types

    from fabric_lin.evaluate import find_tasks

    built = []

    class TaskManager:
        def __init__(self, include_path=None, include_defaults=True):
            built.append(include_defaults)
            self.all_tasks = (["arc_easy", "hellaswag", "hellaswag_de"] if include_defaults else []) + (
                [p.stem for p in Path(include_path).glob("*.yaml")] if include_path else [])

    harness = types.ModuleType("lm_eval")
    harness.tasks = types.ModuleType("lm_eval.tasks")
    harness.tasks.TaskManager = TaskManager
    monkeypatch.setitem(sys.modules, "lm_eval", harness)
    monkeypatch.setitem(sys.modules, "lm_eval.tasks", harness.tasks)
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "mine.yaml").write_text("task: mine\n")
    err = cli_error(["evaluate", str(tmp_path / "no checkpoint"), "--tasks", "hellaswagg,arc_easy"], capsys)
    assert err == ("fabric-lin evaluate: error: --tasks: lm-evaluation-harness has no task, group or tag named 'hellaswagg' "
                   "(did you mean hellaswag, hellaswag_de?); `lm-eval ls tasks` lists them; a task of your own: the path "
                   "of its YAML file, or --task_dir DIR\n")
    built.clear()
    assert find_tasks(["mine"], tmp_path / "tasks").all_tasks == ["mine"] and built == [False]
    assert find_tasks([str(tmp_path / "tasks" / "mine.yaml")], None).all_tasks == [] and built == [False, False]
    assert find_tasks(["mine", "hellaswag"], tmp_path / "tasks").all_tasks[-1] == "mine" and built[-1] is True


@pytest.mark.parametrize("num_fewshot, own, split, refused", [
    (4, None, "train", "--num_fewshot 4: task tiny has 3 few-shot examples: give --num_fewshot 3 or fewer"),
    (3, None, "test", "--num_fewshot 3: task tiny has 2 few-shot examples: give --num_fewshot 2 or fewer"),
    (None, 5, "train", "task tiny asks for 5 few-shot examples (its num_fewshot) and has 3: give --num_fewshot 3 or fewer"),
    (3, None, "train", None), (9, 0, "train", None)])
def test_more_few_shot_examples_than_a_task_has_are_refused_before_the_model_is_loaded(tmp_path, capsys, monkeypatch,
                                                                                       num_fewshot, own, split, refused):
    """Against a stand-in for the harness's TaskManager and a task it builds of 3 few-shot examples from its train
    split, or its test split (the one it is evaluated on, whose document asked about the harness leaves out of them):
    --num_fewshot, or the task's own num_fewshot, beyond them is one line, before the checkpoint's weights are read
    (the harness itself fails on it after the model is loaded and the data evaluated). A task's own 0 is kept by the
    harness whatever --num_fewshot says."""
    import types

    import fabric_lin.evaluate

    task = types.SimpleNamespace(config=types.SimpleNamespace(task="tiny", num_fewshot=own, test_split="test"),
                                 fewshot_cfg=types.SimpleNamespace(split=split),
                                 sampler=types.SimpleNamespace(fewshot_docs=lambda: [{"doc": i} for i in range(3)]))
    harness = types.ModuleType("lm_eval")
    harness.tasks = types.ModuleType("lm_eval.tasks")
    harness.tasks.TaskManager = lambda include_path=None, include_defaults=True: types.SimpleNamespace(
        all_tasks=["tiny"], load=lambda names: {"tasks": {"tiny": task}, "groups": {}})
    monkeypatch.setitem(sys.modules, "lm_eval", harness)
    monkeypatch.setitem(sys.modules, "lm_eval.tasks", harness.tasks)
    monkeypatch.setattr(fabric_lin.evaluate, "load_checkpoint", lambda *args: pytest.fail("the model was loaded"))
    argv = ["evaluate", str(tmp_path), "--tasks", "tiny"] + (["--num_fewshot", str(num_fewshot)] if num_fewshot else [])
    if refused:
        assert cli_error(argv, capsys) == f"fabric-lin evaluate: error: {refused}\n"
    else:
        with pytest.raises(pytest.fail.Exception, match="the model was loaded"):
            fabric_lin.evaluate.main(tmp_path, tasks="tiny", num_fewshot=num_fewshot)


def test_weights_without_their_tokenizer_are_refused_before_the_tasks_are_built(tmp_path, capsys, monkeypatch):
    """--tasks on a model directory or an fla export without its tokenizer.model: one line before the harness builds
    the tasks (reads their datasets: minutes for some, a download for the first run) and before the weights are read."""
    import types

    import fabric_lin.evaluate
    from helpers import make_model_dir, small_config

    harness = types.ModuleType("lm_eval")
    harness.tasks = types.ModuleType("lm_eval.tasks")
    harness.tasks.TaskManager = lambda include_path=None, include_defaults=True: types.SimpleNamespace(
        all_tasks=["tiny"], load=lambda names: pytest.fail("the tasks were built"))
    monkeypatch.setitem(sys.modules, "lm_eval", harness)
    monkeypatch.setitem(sys.modules, "lm_eval.tasks", harness.tasks)
    monkeypatch.setattr(fabric_lin.evaluate, "load_checkpoint", lambda *args: pytest.fail("the model was loaded"))
    make_model_dir(tmp_path / "model", small_config())
    (tmp_path / "model" / "tokenizer.model").unlink()
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "config.json").write_text("{}")
    for directory in (tmp_path / "model", tmp_path / "export"):
        assert cli_error(["evaluate", str(directory), "--tasks", "tiny"], capsys) == (
            f"fabric-lin evaluate: error: --tasks: {directory} has no tokenizer.model, and the harness's tasks are text\n")
    # a directory of no weights at all is told what it is, by the checkpoint's reading, as before
    (tmp_path / "empty").mkdir()
    with pytest.raises(pytest.fail.Exception, match="the tasks were built"):
        fabric_lin.evaluate.main(tmp_path / "empty", tasks="tiny")


def test_a_task_file_that_is_not_there_or_a_directory_of_tasks_in_tasks_is_named(tmp_path, capsys, monkeypatch):
    """--tasks given a task file's path that does not exist, or a directory of task files (where --task_dir belongs),
    is one line about that path, not an unknown task name with the harness's unrelated close names; a file's before the
    harness indexes its tasks. A harness task that shares its name with a directory here is still the task."""
    import types

    built = []

    class TaskManager:
        def __init__(self, include_path=None, include_defaults=True):
            built.append(include_defaults)
            self.all_tasks = ["hellaswag", "openai_mmlu", "sib_tasks"] if include_defaults else []

    harness = types.ModuleType("lm_eval")
    harness.tasks = types.ModuleType("lm_eval.tasks")
    harness.tasks.TaskManager = TaskManager
    monkeypatch.setitem(sys.modules, "lm_eval", harness)
    monkeypatch.setitem(sys.modules, "lm_eval.tasks", harness.tasks)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "mine.yaml").write_text("task: mine\n")
    (tmp_path / "hellaswag").mkdir()
    missing = tmp_path / "no checkpoint"
    assert cli_error(["evaluate", str(missing), "--tasks", "hellaswag,tasks/mine.yml"], capsys) == (
        "fabric-lin evaluate: error: --tasks tasks/mine.yml: no such task file (a task of your own: the path of its "
        "YAML file, or its name with --task_dir DIR)\n")
    assert built == []
    assert cli_error(["evaluate", str(missing), "--tasks", "tasks/"], capsys) == (
        "fabric-lin evaluate: error: --tasks tasks/ is a directory, not a task: give it as --task_dir tasks/ and name "
        "the tasks of its YAML files in --tasks\n")
    assert cli_error(["evaluate", str(missing), "--tasks", "tasks.yaml"], capsys) == (
        "fabric-lin evaluate: error: --tasks tasks.yaml: no such task file (a task of your own: the path of its YAML "
        "file, or its name with --task_dir DIR)\n")
    (tmp_path / "dir.yaml").mkdir()
    assert "--tasks dir.yaml is a directory, not a task" in cli_error(["evaluate", str(missing), "--tasks", "dir.yaml"], capsys)
    assert f"error: {missing} is not a directory" in cli_error(["evaluate", str(missing), "--tasks", "hellaswag"], capsys)


def test_a_task_file_s_path_starting_with_a_tilde_is_in_the_home_directory(tmp_path, capsys, monkeypatch,
                                                                           harness_with_hellaswag):
    """--tasks=~/mine.yaml (which no shell expands), alone or in a list, names the file in the home directory, as a
    path option's ~ does: the names pass, and the command goes on to the checkpoint (here none: its one-line error)."""
    from fabric_lin.evaluate import task_list

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "mine.yaml").write_text("task: mine\n")
    missing = tmp_path / "no checkpoint"
    for tasks in ("--tasks=~/mine.yaml", "--tasks=[~/mine.yaml, hellaswag]", "--tasks=hellaswag,~/mine.yaml"):
        err = cli_error(["evaluate", str(missing), tasks], capsys)
        assert f"error: {missing} is not a directory" in err, (tasks, err)
    assert task_list("hellaswag, ~/mine.yaml") == ["hellaswag", str(tmp_path / "mine.yaml")]
    assert task_list(["~/mine.yml"]) == [str(tmp_path / "mine.yml")]  # the other YAML suffix: a file too


def test_harness_options_without_tasks_are_one_line(run, capsys):
    final = run / "out" / "final"
    for option, value in (("--limit", "5"), ("--num_fewshot", "2"), ("--task_dir", str(run))):
        err = cli_error(["evaluate", str(final), option, value], capsys)
        assert f"error: {option} set how lm-evaluation-harness runs its tasks, and no --tasks is given: give --tasks, " \
               f"or leave {option} out\n" in err, err


@pytest.mark.parametrize("flag, ours", [("--include_path", "--task_dir"), ("--output_path", "--out_dir"),
                                        ("--save_filepath", "--out_dir"), ("--dtype", "--precision")])
def test_lm_eval_s_and_litgpt_s_names_of_evaluate_s_options_point_to_them(tmp_path, capsys, flag, ours):
    """lm-evaluation-harness's --include_path and --output_path, LitGPT evaluate's --save_filepath and --dtype: no
    spelling of fabric-lin's resembles them, and the error named no option to use."""
    from fabric_lin.cli import main as cli_main

    with pytest.raises(SystemExit) as info:
        cli_main(["evaluate", str(tmp_path), "--tasks", "hellaswag", flag, "x"])
    assert info.value.code == 2
    assert capsys.readouterr().err == (f"fabric-lin evaluate: error: unknown option {flag} (did you mean {ours}?)\n"
                                       f"(fabric-lin evaluate --help lists the options)\n")
