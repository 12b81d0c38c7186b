"""`fabric-lin evaluate` against independent references: the loss equals the val_loss that pretrain logged for
the same weights and batches; the loss by position (at the training length and twice it) equals a direct
cross-entropy of the model's logits over litdata's own reading of the blocks, and so do the loss, the perplexity
and the buckets of batches whose last one is short, the logits computed in pieces; the buckets by default and at
given edges; a bf16 model's loss is the fp32 cross-entropy of its logits; every kind of checkpoint gives the same loss;
the harness adapter's log-likelihoods equal log-softmax sums of a full forward pass (all three families, the rolling
one across blocks of carried state), greedy only where every continuation token is the most likely, and its
generation stops at the first stop string and samples where asked; bad input is one line. The lm-evaluation-harness run itself needs the optional extra (`pip install -e '.[eval]'`) and is skipped
without it."""
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import lightning_fabric as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml

from conftest import litdata_blocks
from fabric_lin.args import EvalArgs, TrainArgs
from fabric_lin.config import Config
from fabric_lin.errors import InvalidValue
from fabric_lin.evaluate import HarnessScorer, main as evaluate, plot_loss_by_position
from fabric_lin.model import GPT
from helpers import cli_error, write_prepared

TRAIN_LEN = 32
VAL_ITERS = 3
WORDS = "the model reads a line of text and predicts the next word of it".split()


