"""`fabric-lin evaluate` on data, against independent references: the loss equals the val_loss that pretrain logged
for the same weights and batches; the loss by position (at the training length and twice it) equals a direct
cross-entropy of the model's logits over litdata's own reading of the blocks, and so do the loss, the perplexity
and the buckets of batches whose last one is short, the logits computed in pieces; the buckets by default and at
given edges; a bf16 model's loss is the fp32 cross-entropy of its logits; a run that resets its state at document
boundaries is validated and evaluated document by document; every kind of checkpoint gives the same loss; the data
read: the validation split alone, every block of it without --max_batches, the run's own changed by --data.* options,
the data's tokenizer checked against the model's record; the plot. (The harness: test_evaluate_harness.py; bad input:
test_evaluate_errors.py.)"""
import json
import math
import shutil
import sys
from pathlib import Path

import lightning_fabric as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml

from conftest import TRAIN_LEN, VAL_ITERS, final_weights, litdata_blocks, text_lines, train_evaluate_run
from fabric_lin.args import EvalArgs, TrainArgs
from fabric_lin.config import Config
from fabric_lin.errors import InvalidValue
from fabric_lin.evaluate import main as evaluate, plot_loss_by_position
from fabric_lin.model import GPT
from helpers import cli_error


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """conftest's train_evaluate_run, once for this module (a module-scoped fixture keeps the module's tests on one
    pytest-xdist worker: conftest's pytest_xdist_make_scheduler)."""
    return train_evaluate_run(tmp_path_factory.mktemp("evaluate"))


def test_loss_equals_the_val_loss_pretrain_logged(run, monkeypatch, capsys):
    records = [json.loads(line) for line in (run / "out" / "metrics.jsonl").read_text().splitlines()]
    logged = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(logged) == 1  # the final validation only
    for module in ("matplotlib", "matplotlib.figure"):  # the optional extra missing: the JSON and a hint
        monkeypatch.setitem(sys.modules, module, None)
    results = evaluate(run / "out" / "final", max_batches=VAL_ITERS)
    (length,) = results["lengths"]
    # the run's data module, micro batch size and length, from its hyperparameters.yaml
    assert results["data"]["init_args"]["val_path"] == str(run / "val")
    assert (length["seq_len"], length["batch_size"], length["batches"]) == (TRAIN_LEN, 2, VAL_ITERS)
    assert length["tokens"] == VAL_ITERS * 2 * TRAIN_LEN
    assert abs(length["loss"] - logged[0]) < 1e-5, (length["loss"], logged[0])
    out_dir = run / "out" / "evaluate" / "final"
    assert json.loads((out_dir / "evaluate.json").read_text()) == json.loads(json.dumps(results))
    assert not (out_dir / "loss_by_position.png").exists()
    assert "for the plot, pip install matplotlib" in capsys.readouterr().out


