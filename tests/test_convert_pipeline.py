"""The whole path: a debug pretraining run's checkpoint -> convert_pretrained_checkpoint -> generate,
and pretrain --initial_checkpoint_dir starting from exactly the converted weights."""
import os
from pathlib import Path

import pytest
import torch

from fabric_lin.config import Config
from fabric_lin.convert.model_dir import load_model_dir_weights
from fabric_lin.convert.pretrained_checkpoint import convert_pretrained_checkpoint
from fabric_lin.model import GPT
from helpers import load_whole_checkpoint, pretrain_command, run_ok

pytestmark = pytest.mark.slow


def run_pretrain(out_dir: Path, *extra: str) -> None:
    args = pretrain_command(
        out_dir, "--model_name", "gla-debug",
        "--train.max_steps", "2", "--train.global_batch_size", "2", "--train.micro_batch_size", "2",
        "--train.max_seq_length", "32", "--train.lr_warmup_steps", "1", "--train.save_interval", "1",
        "--eval.max_iters", "1", "--logger_name", "csv", *extra,
    )
    run_ok(args, 600, env={**os.environ, "OMP_NUM_THREADS": "1"})


def training_checkpoint_model(checkpoint_dir: Path) -> dict:
    return load_whole_checkpoint(checkpoint_dir / "lit_model.pth")["model"]


@pytest.fixture(scope="module")
def debug_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("pretrain") / "out"
    run_pretrain(out)
    return out


def test_debug_checkpoint_converts_and_generates(debug_run, tmp_path):
    from fabric_lin.data.tokenizer import Tokenizer
    from fabric_lin.generate import main as generate

    ckpt = debug_run / "step-00000001"
    assert ckpt.is_dir() and (debug_run / "final").is_dir()
    out = tmp_path / "model"
    convert_pretrained_checkpoint(ckpt, out)
    trained = training_checkpoint_model(ckpt)
    converted = load_model_dir_weights(out)
    assert sorted(converted) == sorted(trained)
    assert all(torch.equal(converted[k], trained[k]) for k in trained)

    text = generate(out, prompt="def main", max_new_tokens=6, temperature=0.0)
    # greedy decoding recomputed with full forward passes of the training checkpoint's weights
    tokenizer = Tokenizer(ckpt)
    model = GPT(Config.from_checkpoint(ckpt)).eval()
    model.load_state_dict(trained)
    prompt = tokenizer.encode("def main").long()
    ids = torch.cat([torch.tensor([tokenizer.eos_id]), prompt])
    new = []
    with torch.no_grad():
        for _ in range(6):
            token = model(ids[None])[0, -1].argmax().item()
            new.append(token)
            if token == tokenizer.eos_id:
                break
            ids = torch.cat([ids, torch.tensor([token])])
    assert text == tokenizer.decode(prompt.tolist() + new)


def test_initial_checkpoint_dir_starts_from_the_converted_weights(debug_run, tmp_path):
    model_dir = tmp_path / "model"
    convert_pretrained_checkpoint(debug_run / "final", model_dir)
    # learning rate 0: AdamW leaves every weight as it was, so the run's checkpoint holds its start
    out = tmp_path / "continued"
    run_pretrain(out, "--initial_checkpoint_dir", str(model_dir), "--optimizer.lr", "0", "--train.min_lr", "0", "--train.max_steps", "1")
    start = training_checkpoint_model(out / "final")
    expected = load_model_dir_weights(model_dir)
    assert sorted(start) == sorted(expected)
    assert all(torch.equal(start[k], expected[k]) for k in expected)
    # and it is not the fresh init of the same seed
    torch.manual_seed(42)
    fresh = GPT(Config.from_checkpoint(model_dir)).state_dict()
    assert not torch.equal(fresh["layers.0.attn.q_proj.weight"], start["layers.0.attn.q_proj.weight"])


def test_initial_checkpoint_dir_mismatch_is_named(debug_run, tmp_path):
    model_dir = tmp_path / "model"
    convert_pretrained_checkpoint(debug_run / "final", model_dir)
    state = {k: v.clone() for k, v in load_model_dir_weights(model_dir).items()}  # the file is memory-mapped
    state["layers.0.attn.q_proj.weight"] = state["layers.0.attn.q_proj.weight"][:8]
    del state["norm.weight"]
    torch.save(state, model_dir / "lit_model.pth")
    with pytest.raises(ValueError) as info:
        load_model_dir_weights(model_dir, Config.from_checkpoint(model_dir))
    assert "missing (1): norm.weight" in str(info.value)
    assert "layers.0.attn.q_proj.weight: shape (8, 128), expected (64, 128)" in str(info.value)