def text_lines(n: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=rng.integers(4, 12))) for _ in range(n)]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 2-step gla-debug run with a final validation of VAL_ITERS batches on a small corpus of its own
    (a 300-piece tokenizer; 4 chunk files of 1000 tokens each for training and for validation)."""
    from fabric_lin.data import TokenChunks, Tokenizer
    from fabric_lin.data.train_tokenizer import main as train_tokenizer
    from fabric_lin.pretrain import setup

    root = tmp_path_factory.mktemp("evaluate")
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


def final_weights(run: Path) -> GPT:
    """The model of the run's final checkpoint, read without evaluate's loader."""
    checkpoint = torch.load(run / "out" / "final" / "lit_model.pth", weights_only=False)
    model = GPT(Config.from_checkpoint(run / "out" / "final"))
    model.load_state_dict(checkpoint["model"])
    return model.eval()


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
    results = [json.loads(path.read_text())["lengths"][0] for path in sorted(Path("checkpoints").glob("**/evaluate.json"))]
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


# ---------------------------------------------------------------- bad input: one line, exit code 2


def test_errors_are_one_line(run, tmp_path, capsys, monkeypatch):
    final = run / "out" / "final"
    (tmp_path / "empty").mkdir()
    assert "empty is not a checkpoint: it holds none of lit_model.pth" in cli_error(["evaluate", str(tmp_path / "empty")], capsys)
    assert "pass one of them" in cli_error(["evaluate", str(run / "out")], capsys)

    damaged = tmp_path / "run" / "final"
    shutil.copytree(final, damaged)
    with open(damaged / "lit_model.pth", "r+b") as f:
        f.seek(2000)
        byte = f.read(1)
        f.seek(2000)
        f.write(b"\x00" if byte != b"\x00" else b"\x01")
    assert "the checkpoint is damaged: lit_model.pth's bytes changed since it was written" in cli_error(
        ["evaluate", str(damaged)], capsys)

    from fabric_lin.convert.pretrained_checkpoint import convert_pretrained_checkpoint

    convert_pretrained_checkpoint(final, tmp_path / "model")
    assert "is a model directory, which names no validation data" in cli_error(["evaluate", str(tmp_path / "model")], capsys)
    err = cli_error(["evaluate", str(tmp_path / "model"), "--data", "TokenChunks", "--data.data_path", str(run / "train"),
                     "--data.num_workers", "0"], capsys)
    assert "TokenChunks gives no validation data" in err
    assert "--seq_len must be a positive number" in cli_error(["evaluate", str(final), "--seq_len", "[32, 0]"], capsys)
    assert "--bucket_edges must be a list of increasing positive positions" in cli_error(
        ["evaluate", str(final), "--bucket_edges", "[16, 8]"], capsys)
    assert "--bucket_size and --bucket_edges both set the buckets" in cli_error(
        ["evaluate", str(final), "--bucket_edges", "[8]", "--bucket_size", "4"], capsys)
    # blocks longer than the data's chunk files (1000 tokens): the fix names evaluate's option, not pretrain's
    err = cli_error(["evaluate", str(final), "--seq_len", "1000"], capsys)
    assert "--seq_len=1000 is too long" in err and "lower --seq_len or prepare" in err and "train.max_seq_length" not in err
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    monkeypatch.setitem(sys.modules, "lm_eval.tasks", None)
    assert "--tasks needs lm-evaluation-harness: pip install -e '.[eval]'" in cli_error(
        ["evaluate", str(final), "--tasks", "hellaswag"], capsys)
    assert not (tmp_path / "model" / "evaluate").exists()  # failed runs leave no output directory


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


def test_arguments_are_checked_and_the_lengths_and_tasks_listed_once(tmp_path):
    from fabric_lin.evaluate import check_arguments, run_data_module, task_list

    assert check_arguments([64, 32, 64], None, None, None, None, None, None) == [64, 32]
    for arguments, refused in (((True,) + (None,) * 6, "--seq_len must be a positive number"),
                               ((None, -1) + (None,) * 5, "--max_batches must be 0"),
                               ((None,) * 5 + (-1, None), "--num_fewshot must be 0 or more")):
        with pytest.raises(InvalidValue, match=refused):
            check_arguments(*arguments)
    assert task_list(" hellaswag , arc_easy") == task_list(["hellaswag", "arc_easy"]) == ["hellaswag", "arc_easy"]
    # a checkpoint's hyperparameters.yaml names a module: only fabric-lin's data modules are imported
    with pytest.raises(InvalidValue, match=r"data.class_path mypackage.Data is not one of fabric-lin's data modules"):
        run_data_module({"data": {"class_path": "mypackage.Data", "init_args": {}}}, tmp_path / "hyperparameters.yaml")


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


def test_out_dir_inside_the_training_checkpoint_is_one_line(run, tmp_path, capsys):
    """A training checkpoint's files are the ones its manifest lists: results written among them would go with it when
    the run prunes or replaces it, and a copy of the checkpoint would carry them."""
    final = run / "out" / "final"
    files_before = sorted(p.name for p in final.iterdir())
    for out_dir in (final, final / "evaluate", final / ".." / "final"):
        err = cli_error(["evaluate", str(final), "--max_batches", "1", "--out_dir", str(out_dir)], capsys)
        assert err == (f"fabric-lin evaluate: error: --out_dir {out_dir} is inside the training checkpoint {final}, whose "
                       f"files are the ones its manifest lists: give a directory outside it, or leave --out_dir out for "
                       f"{run / 'out' / 'evaluate' / 'final'}\n")
    assert sorted(p.name for p in final.iterdir()) == files_before


def test_an_unfinished_checkpoint_given_as_the_current_directory_is_one_line(run, tmp_path, capsys, monkeypatch):
    """`.` inside a `.tmp-` directory (a checkpoint still being written, its manifest already there) is as unfinished
    as the directory named by its path."""
    unfinished = tmp_path / ".tmp-step-00000004"
    shutil.copytree(run / "out" / "final", unfinished)
    monkeypatch.chdir(unfinished)
    err = cli_error(["evaluate", ".", "--max_batches", "1"], capsys)
    assert err == "fabric-lin evaluate: error: . is an unfinished checkpoint (a `.tmp-` directory is renamed when complete)\n"
    assert not (tmp_path / "evaluate").exists()


def test_an_empty_length_list_is_one_line(run, capsys):
    """--seq_len [] (evaluated at the training length, as if not given). (--data.num_workers without --data and without
    a run's data: test_data_options_alone_change_the_run_s_own_data.)"""
    final = run / "out" / "final"
    err = cli_error(["evaluate", str(final), "--seq_len", "[]"], capsys)
    assert "--seq_len [] holds no length: give one or more, e.g. [2048, 4096], or leave it out for the training length" in err


def test_the_run_s_data_moved_away_is_named_with_the_file_that_names_it(run, capsys):
    """Without --data a training checkpoint reads the data its hyperparameters.yaml names; moved since, the error says
    so and points to --data, not to what the run's own command should have given."""
    final = run / "out" / "final"
    (run / "val").rename(run / "val-moved")
    try:
        err = cli_error(["evaluate", str(final)], capsys)
        # the run's data read with another worker count is the run's data still
        assert cli_error(["evaluate", str(final), "--data.num_workers", "0"], capsys) == err
    finally:
        (run / "val-moved").rename(run / "val")
    assert err == (f"fabric-lin evaluate: error: {run / 'val'} does not exist: {final / 'hyperparameters.yaml'} names it "
                   "as the run's data (TokenChunks); give --data to read the data where it is now, e.g. --data TokenChunks "
                   "--data.<option> DIR\n"), err


def test_the_run_s_own_data_is_named_with_its_hyperparameters_yaml_not_as_data_given(run, tmp_path, capsys):
    """Without --data, a fault of the run's data module (its validation directory prepared again with another
    tokenizer; no validation split at all) is told as the run's, with the hyperparameters.yaml that names it: the
    errors began "--data:" or named no origin, as if the user had given --data."""
    import yaml

    from fabric_lin.checkpoint import HPARAMS_FILE, MANIFEST_FILE, file_checksum
    from fabric_lin.data import Tokenizer
    from helpers import train_sentencepiece

    final = run / "out" / "final"
    train_sentencepiece(tmp_path / "other", vocab_size=100)
    other = Tokenizer(tmp_path / "other")
    (run / "val").rename(run / "val-kept")
    try:
        write_prepared(run / "val", np.arange(2000, dtype=np.uint16) % 100, other)
        err = cli_error(["evaluate", str(final), "--out_dir", str(tmp_path / "results")], capsys)
    finally:
        shutil.rmtree(run / "val", ignore_errors=True)
        (run / "val-kept").rename(run / "val")
    assert err == (
        f"fabric-lin evaluate: error: the run's data (TokenChunks, from {final / HPARAMS_FILE}): {run / 'val'} was "
        f"tokenized with vocab_size=100, sha256={other.model_hash[:12]}..., from {tmp_path / 'other'}, and the weights "
        f"of {final} were trained on the ids of {Tokenizer(final).describe()}: an id is another piece in each; evaluate "
        f"on data prepared with the model's tokenizer (--tokenizer_path {final}), given with --data\n"), err

    # the same checkpoint, its run's data without a validation split (its manifest rewritten to match)
    no_validation = tmp_path / "no_validation" / "final"
    shutil.copytree(final, no_validation)
    hparams = yaml.safe_load((no_validation / HPARAMS_FILE).read_text())
    hparams["data"]["init_args"]["val_path"] = None
    (no_validation / HPARAMS_FILE).write_text(yaml.safe_dump(hparams))
    manifest = json.loads((no_validation / MANIFEST_FILE).read_text())
    manifest["files"][HPARAMS_FILE] = file_checksum(no_validation / HPARAMS_FILE)
    (no_validation / MANIFEST_FILE).write_text(json.dumps(manifest))
    err = cli_error(["evaluate", str(no_validation)], capsys)
    assert err == (
        f"fabric-lin evaluate: error: the run's data (TokenChunks, from {no_validation / HPARAMS_FILE}) has no validation "
        f"split, which evaluate reads: give --data with one (TextFiles --data.val_dir DIR, TokenChunks --data.val_path "
        f"DIR, SlimPajamaStarcoder --data.validation true)\n"), err


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


def test_an_earlier_evaluation_in_out_dir_is_kept_unless_overwrite(run, tmp_path, capsys, monkeypatch):
    """A second evaluation into the out_dir of a first is refused before the model is built, naming the file and the
    two ways on; the first's results stay. With --overwrite true it replaces them, whole: a write cut short (Ctrl-C)
    leaves the earlier file as it was and no partial one beside it."""
    import fabric_lin.evaluate

    for module in ("matplotlib", "matplotlib.figure"):  # no plot: this test does not look at it
        monkeypatch.setitem(sys.modules, module, None)
    final, out = run / "out" / "final", tmp_path / "eval"
    evaluate(final, max_batches=1, out_dir=out)
    first = (out / "evaluate.json").read_bytes()
    with monkeypatch.context() as patch:
        patch.setattr(fabric_lin.evaluate, "build_model", lambda *args: pytest.fail("the model was built"))
        err = cli_error(["evaluate", str(final), "--max_batches", "2", "--out_dir", str(out)], capsys)
    assert err == (f"fabric-lin evaluate: error: {out / 'evaluate.json'} holds the results of an earlier evaluation: "
                   "write this one to another --out_dir, or replace them with --overwrite true\n"), err
    assert (out / "evaluate.json").read_bytes() == first

    def interrupted(written, path):  # Ctrl-C with the new results written, before they take the place of the first
        assert Path(written).stat().st_size > 0
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(os, "replace", interrupted)
        with pytest.raises(KeyboardInterrupt):
            evaluate(final, max_batches=2, out_dir=out, overwrite=True)
    assert (out / "evaluate.json").read_bytes() == first and sorted(p.name for p in out.iterdir()) == ["evaluate.json"]
    (out / "loss_by_position.png").write_bytes(b"an earlier evaluation's plot")  # not these results': removed
    second = evaluate(final, max_batches=2, out_dir=out, overwrite=True)
    assert not (out / "loss_by_position.png").exists()
    assert second["lengths"][0]["batches"] == 2
    assert json.loads((out / "evaluate.json").read_text()) == json.loads(json.dumps(second))


def test_data_of_another_tokenizer_names_the_models_tokenizer_to_prepare_it_with(run, tmp_path, capsys):
    """A model directory evaluated on data prepared with another tokenizer: one line naming both and the --tokenizer_path
    to prepare it with, as without its tokenizer.model, where it gave pretrain's fix ("or use the one that made it"),
    which evaluate, reading the model's tokenizer, has no way to take."""
    from fabric_lin.convert.pretrained_checkpoint import convert_pretrained_checkpoint
    from fabric_lin.data import Tokenizer
    from helpers import train_sentencepiece

    convert_pretrained_checkpoint(run / "out" / "final", tmp_path / "model")
    train_sentencepiece(tmp_path / "other", vocab_size=100)
    other = Tokenizer(tmp_path / "other")
    write_prepared(tmp_path / "val", np.arange(2000, dtype=np.uint16) % 100, other)
    err = cli_error(["evaluate", str(tmp_path / "model"), "--data", "TokenChunks", "--data.val_path", str(tmp_path / "val"),
                     "--seq_len", str(TRAIN_LEN)], capsys)
    assert err == (
        f"fabric-lin evaluate: error: --data: {tmp_path / 'val'} was tokenized with vocab_size=100, "
        f"sha256={other.model_hash[:12]}..., from {tmp_path / 'other'}, and the weights of {tmp_path / 'model'} were "
        f"trained on the ids of {Tokenizer(tmp_path / 'model').describe()}: an id is another piece in each; evaluate on "
        f"data prepared with the model's tokenizer (--tokenizer_path {tmp_path / 'model'})\n")
    assert not (tmp_path / "model" / "evaluate").exists()


def test_a_tokenizer_with_more_pieces_than_the_model_has_embeddings_is_one_line(run, tmp_path, capsys, harness_with_hellaswag):
    """A model directory whose tokenizer.model is not its model's (300 pieces beside 256 embeddings): evaluate (with
    --tasks, or with data of that tokenizer) and generate refuse it in one line before any text is encoded or data read
    (an id past 255 has no embedding). Without a tokenizer.model, data of the larger vocabulary is refused naming the
    model directory, whichever data module reads it. Evaluated on data, both were refused with pretrain's fix: a model
    config of a larger vocab_size."""
    from fabric_lin.convert.model_dir import save_model_dir

    config = Config.from_name("gla-debug", vocab_size=256)
    (tmp_path / "model").mkdir()
    save_model_dir(GPT(config).state_dict(), config, tmp_path / "model", tokenizer_dir=run / "tok")
    expected = f"{tmp_path / 'model'}: its tokenizer has 300 pieces and its model 256 embeddings"
    assert expected in cli_error(["evaluate", str(tmp_path / "model"), "--tasks", "hellaswag"], capsys)
    assert expected in cli_error(["generate", str(tmp_path / "model"), "--prompt", "a"], capsys)
    data = ["--data", "TokenChunks", "--data.val_path", str(run / "val"), "--max_batches", "1"]
    assert expected in cli_error(["evaluate", str(tmp_path / "model"), *data], capsys)
    for name in ("tokenizer.model", "tokenizer_config.json", "trained_with.json"):
        (tmp_path / "model" / name).unlink()
    for data in (data, ["--data", "TextFiles", "--data.val_dir", str(run / "val"), "--max_batches", "1"]):
        assert cli_error(["evaluate", str(tmp_path / "model"), *data], capsys) == (
            f"fabric-lin evaluate: error: {run / 'val'} was tokenized with a vocabulary of 300 tokens (prepared.json), more "
            f"than the 256 embeddings of the model of {tmp_path / 'model'}: its ids are not those of the tokenizer the "
            "model was trained with; evaluate on data prepared with that tokenizer\n")
    assert not (tmp_path / "model" / "evaluate").exists()


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


def evaluate_in_subprocess(run: Path, tmp_path: Path, *options: str) -> subprocess.CompletedProcess:
    """`fabric-lin evaluate` of the run's final checkpoint with the tasks of `write_tasks`, into tmp_path/out, offline."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_OFFLINE": "1",
           "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1])] + sys.path)}
    return subprocess.run(
        [sys.executable, "-m", "fabric_lin.cli", "evaluate", str(run / "out" / "final"), *options,
         "--task_dir", str(tmp_path / "tasks"), "--out_dir", str(tmp_path / "out")],
        capture_output=True, text=True, env=env, timeout=600,
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


@pytest.mark.slow
def test_unknown_task_name_is_one_line(run, capsys):
    pytest.importorskip("lm_eval")
    err = cli_error(["evaluate", str(run / "out" / "final"), "--tasks", "hellaswagg"], capsys)
    assert "lm-evaluation-harness has no task, group or tag named 'hellaswagg' (did you mean hellaswag" in err


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


def test_harness_options_without_tasks_are_one_line(run, capsys):
    final = run / "out" / "final"
    for option, value in (("--limit", "5"), ("--num_fewshot", "2"), ("--task_dir", str(run))):
        err = cli_error(["evaluate", str(final), option, value], capsys)
        assert f"error: {option} set how lm-evaluation-harness runs its tasks, and no --tasks is given: give --tasks, " \
               f"or leave {option} out\n" in err, err


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
    err = cli_error(["evaluate", str(final), "--data.val_path", str(tmp_path / "missing")], capsys)
    assert f"data.val_path {tmp_path / 'missing'} does not exist" in err and "hyperparameters.yaml" not in err, err

    convert_pretrained_checkpoint(final, tmp_path / "model")
    err = cli_error(["evaluate", str(tmp_path / "model"), "--data.num_workers", "0"], capsys)
    assert "error: --data.* options need a data module: give --data SampleCorpus, LongDocuments" in err


@pytest.mark.slow
def test_too_few_few_shot_examples_keep_the_data_s_results_and_are_one_line(run, tmp_path):
    """--num_fewshot 5 of a task of 4 documents (its few-shot examples from them): the harness fails after the data
    evaluation. The data's results are kept in evaluate.json, equal to those of the data alone, the task marked
    failed, and the error is one line naming the task, --num_fewshot and how many examples the task has."""
    pytest.importorskip("lm_eval")
    write_tasks(tmp_path)
    proc = evaluate_in_subprocess(run, tmp_path, "--max_batches", "1", "--tasks", "tiny_choice", "--num_fewshot", "5")
    failed = "--num_fewshot 5: task tiny_choice has 4 few-shot examples: give --num_fewshot 4 or fewer"
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.endswith(f"fabric-lin evaluate: error: {failed}; the data's results are in "
                                f"{tmp_path / 'out' / 'evaluate.json'}\n"), proc.stderr[-3000:]
    results = json.loads((tmp_path / "out" / "evaluate.json").read_text())
    assert results["tasks"] == {"failed": failed}
    alone = evaluate(run / "out" / "final", max_batches=1, out_dir=tmp_path / "alone")
    assert results["lengths"][0]["loss"] == alone["lengths"][0]["loss"]
    assert evaluate_in_subprocess(run, tmp_path, "--max_batches", "1", "--tasks", "tiny_choice", "--num_fewshot", "4",
                                  "--overwrite", "true").returncode == 0