def test_loss_by_position_equals_a_direct_cross_entropy(run, tmp_path):
    """At the training length and twice it, the blocks read as litdata's own loader cuts them, in order."""
    batches, bucket = 2, 8
    results = evaluate(run / "out" / "final", seq_len=[TRAIN_LEN, 2 * TRAIN_LEN], max_batches=batches, bucket_size=bucket,
                       out_dir=tmp_path / "eval")
    model = final_weights(run)
    for length, seq_len in zip(results["lengths"], (TRAIN_LEN, 2 * TRAIN_LEN)):
        blocks = [np.frombuffer(b, dtype=np.int64) for b in litdata_blocks(run / "val", seq_len + 1)[: batches * 2]]
        ids = torch.from_numpy(np.stack(blocks))
        with torch.no_grad():
            logits = model(ids[:, :-1])
        losses = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="none").view(-1, seq_len).double()
        assert length["tokens"] == losses.numel() == batches * 2 * seq_len
        assert length["loss"] == pytest.approx(losses.mean().item(), abs=1e-5)
        by_position = length["by_position"]
        assert by_position["start"] == list(range(0, seq_len, bucket))
        expected = losses.view(-1, seq_len // bucket, bucket).mean(dim=(0, 2))
        np.testing.assert_allclose(by_position["loss"], expected.numpy(), atol=1e-5)
        assert by_position["tokens"] == [batches * 2 * bucket] * (seq_len // bucket)


@pytest.mark.filterwarnings("error:Converting a tensor with requires_grad=True")  # the evaluation builds no graph
def test_loss_by_position_in_buckets_of_given_edges(run, tmp_path):
    """Buckets 0-8, 8-20 and 20 to the end (an edge past a length left out), against a direct cross-entropy."""
    batches, edges = 2, [8, 20, 40]
    results = evaluate(run / "out" / "final", seq_len=[TRAIN_LEN, 2 * TRAIN_LEN], max_batches=batches, bucket_edges=edges,
                       out_dir=tmp_path / "eval")
    model = final_weights(run)
    for length, seq_len, bounds in zip(results["lengths"], (TRAIN_LEN, 2 * TRAIN_LEN), ([0, 8, 20, 32], [0, 8, 20, 40, 64])):
        blocks = [np.frombuffer(b, dtype=np.int64) for b in litdata_blocks(run / "val", seq_len + 1)[: batches * 2]]
        ids = torch.from_numpy(np.stack(blocks))
        with torch.no_grad():
            logits = model(ids[:, :-1])
        losses = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="none").view(-1, seq_len).double()
        by_position = length["by_position"]
        assert (by_position["start"], by_position["end"]) == (bounds[:-1], bounds[1:])
        expected = [losses[:, start:end].mean().item() for start, end in zip(bounds[:-1], bounds[1:])]
        np.testing.assert_allclose(by_position["loss"], expected, atol=1e-5)
        assert by_position["tokens"] == [batches * 2 * (end - start) for start, end in zip(bounds[:-1], bounds[1:])]


def test_loss_perplexity_and_buckets_of_batches_with_a_short_last_one(monkeypatch):
    """evaluate_length against a direct cross-entropy of the model's logits: batches of 3, 3 and 1 blocks of 8 tokens
    (the split's last batch short), buckets 0-3 and 3-8, the logits computed 5 tokens at a time (LOGIT_ROWS) so that
    their pieces cut the rows. The loss is the mean over the 56 tokens, the perplexity e to it, a bucket's loss the
    mean over its positions of the 7 blocks."""
    import fabric_lin.evaluate as evaluate_module

    monkeypatch.setattr(evaluate_module, "LOGIT_ROWS", 5)
    torch.manual_seed(0)
    model = GPT(Config.from_name("gla-debug", num_layers=1, vocab_size=64)).eval()
    blocks = torch.randint(0, 64, (7, 9))
    fabric = L.Fabric(accelerator="cpu", devices=1)
    result = evaluate_module.evaluate_length(fabric, model, [blocks[:3], blocks[3:6], blocks[6:]], seq_len=8, batch_size=3,
                                             max_batches=None, starts=[0, 3])
    with torch.no_grad():
        logits = model(blocks[:, :-1])
    losses = F.cross_entropy(logits.flatten(0, 1), blocks[:, 1:].flatten(), reduction="none").view(7, 8).double()
    assert (result["tokens"], result["batches"], result["short_batches"]) == (56, 3, 1)
    assert result["loss"] == pytest.approx(losses.mean().item(), abs=1e-6)
    assert result["perplexity"] == pytest.approx(math.exp(losses.mean().item()), rel=1e-6)
    by_position = result["by_position"]
    assert (by_position["start"], by_position["end"], by_position["tokens"]) == ([0, 3], [3, 8], [21, 35])
    assert by_position["loss"] == pytest.approx([losses[:, :3].mean().item(), losses[:, 3:].mean().item()], abs=1e-6)


def test_blocks_of_another_length_no_block_and_a_diverged_model_are_told():
    """A data module's loader that gives blocks of another length, or none; a model whose loss overflows e to it (the
    perplexity is capped at e^100, not an OverflowError after the evaluation)."""
    from fabric_lin.errors import UserError
    from fabric_lin.evaluate import evaluate_length

    torch.manual_seed(0)
    model = GPT(Config.from_name("gla-debug", num_layers=1, vocab_size=64)).eval()
    fabric = L.Fabric(accelerator="cpu", devices=1)
    blocks = torch.randint(0, 64, (2, 9))
    with pytest.raises(UserError, match=r"the validation loader gave blocks of 9 tokens, expected seq_len \+ 1 = 5"):
        evaluate_length(fabric, model, [blocks], seq_len=4, batch_size=2, max_batches=None, starts=[0])
    with pytest.raises(InvalidValue, match=r"seq_len 8: the validation data gives no block of 9 tokens; lower --seq_len"):
        evaluate_length(fabric, model, [], seq_len=8, batch_size=2, max_batches=None, starts=[0])
    with torch.no_grad():
        model.lm_head.weight.mul_(1e5)
    result = evaluate_length(fabric, model, [blocks], seq_len=8, batch_size=2, max_batches=None, starts=[0])
    assert result["loss"] > 1000 and result["perplexity"] == math.exp(100)


def test_the_loss_of_a_bf16_model_is_the_fp32_cross_entropy_of_its_logits():
    from fabric_lin.evaluate import token_losses

    torch.manual_seed(0)
    model = GPT(Config.from_name("gla-debug", num_layers=1, vocab_size=64)).to(torch.bfloat16).eval()
    blocks = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        logits = F.linear(model(blocks[:, :-1], return_hidden=True), model.output_weight)
        expected = F.cross_entropy(logits.float().flatten(0, 1), blocks[:, 1:].flatten(), reduction="none")
        got = token_losses(model, blocks[:, :-1], blocks[:, 1:])
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.flatten(), expected, rtol=1e-6, atol=1e-6)


def test_bucket_edges_at_or_past_a_length_are_left_out_for_it():
    from fabric_lin.evaluate import bucket_starts

    assert bucket_starts(16, None, [4, 16, 32]) == [0, 4]
    assert bucket_starts(32, None, [4, 16, 32]) == [0, 4, 16]
    assert bucket_starts(10, 4, None) == [0, 4, 8]


def test_the_default_buckets_are_a_16th_of_the_training_length_at_every_length(run, tmp_path, monkeypatch):
    for module in ("matplotlib", "matplotlib.figure"):  # no plot: this test does not look at it
        monkeypatch.setitem(sys.modules, module, None)
    (length,) = evaluate(run / "out" / "final", seq_len=2 * TRAIN_LEN, max_batches=1, out_dir=tmp_path / "eval")["lengths"]
    assert length["by_position"]["start"] == list(range(0, 2 * TRAIN_LEN, TRAIN_LEN // 16))

def test_a_run_that_resets_at_document_boundaries_is_validated_and_evaluated_document_by_document(run, tmp_path):
    """reset_state_at_doc_boundaries trains each document as if alone; the run's val_loss and evaluate's loss of its
    checkpoint (which follows the run's setting) measure the same: each document of the validation blocks run through
    the model on its own. `reset_state_at_doc_boundaries=False` reads the blocks whole, the documents seeing each
    other."""
    from fabric_lin.data import TokenChunks, Tokenizer
    from fabric_lin.pretrain import setup

    setup(
        model_name="gla-debug", out_dir=tmp_path / "out", logger_name="csv", devices=1, tokenizer_dir=run / "tok",
        data=TokenChunks(data_path=run / "train", val_path=run / "val", num_workers=0),
        train=TrainArgs(global_batch_size=2, micro_batch_size=2, max_steps=1, max_seq_length=TRAIN_LEN,
                        save_interval=None),
        eval=EvalArgs(max_iters=VAL_ITERS, interval=1000, final_validation=True), reset_state_at_doc_boundaries=True,
    )
    model, eos = final_weights(tmp_path), Tokenizer(run / "tok").eos_id
    per_document = whole = 0.0
    blocks = [torch.tensor(np.frombuffer(b, dtype=np.int64)) for b in litdata_blocks(run / "val", TRAIN_LEN + 1)]
    with torch.no_grad():
        for block in blocks[: VAL_ITERS * 2]:  # eval.max_iters global batches of 2
            inputs, targets = block[:-1], block[1:]
            starts = [0] + [i + 1 for i in range(TRAIN_LEN - 1) if inputs[i] == eos]  # a document starts after an EOS
            for start, end in zip(starts, starts[1:] + [TRAIN_LEN]):
                logits = model(inputs[None, start:end])[0]
                per_document += F.cross_entropy(logits, targets[start:end], reduction="sum").item()
            whole += F.cross_entropy(model(inputs[None])[0], targets, reduction="sum").item()
    tokens = VAL_ITERS * 2 * TRAIN_LEN
    per_document, whole = per_document / tokens, whole / tokens
    assert abs(per_document - whole) > 1e-3  # the blocks hold several documents each
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["val_loss"] for r in records if "val_loss" in r] == [pytest.approx(per_document, abs=1e-5)]
    results = evaluate(tmp_path / "out" / "final", max_batches=VAL_ITERS, out_dir=tmp_path / "per_document")
    assert results["reset_state_at_doc_boundaries"] is True
    assert results["lengths"][0]["loss"] == pytest.approx(per_document, abs=1e-5)
    results = evaluate(tmp_path / "out" / "final", max_batches=VAL_ITERS, out_dir=tmp_path / "whole",
                       reset_state_at_doc_boundaries=False)
    assert results["lengths"][0]["loss"] == pytest.approx(whole, abs=1e-5)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_every_kind_of_checkpoint_gives_the_same_loss(run, tmp_path):
    """A model directory and an fla export of final/, and final/ with its weights sharded (a DCP directory)."""
    import torch.distributed.checkpoint as dcp

    from fabric_lin.checkpoint import write_manifest
    from fabric_lin.convert.hf import convert_to_hf
    from fabric_lin.convert.pretrained_checkpoint import convert_pretrained_checkpoint
    from fabric_lin.data import TokenChunks

    final = run / "out" / "final"
    convert_pretrained_checkpoint(final, tmp_path / "model")
    convert_to_hf(tmp_path / "model", tmp_path / "fla")
    sharded = tmp_path / "run" / "step-00000002"
    shutil.copytree(final, sharded)
    (sharded / "lit_model.pth").unlink()
    (sharded / "manifest.json").unlink()
    state = torch.load(final / "lit_model.pth", weights_only=False)["model"]
    dcp.save({"model": state}, checkpoint_id=sharded / "lit_model.pth", no_dist=True)

    class OneProcess:
        global_rank, world_size = 0, 1

        def broadcast(self, obj, src=0):
            return obj

        def barrier(self):
            pass

    write_manifest(OneProcess(), sharded)
    data = dict(data_path=run / "train", val_path=run / "val", num_workers=0)
    reference = evaluate(final, max_batches=2, out_dir=tmp_path / "reference")["lengths"][0]
    for directory, kind in ((tmp_path / "model", "model directory"), (tmp_path / "fla", "fla export"),
                            (sharded, "training checkpoint")):
        results = evaluate(directory, data=TokenChunks(**data), seq_len=TRAIN_LEN, batch_size=2, max_batches=2)
        assert results["kind"] == kind
        assert results["lengths"][0]["data_fingerprint"] == reference["data_fingerprint"]
        assert results["lengths"][0]["loss"] == pytest.approx(reference["loss"], abs=1e-6), directory
    assert (sharded.parent / "evaluate" / sharded.name / "evaluate.json").is_file()  # beside the checkpoint, not in it


def test_a_model_directory_records_the_length_its_run_trained_at(run, tmp_path, capsys):
    """The run trained at train.max_seq_length 32, past which gla-debug's model config says nothing (its max_seq_length
    2048): its model directory and export record 32, so that evaluate's training length (the default length, its
    buckets and the plot's mark) and fla's max_position_embeddings are the run's, where they were 2048."""
    from fabric_lin.convert.hf import HF_CONFIG_FILE, convert_to_hf
    from fabric_lin.convert.pretrained_checkpoint import convert_pretrained_checkpoint
    from fabric_lin.data import TokenChunks
    from fabric_lin.pretrain import setup

    final = run / "out" / "final"
    assert Config.from_checkpoint(final).max_seq_length == 2048  # the run's model config leaves it at the default
    convert_pretrained_checkpoint(final, tmp_path / "model")
    assert Config.from_checkpoint(tmp_path / "model").max_seq_length == TRAIN_LEN
    results = evaluate(tmp_path / "model", data=TokenChunks(val_path=run / "val", num_workers=0), max_batches=1)
    assert (results["train_seq_len"], results["lengths"][0]["seq_len"]) == (TRAIN_LEN, TRAIN_LEN)
    assert results["lengths"][0]["by_position"]["end"][0] == TRAIN_LEN // 16
    convert_to_hf(tmp_path / "model", tmp_path / "fla")
    assert json.loads((tmp_path / "fla" / HF_CONFIG_FILE).read_text())["max_position_embeddings"] == TRAIN_LEN
    # the directory starts a run of the model it was trained as, at its length, without a note of another model config
    capsys.readouterr()
    setup(model_name="gla-debug", out_dir=tmp_path / "continued", logger_name="csv", devices=1,
          initial_checkpoint_dir=tmp_path / "model", data=TokenChunks(data_path=run / "train", num_workers=0),
          train=TrainArgs(global_batch_size=2, micro_batch_size=2, max_steps=1, max_seq_length=TRAIN_LEN, lr_warmup_steps=0),
          eval=EvalArgs(final_validation=False))
    assert "differs from this run's model" not in capsys.readouterr().out
    # and is named as that model where another is built
    with pytest.raises(InvalidValue, match=r"start this run with --model_name gla-debug$"):
        setup(model_name="gdn-debug", out_dir=tmp_path / "other", initial_checkpoint_dir=tmp_path / "model",
              data=TokenChunks(data_path=run / "train", num_workers=0), train=TrainArgs(max_steps=1, max_seq_length=TRAIN_LEN))


def test_finetune_lora_md_measures_every_held_out_document(run, tmp_path, monkeypatch):
    """tutorials/finetune_lora.md's commands that measure the fine-tune, as written (the model directories and the
    held-out text ours; --seq_len 16 for 512): every held-out document is evaluated, before and after, in the blocks
    of seq_len + 1 tokens their tokens make. (Held out at --val_fraction 0.5 into val/, about half of them were, or
    none: evaluate then found no val/.)"""
    import re
    import shlex

    from fabric_lin.cli import main as cli_main
    from fabric_lin.convert.pretrained_checkpoint import convert_pretrained_checkpoint
    from fabric_lin.data import Tokenizer

    tutorial = (Path(__file__).parents[1] / "tutorials" / "finetune_lora.md").read_text()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", tutorial, re.S) if "data/my-text-heldout" in b)
    commands = [shlex.split(line) for line in block.replace("\\\n", " ").splitlines()]
    monkeypatch.chdir(tmp_path)
    convert_pretrained_checkpoint(run / "out" / "final", Path("checkpoints/gla-340M"))
    shutil.copytree("checkpoints/gla-340M", "checkpoints/gla-340M-lora")
    documents = text_lines(6, seed=3)
    Path("data/my-text-heldout").mkdir(parents=True)
    Path("data/my-text-heldout/heldout.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    for command in commands:
        assert command[0] == "fabric-lin"
        cli_main([{"512": "16"}.get(arg, arg) for arg in command[1:]])
    tokens = sum(len(ids) for ids in Tokenizer(run / "tok").encode_batch(documents, eos=True, num_threads=1))
    results = [json.loads(path.read_text())["lengths"][0] for path in sorted(Path(".").glob("**/evaluate.json"))]
    assert len(results) == 2 and [r["tokens"] for r in results] == [tokens // 17 * 16] * 2


def test_the_default_out_dir_is_beside_a_training_checkpoint_given_as_a_relative_path(tmp_path, monkeypatch):
    """`fabric-lin evaluate .` inside a checkpoint, or `..` below it: the results go beside it, never into it (its files
    are the ones its manifest lists); a model directory or an export keeps them in its evaluate/."""
    from fabric_lin.checkpoint_kinds import FLA_EXPORT, TRAINING_CHECKPOINT
    from fabric_lin.evaluate import default_out_dir

    (tmp_path / "run" / "final" / "below").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "run" / "final")
    assert default_out_dir(Path("."), TRAINING_CHECKPOINT) == tmp_path / "run" / "evaluate" / "final"
    monkeypatch.chdir(tmp_path / "run" / "final" / "below")
    assert default_out_dir(Path(".."), TRAINING_CHECKPOINT) == tmp_path / "run" / "evaluate" / "final"
    assert default_out_dir(Path("."), FLA_EXPORT).resolve() == tmp_path / "run" / "final" / "below" / "evaluate"


def test_the_model_runs_pytorch_s_ops_on_the_cpu(run):
    """The fused Triton kernels need a GPU: on the CPU the model takes their PyTorch references."""
    from fabric_lin.evaluate import build_model, load_checkpoint

    assert not build_model(L.Fabric(accelerator="cpu", devices=1), load_checkpoint(run / "out" / "final")).fused


def test_token_chunks_with_its_val_path_alone_is_evaluated(run, tmp_path):
    """evaluate reads the validation split alone, and its error for data without one says to give `TokenChunks
    --data.val_path DIR`: done so, it was refused for want of a data_path (training data)."""
    from fabric_lin.convert.pretrained_checkpoint import convert_pretrained_checkpoint
    from fabric_lin.data import TokenChunks

    convert_pretrained_checkpoint(run / "out" / "final", tmp_path / "model")
    options = dict(seq_len=TRAIN_LEN, batch_size=2, max_batches=2)
    alone = evaluate(tmp_path / "model", data=TokenChunks(val_path=run / "val", num_workers=0), **options)
    both = evaluate(tmp_path / "model", data=TokenChunks(data_path=run / "train", val_path=run / "val", num_workers=0),
                    out_dir=tmp_path / "both", **options)
    assert alone["lengths"][0]["data_fingerprint"] == both["lengths"][0]["data_fingerprint"]
    assert alone["lengths"][0]["loss"] == both["lengths"][0]["loss"]


def test_the_validation_split_is_evaluated_without_the_training_directory(run, tmp_path, capsys):
    """evaluate reads the validation split alone: the run's own TokenChunks and a TextFiles given a train_dir are
    evaluated with the training directory gone (a machine that holds only the validation split), reading the blocks
    read with it there; a validation directory that is not there is named with its key."""
    from fabric_lin.data import TextFiles

    final = run / "out" / "final"
    options = dict(seq_len=TRAIN_LEN, batch_size=2, max_batches=2)
    with_train = evaluate(final, out_dir=tmp_path / "with_train", **options)["lengths"][0]
    (run / "train").rename(run / "train-moved")
    try:
        run_s_own = evaluate(final, out_dir=tmp_path / "run_s_own", **options)["lengths"][0]
        text_files = evaluate(final, data=TextFiles(train_dir=run / "train", val_dir=run / "val", num_workers=0),
                              out_dir=tmp_path / "text_files", **options)["lengths"][0]
        missing = {"TextFiles": ("train_dir", "val_dir"), "TokenChunks": ("data_path", "val_path")}
        errors = {name: cli_error(["evaluate", str(final), "--data", name, f"--data.{train}", str(run / "train"),
                                   f"--data.{val}", str(run / "vall"), "--out_dir", str(tmp_path / name)], capsys)
                  for name, (train, val) in missing.items()}
    finally:
        (run / "train-moved").rename(run / "train")
    for got in (run_s_own, text_files):
        assert (got["data_fingerprint"], got["loss"], got["tokens"]) == (
            with_train["data_fingerprint"], with_train["loss"], with_train["tokens"])
    for name, (_, val) in missing.items():
        assert errors[name].startswith(f"fabric-lin evaluate: error: data.{val} {run / 'vall'} does not exist: give a "
                                       f"prepared validation directory"), errors[name]
        assert "to train" not in errors[name], errors[name]  # pretrain's way on (train without validation) is not evaluate's


def test_slimpajama_starcoder_is_evaluated_from_its_validation_split_alone(run, tmp_path):
    """`--data SlimPajamaStarcoder` reads data_path/slimpajama/val alone; a data_path without slimpajama/train and
    starcoder was refused for want of them. The loss is the one of the same directory read by TokenChunks."""
    (tmp_path / "data" / "slimpajama").mkdir(parents=True)
    shutil.copytree(run / "val", tmp_path / "data" / "slimpajama" / "val")
    final = run / "out" / "final"
    options = ["--seq_len", str(TRAIN_LEN), "--batch_size", "2", "--max_batches", "2"]
    from fabric_lin.cli import main as cli

    cli(["evaluate", str(final), "--data", "SlimPajamaStarcoder", "--data.data_path", str(tmp_path / "data"),
         "--data.num_workers", "0", "--out_dir", str(tmp_path / "slimpajama"), *options])
    cli(["evaluate", str(final), "--data", "TokenChunks", "--data.val_path", str(run / "val"), "--data.num_workers", "0",
         "--out_dir", str(tmp_path / "token_chunks"), *options])
    slimpajama, token_chunks = (json.loads((tmp_path / name / "evaluate.json").read_text())["lengths"][0]
                                for name in ("slimpajama", "token_chunks"))
    assert slimpajama["tokens"] == token_chunks["tokens"] == 2 * 2 * TRAIN_LEN
    assert slimpajama["loss"] == token_chunks["loss"]


def test_a_model_without_a_tokenizer_checks_the_data_against_its_record_or_says_it_cannot(run, tmp_path, capsys):
    """With its tokenizer.model, a model directory refuses data of another one; without it, its trained_with.json does:
    the data of the recorded tokenizer is evaluated, the data of another is refused naming both; without the record
    too nothing can check: the evaluation runs and says so, naming the data's tokenizer."""
    import json

    from fabric_lin.convert.pretrained_checkpoint import convert_pretrained_checkpoint
    from fabric_lin.data import TokenChunks

    convert_pretrained_checkpoint(run / "out" / "final", tmp_path / "model")
    data = dict(data_path=run / "train", val_path=run / "val", num_workers=0)
    evaluate(tmp_path / "model", data=TokenChunks(**data), seq_len=TRAIN_LEN, max_batches=1)
    assert "Note:" not in capsys.readouterr().out
    for name in ("tokenizer.model", "tokenizer_config.json"):
        (tmp_path / "model" / name).unlink()
    evaluate(tmp_path / "model", data=TokenChunks(**data), seq_len=TRAIN_LEN, max_batches=1, overwrite=True)
    assert "Note:" not in capsys.readouterr().out
    with pytest.raises(ValueError, match=f"^--reset_state_at_doc_boundaries true needs the end-of-text token's id, and "
                                         f"{tmp_path / 'model'} has no tokenizer.model; its weights were trained with"):
        evaluate(tmp_path / "model", data=TokenChunks(**data), seq_len=TRAIN_LEN, max_batches=1, overwrite=True,
                 reset_state_at_doc_boundaries=True)
    sha256 = json.loads((run / "val" / "prepared.json").read_text())["tokenizer"]["sha256"]
    record = tmp_path / "model" / "trained_with.json"
    trained_with = json.loads(record.read_text())
    assert trained_with["tokenizer"]["sha256"] == sha256
    trained_with["tokenizer"]["sha256"] = "f" * 64  # weights that learnt another tokenizer's ids
    record.write_text(json.dumps(trained_with))
    with pytest.raises(ValueError) as info:
        evaluate(tmp_path / "model", data=TokenChunks(**data), seq_len=TRAIN_LEN, max_batches=1, overwrite=True)
    assert str(info.value) == (
        f"--data: {run / 'val'} was tokenized with vocab_size=300, sha256={sha256[:12]}..., from {run / 'tok'}, and the "
        f"weights of {tmp_path / 'model'} were trained on the ids of vocab_size=300, sha256=ffffffffffff..., from "
        f"{trained_with['tokenizer']['source']} (trained_with.json): an id is another piece in each; evaluate on data "
        "prepared with the model's tokenizer")
    record.unlink()
    evaluate(tmp_path / "model", data=TokenChunks(**data), seq_len=TRAIN_LEN, max_batches=1, overwrite=True)
    assert (f"Note: {tmp_path / 'model'} holds no tokenizer.model, so nothing tells whether the data's tokenizer "
            f"(vocab_size=300, sha256={sha256[:12]}..., from {run / 'tok'}) is the one its model was trained with"
            ) in capsys.readouterr().out


def test_plot_of_the_loss_by_position(tmp_path):
    pytest.importorskip("matplotlib")
    results = {"model": "gla-debug", "checkpoint": "out/final", "step": 2, "train_seq_len": 4, "lengths": [
        {"seq_len": n, "loss": 5.0, "by_position": {"start": list(range(0, n, 2)), "end": list(range(2, n + 1, 2)),
                                                     "loss": [5.0] * (n // 2)}} for n in (4, 8)]}
    assert plot_loss_by_position(results, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes().startswith(b"\x89PNG")


def test_without_max_batches_every_block_of_the_split_is_read(run, tmp_path, monkeypatch):
    """The validation split's blocks as litdata cuts them (120 of 33 tokens) in batches of 7: the last batch is short,
    and read too; the fingerprint is the sum of every block's checksum."""
    from fabric_lin.batches import batch_fingerprint

    for module in ("matplotlib", "matplotlib.figure"):  # no plot: a second of drawing that this test does not look at
        monkeypatch.setitem(sys.modules, module, None)

    blocks = torch.from_numpy(np.stack([np.frombuffer(b, dtype=np.int64) for b in litdata_blocks(run / "val", TRAIN_LEN + 1)]))
    assert len(blocks) % 7 != 0
    (length,) = evaluate(run / "out" / "final", batch_size=7, out_dir=tmp_path / "eval")["lengths"]
    assert length["tokens"] == len(blocks) * TRAIN_LEN and length["batches"] == -(-len(blocks) // 7)
    assert length["short_batches"] == 1
    assert length["data_fingerprint"] == int(batch_fingerprint(blocks))



def test_the_result_line_counts_its_batches(run, tmp_path, monkeypatch, capsys):
    """The line printed for a length says how many batches were read, and how many were short, in words that fit
    the count: the split's 120 blocks in batches of 7 are 18 batches, the last short; in one batch of 121, one batch
    that is short (where it said "1 batches of 121 (1 of them shorter: ...)")."""
    for module in ("matplotlib", "matplotlib.figure"):  # no plot: this test reads the printed line only
        monkeypatch.setitem(sys.modules, module, None)
    blocks = len(litdata_blocks(run / "val", TRAIN_LEN + 1))
    for batch_size, said in ((7, f"in {-(-blocks // 7)} batches of 7 (1 of them shorter: the split's last blocks) |"),
                             (blocks + 1, f"in 1 batch of {blocks + 1} (shorter: the split's last blocks) |")):
        capsys.readouterr()
        evaluate(run / "out" / "final", batch_size=batch_size, out_dir=tmp_path / str(batch_size))
        assert said in capsys.readouterr().out

def test_loader_workers_are_at_most_the_cores(run, tmp_path, capsys, monkeypatch):
    """A run's data.num_workers from a larger machine: evaluate starts a worker per core of this one at most."""
    import fabric_lin.cpu_cores
    from fabric_lin.data import TokenChunks

    monkeypatch.setattr(fabric_lin.cpu_cores, "usable_cpu_cores", lambda: 1)
    for module in ("matplotlib", "matplotlib.figure"):  # no plot
        monkeypatch.setitem(sys.modules, module, None)
    data = TokenChunks(data_path=run / "train", val_path=run / "val", num_workers=8)
    results = evaluate(run / "out" / "final", data=data, max_batches=1, out_dir=tmp_path / "eval")
    assert results["data"]["init_args"]["num_workers"] == 1
    assert "data.num_workers 8: 1 loader worker, one per CPU core this process may use" in capsys.readouterr().out


def test_the_validation_split_s_prepared_json_is_read_once_for_every_length(run, tmp_path, monkeypatch, prepared_json_reads):
    """Evaluated at two lengths, with the run's own data: the validation directory is checked once, its prepared.json
    read there alone (the data module was set up again for each length, and its loader checked it again)."""
    for module in ("matplotlib", "matplotlib.figure"):  # no plot
        monkeypatch.setitem(sys.modules, module, None)
    results = evaluate(run / "out" / "final", seq_len=[TRAIN_LEN, TRAIN_LEN // 2], max_batches=1, out_dir=tmp_path)
    assert [length["seq_len"] for length in results["lengths"]] == [TRAIN_LEN, TRAIN_LEN // 2]
    assert dict(prepared_json_reads) == {run / "val": 1}


def test_data_options_alone_change_the_run_s_own_data(run, tmp_path, capsys, monkeypatch):
    """`evaluate CHECKPOINT --data.num_workers 0` reads the run's own data (its hyperparameters.yaml's) with that one
    setting changed, as a --config file's data is changed by such options; so does an option of the run's data module
    (--data.val_path: the run's data_path kept, the new split read, and named as given). Without a run's data (a model
    directory) they need a data module."""
    from fabric_lin.cli import main as cli_main
    from fabric_lin.convert.pretrained_checkpoint import convert_pretrained_checkpoint

    for module in ("matplotlib", "matplotlib.figure"):  # no plot
        monkeypatch.setitem(sys.modules, module, None)
    final = run / "out" / "final"
    recorded = yaml.safe_load((final / "hyperparameters.yaml").read_text())["data"]
    cli_main(["evaluate", str(final), "--max_batches", "1", "--data.num_workers", "0", "--out_dir", str(tmp_path / "a")])
    results = json.loads((tmp_path / "a" / "evaluate.json").read_text())
    assert results["data"] == {**recorded, "init_args": {**recorded["init_args"], "num_workers": 0}}

    shutil.copytree(run / "val", tmp_path / "val")
    cli_main(["evaluate", "--max_batches", "1", "--data.val_path", str(tmp_path / "val"), str(final),
              "--out_dir", str(tmp_path / "b")])
    results = json.loads((tmp_path / "b" / "evaluate.json").read_text())
    assert results["data"] == {**recorded, "init_args": {**recorded["init_args"], "val_path": str(tmp_path / "val")}}
    err = cli_error(["evaluate", str(final), "--data.val_path", str(tmp_path / "missing"), "--out_dir", str(tmp_path / "c")],
                    capsys)
    assert f"data.val_path {tmp_path / 'missing'} does not exist" in err and "hyperparameters.yaml" not in err, err

    convert_pretrained_checkpoint(final, tmp_path / "model")
    err = cli_error(["evaluate", str(tmp_path / "model"), "--data.num_workers", "0"], capsys)
    assert "error: --data.* options need a data module: give --data SampleCorpus, LongDocuments" in err
