"""The pretraining loop through `setup` and the `fabric-lin pretrain` command line: its option groups,
the errors it gives before any work, the learning-rate schedule, batch arithmetic, document
boundaries, FLOPs, model init and the CLI's typing of `data` (the checkpoint format: test_checkpoint.py)."""
import json
import math
import os
from pathlib import Path

import lightning as L
import pytest
import torch

from fabric_lin.args import CompileArgs, EvalArgs, OptimizerArgs, ParallelismArgs, TrainArgs
from fabric_lin.config import Config
from fabric_lin.errors import UserError
from fabric_lin.flops import flops_per_token, matmul_params
from fabric_lin.lr_schedule import learning_rate
from fabric_lin.model import GPT
from fabric_lin.batches import doc_boundaries
from fabric_lin.pretrain import build_model, no_decay_parameter_names
from fabric_lin.weights import canonical_name
from fabric_lin.stopping import StepFlags
from conftest import litdata_blocks, logged_data_fingerprints


def test_cosine_schedule_values():
    kw = dict(base_lr=1e-3, min_lr=1e-4, warmup_steps=10, max_steps=110, schedule="cosine")
    assert learning_rate(0, **kw) == pytest.approx(1e-4)  # (0 + 1) / 10 of the peak
    assert learning_rate(9, **kw) == pytest.approx(1e-3)
    assert learning_rate(10, **kw) == pytest.approx(1e-3)  # decay starts at the peak
    # halfway through the decay the cosine is at the midpoint of base and min
    assert learning_rate(60, **kw) == pytest.approx(0.5 * (1e-3 + 1e-4))
    assert learning_rate(110, **kw) == pytest.approx(1e-4)
    assert learning_rate(500, **kw) == pytest.approx(1e-4)  # clamped past the end


def test_wsd_schedule_values():
    # flame: stable part = 90% of max_steps including the warmup, decay = last 10%
    kw = dict(base_lr=3e-4, min_lr=3e-5, warmup_steps=10, max_steps=200, schedule="wsd", decay_fraction=0.1)
    assert learning_rate(4, **kw) == pytest.approx(3e-4 * 5 / 10)
    assert learning_rate(10, **kw) == pytest.approx(3e-4)
    assert learning_rate(179, **kw) == pytest.approx(3e-4)
    assert learning_rate(180, **kw) == pytest.approx(3e-4)  # decay starts at 180 = 0.9 * 200
    assert learning_rate(190, **kw) == pytest.approx(3e-4 - (3e-4 - 3e-5) * 0.5)
    assert learning_rate(200, **kw) == pytest.approx(3e-5)


def test_unknown_schedule_is_named():
    with pytest.raises(ValueError, match="'linear'"):
        learning_rate(100, 1e-3, 1e-4, 10, 200, schedule="linear")


@pytest.mark.parametrize("key,value", [("micro_batch_size", 0), ("global_batch_size", -4), ("max_seq_length", 0),
                                       ("max_nonfinite_steps", 0), ("lr_warmup_steps", -1)])
def test_bad_train_sizes_are_named(key, value):
    train = TrainArgs(global_batch_size=8, micro_batch_size=2, max_steps=3)
    setattr(train, key, value)
    with pytest.raises(ValueError, match=rf"train\.{key} must be at least \d, got {value}"):
        train.gradient_accumulation_iters(devices=1, num_nodes=1)


def test_gradient_accumulation_arithmetic():
    # flame's 340M recipe: 32 sequences per GPU x 8 GPUs = 256 sequences of 2048 = 524,288 tokens
    train = TrainArgs(global_batch_size=256, micro_batch_size=8, max_tokens=10_737_418_240, max_seq_length=2048)
    assert train.gradient_accumulation_iters(devices=8, num_nodes=1) == 4
    assert train.gradient_accumulation_iters(devices=8, num_nodes=4) == 1
    assert train.total_steps() == 20480
    with pytest.raises(ValueError, match=r"global_batch_size=256 .* train.micro_batch_size \(8\) x devices \(6\)"):
        train.gradient_accumulation_iters(devices=6, num_nodes=1)


def test_max_tokens_and_max_steps_exclusive():
    with pytest.raises(ValueError, match="exactly one of train.max_tokens"):
        TrainArgs(max_tokens=10, max_steps=10).total_steps()
    with pytest.raises(ValueError, match="max_tokens=100 is less than one optimizer step"):
        TrainArgs(max_tokens=100, global_batch_size=2, max_seq_length=64).total_steps()


def test_doc_boundaries_against_python_reference():
    eos = 2
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 50, (3, 17), generator=g)
    ids[0, 4] = ids[0, 16] = ids[2, 0] = ids[2, 9] = eos
    expected = {0}
    flat = ids.flatten().tolist()
    for i, t in enumerate(flat):  # a document starts at each row start and after each EOS
        if i % 17 == 0:
            expected.add(i)
        if t == eos:
            expected.add(i + 1)
    expected.add(len(flat))
    got = doc_boundaries(ids, eos)
    assert got.dtype == torch.int32
    assert got.tolist() == sorted(expected)


def test_packed_loss_equals_per_document_losses():
    """cu_seqlens from EOS positions: the packed forward gives each document the loss it gets alone."""
    torch.manual_seed(0)
    model = GPT(Config.from_name("gla-debug", num_layers=1, vocab_size=64))
    eos = 2
    ids = torch.randint(3, 64, (2, 12))
    ids[0, 5] = eos  # row 0 = doc A (6 tokens incl. EOS) + doc B (6 tokens); row 1 = doc C
    targets = torch.randint(3, 64, (2, 12))
    from fabric_lin.batches import compute_loss

    packed = compute_loss(model, ids, targets, eos)
    pieces = [(ids[:1, :6], targets[:1, :6]), (ids[:1, 6:], targets[:1, 6:]), (ids[1:], targets[1:])]
    total = sum(model(x, targets=t) * t.numel() for x, t in pieces)
    torch.testing.assert_close(packed, total / targets.numel(), rtol=1e-5, atol=1e-5)


def test_batch_fingerprint_sums_per_sample_checksums():
    """Samples are told apart by their tokens and the tokens' order within them; which micro-batch or
    process (row order, split) a sample came in does not change the step's sum."""
    from fabric_lin.batches import batch_fingerprint

    batch = torch.arange(24).view(2, 12)
    reference = batch_fingerprint(batch)
    assert batch_fingerprint(batch.flip(0)) == reference  # rows in another order
    assert batch_fingerprint(batch[:1]) + batch_fingerprint(batch[1:]) == reference  # split over micro-batches
    changed = batch.clone()
    changed[1, 3] += 1
    assert batch_fingerprint(changed) != reference
    assert batch_fingerprint(batch.flip(1)) != reference  # tokens in another order within the samples
    swapped = batch.clone()
    swapped[0, 5], swapped[1, 5] = batch[1, 5], batch[0, 5]  # a token moved from one sample to the other
    assert batch_fingerprint(swapped) != reference
    assert batch_fingerprint(batch.to(torch.int32)) == reference  # stored dtype does not matter


def test_matmul_params_equal_the_models_matrices():
    for name in ("gla-debug", "transformer-debug", "gla-340M"):
        config = Config.from_name(name)
        with torch.device("meta"):
            model = GPT(config)
        # every Linear weight is one multiply-add per token; the embedding is a lookup
        expected = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
        assert matmul_params(config) == expected, name


def test_flops_per_token_gla_340m():
    config = Config.from_name("gla-340M")
    # independent arithmetic for d=1024, 24 layers, 4 heads of K=128, V=256, chunk 64, vocab 32000
    per_layer = 1024 * 512 * 2 + 1024 * 1024 * 2 + 1024 * 16 + 16 * 512 + 1024 * 1024 + 3 * 1024 * 2816
    n = 24 * per_layer + 1024 * 32000
    attention = 24 * 4 * (2 * 64 * (128 + 256) + 4 * 128 * 256)
    assert flops_per_token(config, 2048) == 3 * (2 * n + attention)
    t = Config.from_name("transformer-340M")
    assert flops_per_token(t, 2048) == 3 * (2 * matmul_params(t) + 24 * 4 * 2048 * 1024)


def test_empty_init_then_reset_equals_eager_build():
    fabric = L.Fabric(accelerator="cpu", devices=1, precision="32-true")
    config = Config.from_name("gla-debug", num_layers=2)
    model, no_decay = build_model(fabric, config, seed=123)
    torch.manual_seed(123)
    eager = GPT(config)
    got = model.state_dict()
    for key, value in eager.state_dict().items():
        assert torch.equal(got[key], value), key
    assert "layers.0.attn_norm.weight" in no_decay and "layers.0.attn.gk_proj.1.bias" in no_decay
    assert "layers.0.attn.q_proj.weight" not in no_decay and "embeddings.weight" not in no_decay


def test_no_decay_names_survive_wrappers():
    assert canonical_name("_forward_module._orig_mod.layers.0._fsdp_wrapped_module.mlp_norm.weight") == "layers.0.mlp_norm.weight"
    model = GPT(Config.from_name("gla-debug", num_layers=1))
    names = no_decay_parameter_names(model)
    assert names == {n for n, p in model.named_parameters() if p.ndim == 1}


def test_cli_accepts_data_module_subclass_and_rejects_unknown_keys(capsys):
    """`--data TokenChunks --data.data_path X` is parsed into the data module; a wrong key is named."""
    from jsonargparse import ArgumentParser

    from fabric_lin.data import DataModule, TokenChunks
    from fabric_lin.pretrain import setup  # noqa: F401  (enables data module subclasses)

    parser = ArgumentParser()
    parser.add_argument("--data", type=DataModule)
    cfg = parser.parse_args(["--data", "TokenChunks", "--data.data_path", "/some/dir", "--data.num_workers", "0"])
    data = parser.instantiate(cfg).data
    assert isinstance(data, TokenChunks) and str(data.data_path) == "/some/dir" and data.num_workers == 0
    with pytest.raises(SystemExit):
        parser.parse_args(["--data", "TokenChunks", "--data.no_such_key", "1"])
    assert "no_such_key" in capsys.readouterr().err


def test_cli_lists_the_valid_keys_of_a_nested_class(tmp_path, capsys):
    """An unknown key inside model_config: or a data module is named with the keys the class accepts."""
    from fabric_lin.cli import main as cli_main

    config = tmp_path / "run.yaml"
    config.write_text("model_config:\n  hiden_size: 128\n")
    with pytest.raises(SystemExit):
        cli_main(["pretrain", "--config", str(config), "--out_dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert "fabric_lin.config.Config has no option 'hiden_size'; valid options are: name, block_type, vocab_size, hidden_size," in err
    with pytest.raises(SystemExit):
        cli_main(["pretrain", "--model_name", "gla-debug", "--data", "SampleCorpus", "--data.sede", "3"])
    assert "fabric_lin.data.SampleCorpus has no option 'sede'; valid options are: seed, num_workers," in capsys.readouterr().err


def test_eval_args_defaults_are_litgpt_like():
    e = EvalArgs()
    assert (e.interval, e.max_iters, e.initial_validation, e.final_validation) == (1000, 100, False, True)
    assert math.isclose(TrainArgs().max_norm, 1.0)


CONFIG_HUB = Path(__file__).resolve().parents[1] / "config_hub"


def parse_run_config(path: Path):
    """Parse a config_hub YAML exactly as `fabric-lin pretrain --config` does, without running it."""
    from jsonargparse import ArgumentParser

    from fabric_lin.pretrain import setup

    parser = ArgumentParser(exit_on_error=False)
    parser.add_function_arguments(setup)
    parser.add_argument("--config", action="config")
    return parser.instantiate(parser.parse_args(["--config", str(path)]))


@pytest.mark.parametrize("name", ["gla_340M", "transformer_340M", "gla_1B", "gla_7B"])
def test_config_hub_recipes(name):
    cfg = parse_run_config(CONFIG_HUB / f"{name}.yaml")
    train, opt = cfg.train, cfg.optimizer
    # flame's batch: 256 sequences of 2048 tokens = 524,288 tokens per optimizer step, on 8 GPUs
    assert train.global_batch_size * train.max_seq_length == 524_288
    train.gradient_accumulation_iters(devices=8, num_nodes=1)  # divides exactly on one 8-GPU node
    assert tuple(opt.betas) == (0.9, 0.95) and opt.weight_decay == 0.01 and train.max_norm == 1.0
    assert train.min_lr == pytest.approx(0.1 * opt.lr)  # cosine to 10%
    Config.from_name(cfg.model_name)
    if name.endswith("340M"):
        assert (train.total_steps(), train.lr_warmup_steps, opt.lr) == (20480, 1024, 3e-4)
        assert type(cfg.data).__name__ == "SlimPajamaStarcoder" and cfg.data.use_starcoder


def test_config_hub_debug_runs_on_cpu_defaults():
    cfg = parse_run_config(CONFIG_HUB / "debug.yaml")
    assert cfg.model_name == "gla-debug" and type(cfg.data).__name__ == "SampleCorpus"
    assert cfg.precision == "32-true" and cfg.compile.enabled is False and cfg.devices == 1
    assert cfg.train.gradient_accumulation_iters(1, 1) == 2


# ---- errors before any training step: each names the offending value


def _setup(tmp_path, **kwargs):
    from fabric_lin.pretrain import setup

    defaults = dict(
        model_name="gla-debug", out_dir=tmp_path / "out", logger_name="csv", devices=1,
        train=TrainArgs(global_batch_size=2, micro_batch_size=2, max_steps=1, max_seq_length=32),
    )
    setup(**{**defaults, **kwargs})


def test_error_unknown_model_name_suggests_close_names(tmp_path):
    with pytest.raises(ValueError, match=r"Unknown model name 'gla-340m'.*Did you mean 'gla-340M'"):
        _setup(tmp_path, model_name="gla-340m")


def test_error_batch_not_divisible(tmp_path):
    with pytest.raises(ValueError, match=r"global_batch_size=6 .*micro_batch_size \(4\) x devices \(1\)"):
        _setup(tmp_path, train=TrainArgs(global_batch_size=6, micro_batch_size=4, max_steps=1))
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_error_cuda_graphs_need_one_gpu(tmp_path, monkeypatch):
    graphs = CompileArgs(mode="reduce-overhead")
    with pytest.raises(ValueError, match=r"compile.mode 'reduce-overhead' \(CUDA graphs\) needs one CUDA GPU and "
                       r"compile.enabled true; got cuda=False, compile.enabled=False, devices=1, num_nodes=1"):
        _setup(tmp_path, compile=graphs)
    with pytest.raises(ValueError, match=r"compile.mode must be 'auto', 'default' or 'reduce-overhead', got 'max-autotune'"):
        _setup(tmp_path, compile=CompileArgs(mode="max-autotune"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # refused before any GPU work
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"needs one CUDA GPU and compile.enabled true; got cuda=True, compile.enabled=True, devices=2"):
        _setup(tmp_path, compile=graphs, devices=2,
               train=TrainArgs(global_batch_size=4, micro_batch_size=2, max_steps=1, max_seq_length=32))
    with pytest.raises(ValueError, match=r"needs one CUDA GPU and compile.enabled true; got cuda=True, compile.enabled=False, devices=1"):
        _setup(tmp_path, compile=CompileArgs(enabled=False, mode="reduce-overhead"))
    with pytest.raises(ValueError, match="cannot be used with reset_state_at_doc_boundaries"):
        _setup(tmp_path, compile=graphs, reset_state_at_doc_boundaries=True)
    assert not (tmp_path / "out").exists()


def test_error_more_devices_than_gpus(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(ValueError, match=r"--devices 8: this machine has 2 CUDA GPU\(s\) \(CUDA_VISIBLE_DEVICES=0,1\); "
                       r"give --devices 2 or fewer"):
        _setup(tmp_path, devices=8)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("cuda,enabled,devices,num_nodes,reset,mode", [
    (True, None, 1, 1, False, "reduce-overhead"),  # one GPU, compile on by default with CUDA
    (True, True, 2, 1, False, "default"),
    (True, True, 1, 2, False, "default"),
    (True, False, 1, 1, False, "default"),
    (False, True, 1, 1, False, "default"),
    (False, None, 1, 1, False, "default"),  # compile off by default on the CPU
    (True, True, 1, 1, True, "default"),
])
def test_compile_mode_auto_picks_cuda_graphs_only_where_they_can_run(cuda, enabled, devices, num_nodes, reset, mode):
    resolved = CompileArgs(enabled=enabled, mode="auto").resolve(cuda, devices, num_nodes, reset)
    assert resolved.mode == mode and resolved.enabled is (cuda if enabled is None else enabled)
    assert resolved.cuda_graphs is (mode == "reduce-overhead")
    # an explicit mode is kept where it can run
    assert CompileArgs(enabled=enabled, mode="default").resolve(cuda, devices, num_nodes, reset).mode == "default"


def test_strategy_for_each_data_parallel_choice():
    from lightning.fabric.strategies import DDPStrategy, FSDPStrategy
    from torch.distributed.fsdp import ShardingStrategy

    from fabric_lin.pretrain import make_strategy

    assert make_strategy(cuda=True, devices=1, num_nodes=1, parallelism=ParallelismArgs(data_parallel="ddp")) == "auto"
    cpu = make_strategy(cuda=False, devices=2, num_nodes=1, parallelism=ParallelismArgs(data_parallel="fsdp"))
    assert isinstance(cpu, DDPStrategy) and cpu._process_group_backend == "gloo"
    ddp = make_strategy(cuda=True, devices=2, num_nodes=1, parallelism=ParallelismArgs(data_parallel="ddp"))
    assert type(ddp) is DDPStrategy and ddp._process_group_backend == "nccl"
    assert ddp._ddp_kwargs["gradient_as_bucket_view"] is True
    fsdp = make_strategy(cuda=True, devices=2, num_nodes=2, parallelism=ParallelismArgs(fsdp_reshard_after_forward=False))
    assert isinstance(fsdp, FSDPStrategy) and fsdp.sharding_strategy == ShardingStrategy._HYBRID_SHARD_ZERO2
    assert make_strategy(cuda=True, devices=2, num_nodes=1).sharding_strategy == ShardingStrategy.HYBRID_SHARD
    assert make_strategy(cuda=True, devices=2, num_nodes=1)._fsdp_kwargs["auto_wrap_policy"] is not None
    whole = make_strategy(cuda=True, devices=2, num_nodes=1, parallelism=ParallelismArgs(fsdp_unit="model"))
    assert "auto_wrap_policy" not in whole._fsdp_kwargs  # one unit: the root module
    checkpointed = make_strategy(cuda=True, devices=2, num_nodes=1, parallelism=ParallelismArgs(activation_checkpointing=True))
    assert checkpointed._activation_checkpointing_kwargs and not make_strategy(True, 2, 1)._activation_checkpointing_kwargs


def test_error_data_parallel_choice(tmp_path):
    with pytest.raises(ValueError, match=r"parallelism.data_parallel must be 'fsdp' or 'ddp', got 'zero3'"):
        _setup(tmp_path, parallelism=ParallelismArgs(data_parallel="zero3"))
    with pytest.raises(ValueError, match=r"parallelism.fsdp_unit must be 'block' or 'model', got 'layer'"):
        _setup(tmp_path, parallelism=ParallelismArgs(fsdp_unit="layer"))
    assert not (tmp_path / "out").exists()


def test_error_out_dir_not_writable(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(UserError, match=f"out_dir {blocker / 'out'} is not writable"):
        _setup(tmp_path, out_dir=blocker / "out")


def test_error_out_dir_full(tmp_path, monkeypatch):
    import collections
    import shutil

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(UserError, match=rf"out_dir {tmp_path / 'out'} has 0.00 GB free, but one checkpoint of gla-debug takes 0.03 GB"):
        _setup(tmp_path)


def test_error_data_dir_without_index(tmp_path):
    from fabric_lin.data import TokenChunks

    empty = tmp_path / "tokens"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=f"{empty} has no index.json"):
        _setup(tmp_path, data=TokenChunks(data_path=empty, num_workers=0))


def test_error_missing_tokenizer(tmp_path):
    from fabric_lin.data import TokenChunks

    with pytest.raises(FileNotFoundError, match=str(tmp_path / "no_tokenizer")):
        _setup(tmp_path, data=TokenChunks(data_path=tmp_path, num_workers=0), tokenizer_dir=tmp_path / "no_tokenizer")


def test_error_resume_path_without_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"--resume {tmp_path / 'nothing'}: expected a checkpoint directory"):
        _setup(tmp_path, resume=tmp_path / "nothing")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """Two small tokenizers (300 and 320 pieces) and prepared directories made with the first: `tokens` of
    4 chunk files of 1000 tokens, written with litdata's Cache and write_prepared_info as the preprocessors do."""
    import numpy as np
    from litdata.streaming.cache import Cache
    from litdata.streaming.item_loader import TokensLoader

    from fabric_lin.data import Tokenizer
    from fabric_lin.data.prepared import write_prepared_info
    from fabric_lin.data.train_tokenizer import main as train_tokenizer

    root = tmp_path_factory.mktemp("prepared")
    for name, vocab_size, words in (("tok300", 300, "some text for a tokenizer"), ("tok320", 320, "other words, other pieces")):
        (root / f"{name}-raw").mkdir()
        (root / f"{name}-raw" / "a.txt").write_text("\n".join(f"line {i} of {words}" for i in range(500)))
        train_tokenizer(root / f"{name}-raw", root / name, vocab_size=vocab_size, num_threads=1)
    tokens = (np.arange(4000) % 300).astype(np.uint16)
    cache = Cache(str(root / "tokens"), chunk_size=1000, item_loader=TokensLoader())
    for i in range(4):
        cache[i] = tokens[i * 1000 : (i + 1) * 1000]
    cache.done()
    cache.merge()
    write_prepared_info(root / "tokens", Tokenizer(root / "tok300"), recipe="test")
    return root


def test_error_max_seq_length_beyond_the_data(tmp_path, prepared):
    """Chunk files of 1000 tokens hold no block of 1000 + 1: refused before the model is built."""
    from fabric_lin.data import TokenChunks

    data = TokenChunks(data_path=prepared / "tokens", num_workers=0)
    train = TrainArgs(global_batch_size=2, micro_batch_size=2, max_steps=1, max_seq_length=1000)
    with pytest.raises(ValueError, match=rf"max_seq_length=1000 is too long for {prepared / 'tokens'}: .* 1001 tokens .*"
                       r"its largest chunk file holds 1000 tokens"):
        _setup(tmp_path, data=data, train=train)
    assert not (tmp_path / "out" / "final").exists()


def test_data_smaller_than_a_micro_batch_is_read_epoch_after_epoch(tmp_path, prepared):
    """4 chunk files give 4 blocks of 501 tokens, half a micro batch of 8: the stream reads them again
    in the next epoch (in another order), so the micro batch holds each block twice."""
    from fabric_lin.data import TokenChunks

    data = TokenChunks(data_path=prepared / "tokens", num_workers=0)
    data.connect(batch_size=8, max_seq_length=500)
    data.setup()
    blocks = litdata_blocks(prepared / "tokens", 501)
    batch = next(iter(data.train_dataloader()))
    assert batch.shape == (8, 501) and len(blocks) == 4
    assert sorted(bytes(row.numpy()) for row in batch) == sorted(blocks * 2)
    train = TrainArgs(global_batch_size=8, micro_batch_size=8, max_steps=1, max_seq_length=500, save_interval=None)
    _setup(tmp_path, data=data, train=train, eval=EvalArgs(final_validation=False))
    assert (tmp_path / "out" / "final").is_dir()


def test_error_data_vocab_larger_than_the_model_without_tokenizer(tmp_path, prepared):
    """No tokenizer_dir: prepared.json's vocab_size (300) is checked against the model's (256)."""
    from fabric_lin.data import TokenChunks

    config = Config.from_name("gla-debug", vocab_size=256)
    with pytest.raises(ValueError, match=rf"{prepared / 'tokens'} was tokenized with a vocabulary of 300 tokens .*"
                       r"the model's vocab_size=256"):
        _setup(tmp_path, model_name=None, model_config=config, data=TokenChunks(data_path=prepared / "tokens", num_workers=0))


def test_error_tokenizer_vocab_larger_than_the_model(tmp_path, prepared):
    from fabric_lin.data import TokenChunks

    config = Config.from_name("gla-debug", vocab_size=256)
    with pytest.raises(ValueError, match=rf"the tokenizer in {prepared / 'tok300'} has 300 tokens but the model's vocab_size is 256"):
        _setup(tmp_path, model_name=None, model_config=config, tokenizer_dir=prepared / "tok300",
               data=TokenChunks(data_path=prepared / "tokens", num_workers=0))


def test_error_tokenizer_dir_differs_from_the_one_that_made_the_data(tmp_path, prepared):
    from fabric_lin.data import TokenChunks

    with pytest.raises(ValueError, match=rf"{prepared / 'tokens'} was tokenized with a different tokenizer \(vocab_size=300,"
                       rf".* than {prepared / 'tok320' / 'tokenizer.model'} \(vocab_size=320"):
        _setup(tmp_path, tokenizer_dir=prepared / "tok320", data=TokenChunks(data_path=prepared / "tokens", num_workers=0))


def test_transformer_has_no_length_limit_from_its_config():
    """RoPE is computed on the fly: the baseline takes sequences beyond model_config.max_seq_length, so
    train.max_seq_length is checked against the data only."""
    torch.manual_seed(0)
    model = GPT(Config.from_name("transformer-debug", num_layers=1, max_seq_length=16))
    ids = torch.randint(0, 4096, (1, 40))
    with torch.no_grad():
        long, short = model(ids), model(ids[:, :16])
    assert torch.isfinite(long).all()
    torch.testing.assert_close(long[:, :16], short)  # causal: the first 16 positions do not see the rest


def test_step_flags_reach_the_host_a_step_later_unless_waited_for():
    fabric = L.Fabric(accelerator="cpu", devices=1)
    flags = StepFlags(fabric)
    assert float(flags.push(1, torch.tensor(False), stop_requested=False)) == 0.0
    assert flags.pop(wait_all=False) == []  # the newest step's flags stay queued
    assert float(flags.push(2, torch.tensor(True), stop_requested=False)) == 1.0  # the optimizer's found_inf
    assert float(flags.push(3, torch.tensor(False), stop_requested=True)) == 0.0
    assert flags.pop(wait_all=False) == [(1, False, False), (2, True, False)]
    assert flags.pop(wait_all=True) == [(3, False, True)]
    assert flags.pop(wait_all=True) == []


def test_fused_adamw_found_inf_leaves_the_update_out():
    # what the loop relies on to skip a non-finite step without the host reading the flag first
    weight = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.AdamW([weight], lr=0.1, fused=True)
    weight.grad = torch.full((4,), float("nan"))
    optimizer.found_inf = torch.tensor(1.0)
    optimizer.step()
    assert torch.equal(weight.detach(), torch.ones(4)) and float(optimizer.state[weight]["step"]) == 0
    weight.grad = torch.ones(4)
    optimizer.found_inf = torch.tensor(0.0)
    optimizer.step()
    assert (weight.detach() < 1).all() and float(optimizer.state[weight]["step"]) == 1


def test_error_eval_max_iters_not_positive(tmp_path):
    with pytest.raises(ValueError, match=r"eval.max_iters must be at least 1 \(validation batches per device\), got 0"):
        _setup(tmp_path, eval=EvalArgs(max_iters=0))
    assert not (tmp_path / "out").exists()


def cli_error(argv, capsys) -> str:
    """Run `fabric-lin <argv>` in this process, expecting an anticipated failure: exit code 2 and one line on
    stderr, no traceback. Returns the line."""
    from fabric_lin.cli import main as cli_main

    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        cli_main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_error_data_options_without_a_data_module(tmp_path, capsys):
    err = cli_error(["pretrain", "--model_name", "gla-debug", "--out_dir", str(tmp_path / "out"),
                     "--train.max_steps", "1", "--data.num_workers", "2"], capsys)
    assert err.startswith("fabric-lin pretrain: error: --data.* options need a data module: give --data SampleCorpus")


def test_error_resume_from_a_model_directory_points_to_initial_checkpoint_dir(tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    torch.save(GPT(Config.from_name("gla-debug")).state_dict(), model_dir / "lit_model.pth")  # weights alone
    with pytest.raises(ValueError, match=rf"not a training checkpoint .*use --initial_checkpoint_dir {model_dir}"):
        _setup(tmp_path, resume=model_dir, eval=EvalArgs(final_validation=False))


def test_initial_checkpoint_dir_is_checked_against_the_model(tmp_path, capsys):
    from fabric_lin.convert.model_dir import save_model_dir

    state = GPT(Config.from_name("gla-debug")).state_dict()
    state["layers.1.attn.k_proj.weight"] = (state["layers.1.attn.k_proj.weight"] * 1000).to(torch.int32)
    (tmp_path / "model").mkdir()
    save_model_dir(state, Config.from_name("gla-debug", norm_eps=1e-5), tmp_path / "model")
    with pytest.raises(ValueError, match=r"layers\.1\.attn\.k_proj\.weight: dtype torch\.int32, expected torch\.float32"):
        _setup(tmp_path, initial_checkpoint_dir=tmp_path / "model", eval=EvalArgs(final_validation=False))
    # the model_config.yaml there differs in a field that keeps the shapes: reported before the weights
    out = capsys.readouterr().out
    assert "its model_config.yaml differs from this run's model in " in out and " norm_eps (1e-05 there, 1e-06 here)" in out


def test_no_tokenizer_is_warned_of(tmp_path, prepared, capsys):
    from fabric_lin.data import TokenChunks

    config = Config.from_name("gla-debug", vocab_size=320)
    _setup(tmp_path, model_name=None, model_config=config, eval=EvalArgs(final_validation=False),
           data=TokenChunks(data_path=prepared / "tokens", num_workers=0))
    assert "Warning: no tokenizer (--tokenizer_dir, or a data module that has one)" in capsys.readouterr().out
    assert (tmp_path / "out" / "final" / "lit_model.pth").exists()


def test_no_decay_names_found_in_a_ddp_wrapped_model():
    """Fabric's DDP (a 1-process gloo group here) names parameters `_forward_module.module.<name>`: the
    norm weights and biases must still be found, or weight decay reaches them under DDP."""
    from lightning.fabric.strategies import DDPStrategy

    # Fabric sets WORLD_SIZE, LOCAL_RANK, ... in os.environ; left there, a later `--devices 2` subprocess
    # takes itself for an already launched rank and waits for a second one that never starts
    saved_environ = dict(os.environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000))
    try:
        fabric = L.Fabric(accelerator="cpu", devices=1, strategy=DDPStrategy(process_group_backend="gloo"))
        fabric.launch()
        model, no_decay = build_model(fabric, Config.from_name("gla-debug", num_layers=1), seed=0)
        names = [n for n, _ in model.named_parameters()]
        assert any(n.startswith("_forward_module.module.") for n in names)  # DDP's wrapping
        assert {canonical_name(n) for n in names if canonical_name(n) in no_decay} == no_decay
        assert len(no_decay) == sum(p.ndim == 1 for p in model.parameters()) > 0
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved_environ)


def test_resume_with_other_optimizer_settings_passes_with_a_note(tmp_path, capsys):
    """The optimizer's settings are not the run's identity: a resume may change them, and says so in one note."""
    _setup(tmp_path, eval=EvalArgs(final_validation=False))
    capsys.readouterr()
    _setup(tmp_path, resume=tmp_path / "out" / "final", out_dir=tmp_path / "again", resume_changes=["train.max_steps"],
           optimizer=OptimizerArgs(lr=1e-4), eval=EvalArgs(final_validation=False, interval=5),
           train=TrainArgs(global_batch_size=2, micro_batch_size=2, max_steps=2, max_seq_length=32))
    out = capsys.readouterr().out
    assert ("Note: resuming with other settings than the checkpoint's: eval.interval: 1000 in the checkpoint, 5 here; "
            "optimizer.lr: 0.0004 in the checkpoint, 0.0001 here") in out
    assert "Resuming with a change of the run (--resume_changes): train.max_steps: 1 in the checkpoint, 2 here" in out
    assert json.loads((tmp_path / "again" / "final" / "step.json").read_text())["step_count"] == 2


@pytest.mark.parametrize("train,eval,message", [
    (dict(save_interval=0), {}, r"train.save_interval must be at least 1 \(or null: only the final checkpoint\), got 0"),
    (dict(log_interval=0), {}, r"train.log_interval must be at least 1, got 0"),
    (dict(keep_last_n=0), {}, r"train.keep_last_n must be at least 1 \(or null to keep all\), got 0"),
    (dict(lr_schedule="wsd", wsd_decay_fraction=1.5), {}, r"train.wsd_decay_fraction must be in \(0, 1\], got 1.5"),
    (dict(lr_schedule="linear"), {}, r"train.lr_schedule must be 'cosine' or 'wsd', got 'linear'"),
    ({}, dict(interval=0), r"eval.interval must be at least 1 \(optimizer steps between validations\), got 0"),
])
def test_error_train_and_eval_values_are_named(tmp_path, train, eval, message):
    train = TrainArgs(global_batch_size=2, micro_batch_size=2, max_steps=1, max_seq_length=32, **train)
    with pytest.raises(ValueError, match=message):
        _setup(tmp_path, train=train, eval=EvalArgs(**eval))
    assert not (tmp_path / "out").exists()


# ---- keys outside the option groups


@pytest.mark.parametrize("flags,message", [
    (["--compile_cache", "false"], "unknown option --compile_cache (did you mean --compile.cache?)"),
    (["--compile_mode=default"], "unknown option --compile_mode (did you mean --compile.mode?)"),
    (["--fsdp_unit", "model"], "unknown option --fsdp_unit"),
    (["--train.max_step", "3"], "unknown option --train.max_step (did you mean --train.max_steps?); options are not abbreviated"),
])
def test_unknown_command_line_keys_are_named_with_the_closest_one(tmp_path, capsys, flags, message):
    from fabric_lin.cli import main as cli_main

    with pytest.raises(SystemExit) as info:
        cli_main(["pretrain", "--model_name", "gla-debug", "--out_dir", str(tmp_path / "out"), *flags])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err == f"fabric-lin pretrain: error: {message}\n(fabric-lin pretrain --help lists the options)\n"
    assert not (tmp_path / "out").exists()


def test_unknown_config_file_keys_are_named(tmp_path, capsys):
    from fabric_lin.cli import main as cli_main

    config = tmp_path / "run.yaml"
    config.write_text("model_name: gla-debug\ncompile_cache: true\n")
    with pytest.raises(SystemExit):
        cli_main(["pretrain", "--config", str(config), "--out_dir", str(tmp_path / "out")])
    assert capsys.readouterr().err.startswith("fabric-lin pretrain: error: Subcommand 'pretrain' does not accept option 'compile_cache'")
    assert not (tmp_path / "out").exists()


def test_new_group_keys_parse_from_the_command_line_and_yaml(tmp_path):
    from jsonargparse import ArgumentParser

    from fabric_lin.pretrain import setup

    parser = ArgumentParser(exit_on_error=False)
    parser.add_function_arguments(setup)
    parser.add_argument("--config", action="config")
    config = tmp_path / "run.yaml"
    config.write_text("model_name: gla-debug\ncompile:\n  cache: false\n  mode: default\nparallelism:\n  fsdp_unit: model\n")
    cfg = parser.instantiate(parser.parse_args([
        "--config", str(config), "--compile.enabled", "true", "--parallelism.activation_checkpointing", "true",
    ]))
    assert cfg.compile == CompileArgs(enabled=True, cache=False, dynamic=True, mode="default", kernel_autotune=False)
    assert cfg.parallelism == ParallelismArgs(data_parallel="fsdp", fsdp_unit="model", activation_checkpointing=True)


def test_hyperparameters_yaml_is_a_config_for_the_next_run(tmp_path):
    """The hyperparameters.yaml in a checkpoint records this run's resolved arguments, and `--config` reads
    it back: the same groups, and a run continued from it."""
    from fabric_lin.cli import main as cli_main

    train = TrainArgs(global_batch_size=2, micro_batch_size=2, max_steps=1, max_seq_length=32, lr_warmup_steps=1)
    _setup(tmp_path, train=train, eval=EvalArgs(final_validation=False),
           parallelism=ParallelismArgs(fsdp_unit="model"), compile=CompileArgs(dynamic=False, mode="default"))
    hparams = tmp_path / "out" / "final" / "hyperparameters.yaml"
    cfg = parse_run_config(hparams)
    assert cfg.model_name == "gla-debug" and cfg.devices == 1 and cfg.precision == "32-true"  # resolved
    assert cfg.train == train and cfg.eval == EvalArgs(final_validation=False)
    assert cfg.parallelism == ParallelismArgs(fsdp_unit="model")
    assert cfg.compile == CompileArgs(enabled=False, dynamic=False, mode="default")  # enabled resolved for the CPU
    assert type(cfg.data).__name__ == "SampleCorpus" and tuple(cfg.data.weights) == (0.693584, 0.306416)
    cli_main(["pretrain", "--config", str(hparams), "--resume", "auto", "--train.max_steps", "2",
              "--resume_changes", "[train.max_steps]"])
    assert json.loads((tmp_path / "out" / "final" / "step.json").read_text())["step_count"] == 2


def test_a_compile_group_file_is_not_taken_for_the_old_compile_flag(tmp_path, capsys):
    """`--compile FILE` (a YAML file of the group) and `--compile '{...}'` are the new form: parsed, then
    refused here for another reason (max_steps 0), which shows that parsing went through."""
    group = tmp_path / "compile.yaml"
    group.write_text("enabled: false\ncache: false\n")
    for value in (str(group), '{"enabled": false}'):
        err = cli_error(["pretrain", "--model_name", "gla-debug", "--out_dir", str(tmp_path / "out"),
                         "--compile", value, "--train.max_steps", "0"], capsys)
        assert err == "fabric-lin pretrain: error: train.max_steps must be positive, got 0\n"


class RankFabric:
    """What tune_gla_kernels asks of Fabric: the rank, a broadcast from rank 0, and print."""

    def __init__(self, rank, from_rank0=None):
        self.global_rank, self.from_rank0, self.sent = rank, from_rank0, None

    def broadcast(self, obj, src=0):
        assert src == 0
        if self.global_rank == 0:
            self.sent = obj
            return obj
        return self.from_rank0

    def print(self, *args):
        pass


def test_kernel_autotune_searches_on_rank_0_and_every_rank_builds_with_its_result(monkeypatch, tmp_path):
    import dataclasses

    from fabric_lin.ops.gla import tune
    from fabric_lin.ops.gla.launch import SHIPPED
    from fabric_lin.pretrain import tune_gla_kernels

    config = Config.from_name("gla-debug")
    train = TrainArgs(micro_batch_size=4, global_batch_size=4, max_seq_length=256)
    searched = dataclasses.replace(SHIPPED, dqk_single_warps=8)
    assert searched != SHIPPED
    calls = []

    def fake_tuned_launch(B, T, H, K, V, dtype, cache_file=None, log=print):
        calls.append((B, T, H, K, V, dtype, cache_file))
        return searched

    monkeypatch.setattr(tune, "tuned_launch", fake_tuned_launch)
    rank0 = RankFabric(0)
    assert tune_gla_kernels(rank0, config, train, "bf16-mixed", tmp_path) is searched
    assert calls == [(4, 256, config.num_heads, config.head_k_dim, config.head_v_dim, torch.bfloat16,
                      tmp_path / "compile_cache" / "gla_launch.json")]
    assert rank0.sent is searched
    assert tune_gla_kernels(RankFabric(1, from_rank0=rank0.sent), config, train, "bf16-mixed", tmp_path) is searched
    assert len(calls) == 1  # rank 1 did not search
    # every GLA layer of the model is built with the settings
    model, _ = build_model(L.Fabric(accelerator="cpu", devices=1), config, seed=0, gla_launch=searched)
    assert [block.attn.launch for block in model.module.layers] == [searched] * config.num_layers


# ---- an out_dir that holds an earlier run


def test_a_fresh_run_into_a_used_out_dir_refuses_and_names_the_ways_on(tmp_path, capsys):
    _setup(tmp_path, eval=EvalArgs(final_validation=False))
    out = tmp_path / "out"
    (out / "step-00000005").mkdir()  # an earlier run's step beyond this run's max_steps
    first = (out / "final" / "lit_model.pth").read_bytes()
    with pytest.raises(FileExistsError, match=rf"out_dir {out} holds the checkpoints of an earlier run \(final, step-00000005\); "
                       r"a new run would put its own beside them. Continue that run with --resume auto, write this one to "
                       r"another --out_dir, or start afresh with --overwrite true \(deletes those checkpoints\)"):
        _setup(tmp_path, eval=EvalArgs(final_validation=False))
    assert (out / "final" / "lit_model.pth").read_bytes() == first  # untouched
    # the same from the command line: one line
    err = cli_error(["pretrain", "--model_name", "gla-debug", "--out_dir", str(out), "--train.max_steps", "1"], capsys)
    assert err.startswith(f"fabric-lin pretrain: error: out_dir {out} holds the checkpoints of an earlier run")
    # contradictions are refused before any work
    with pytest.raises(ValueError, match="--overwrite true deletes the checkpoints .* that --resume auto would continue from"):
        _setup(tmp_path, overwrite=True, resume="auto")
    with pytest.raises(ValueError, match="--overwrite true would delete the checkpoint --resume .*final names"):
        _setup(tmp_path, overwrite=True, resume=out / "final")
    # --overwrite true: the earlier run's checkpoints and metrics are gone, only this run's are there
    (out / "metrics.jsonl").write_text('{"step": 99, "loss": 1.0}\n')
    train = TrainArgs(global_batch_size=2, micro_batch_size=2, max_steps=2, max_seq_length=32, save_interval=1)
    _setup(tmp_path, overwrite=True, train=train, eval=EvalArgs(final_validation=False))
    assert "--overwrite true: deleted the earlier run's checkpoints in" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(("step-", "final", "."))) == ["final", "step-00000001"]
    assert {json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()} == {1, 2}
    # the checkpoints record no overwrite: `--config <their hyperparameters.yaml> --resume auto` is not refused
    assert "overwrite" not in (out / "final" / "hyperparameters.yaml").read_text()


def test_hyperparameters_yaml_holds_absolute_paths(tmp_path, monkeypatch, prepared):
    import yaml

    from fabric_lin.data import TokenChunks

    monkeypatch.chdir(tmp_path)
    data = TokenChunks(data_path=Path(os.path.relpath(prepared / "tokens", tmp_path)), num_workers=0)
    config = Config.from_name("gla-debug", vocab_size=320)
    _setup(tmp_path, model_name=None, model_config=config, out_dir=Path("runs/out"), data=data,
           tokenizer_dir=Path(os.path.relpath(prepared / "tok300", tmp_path)), eval=EvalArgs(final_validation=False))
    hparams = yaml.safe_load((tmp_path / "runs" / "out" / "final" / "hyperparameters.yaml").read_text())
    assert hparams["out_dir"] == str(tmp_path / "runs" / "out")
    assert hparams["tokenizer_dir"] == str(prepared / "tok300")
    assert hparams["data"]["init_args"]["data_path"] == str(prepared / "tokens")


def test_a_failed_run_removes_the_empty_output_directories_it_created(tmp_path):
    from fabric_lin.data import TokenChunks

    (tmp_path / "runs").mkdir()
    with pytest.raises(FileNotFoundError, match="does not exist"):  # after the launch: the data is checked in main
        _setup(tmp_path, out_dir=tmp_path / "runs" / "a" / "b", data=TokenChunks(data_path=tmp_path / "nothing", num_workers=0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"] and not any((tmp_path / "runs").iterdir())


# ---- resuming with other loader values


def test_resume_with_another_micro_batch_size_trains_on_the_same_samples(tmp_path):
    """The data position is one number of samples: resumed with micro batches of 1 (two per step), the
    steps after the checkpoint train on the samples the uninterrupted run (micro batches of 2) took."""
    common = dict(eval=EvalArgs(final_validation=False, interval=1000))
    train = dict(global_batch_size=2, max_seq_length=32, save_interval=2)
    _setup(tmp_path, out_dir=tmp_path / "whole", train=TrainArgs(micro_batch_size=2, max_steps=4, **train), **common)
    _setup(tmp_path, out_dir=tmp_path / "split", train=TrainArgs(micro_batch_size=2, max_steps=2, **train), **common)
    _setup(tmp_path, out_dir=tmp_path / "split", resume=tmp_path / "split" / "final", resume_changes=["train.max_steps"],
           train=TrainArgs(micro_batch_size=1, max_steps=4, **train), **common)
    whole, split = logged_data_fingerprints(tmp_path / "whole"), logged_data_fingerprints(tmp_path / "split")
    assert sorted(whole) == [1, 2, 3, 4] and len(set(whole.values())) == 4
    assert split == whole


def test_resume_in_another_data_order_is_refused_naming_the_value(tmp_path):
    from fabric_lin.data import SampleCorpus

    _setup(tmp_path, eval=EvalArgs(final_validation=False))
    final = tmp_path / "out" / "final"
    with pytest.raises(ValueError, match=rf"--resume {final}: this run differs from the checkpoint's in data.seed: 42 in the "
                       r"checkpoint, 7 here. Resume with the checkpoint's values \(its hyperparameters.yaml\), or change them "
                       r"on purpose with --resume_changes '\[data\]'"):
        _setup(tmp_path, out_dir=tmp_path / "again", resume=final, data=SampleCorpus(seed=7), eval=EvalArgs(final_validation=False))


def test_resume_from_a_damaged_directory_refuses_in_one_line(tmp_path, capsys):
    _setup(tmp_path, eval=EvalArgs(final_validation=False))
    final = tmp_path / "out" / "final"
    with open(final / "lit_model.pth", "r+b") as f:
        f.truncate(4096)
    err = cli_error(["pretrain", "--model_name", "gla-debug", "--out_dir", str(tmp_path / "again"), "--resume", str(final),
                     "--train.max_steps", "1", "--train.global_batch_size", "2", "--train.micro_batch_size", "2"], capsys)
    assert err.startswith(f"fabric-lin pretrain: error: --resume {final}: the checkpoint is damaged: lit_model.pth has 4,096 "
                          f"bytes, ")
    assert "(truncated). It is not loaded" in err and final.is_dir()


# ---- the command line's errors


def test_a_bad_value_is_one_line_and_a_hint_not_the_usage(tmp_path, capsys):
    from fabric_lin.cli import main as cli_main

    with pytest.raises(SystemExit) as info:
        cli_main(["pretrain", "--model_name", "gla-debug", "--train.max_steps", "abc"])
    assert info.value.code == 2
    assert capsys.readouterr().err == (
        "fabric-lin pretrain: error: train.max_steps: got abc, expected int or null\n"
        "(fabric-lin pretrain --help lists the options)\n"
    )
    with pytest.raises(SystemExit):
        cli_main(["pretrain", "--model_name", "gla-debug", "--precision", "bf16"])
    assert capsys.readouterr().err.startswith(
        "fabric-lin pretrain: error: precision: got bf16, expected one of 'bf16-mixed', 'bf16-true', '16-mixed', '32-true' or null\n"
    )


@pytest.mark.parametrize("flags", [["--train.max_step", "10"], ["--train.max_step=10"], ["--eval.max_iter", "2"]])
def test_an_abbreviated_flag_is_refused(tmp_path, capsys, flags):
    from fabric_lin.cli import main as cli_main

    with pytest.raises(SystemExit) as info:
        cli_main(["pretrain", "--model_name", "gla-debug", "--out_dir", str(tmp_path / "out"), *flags])
    assert info.value.code == 2
    option = flags[0].split("=")[0]
    assert capsys.readouterr().err.startswith(
        f"fabric-lin pretrain: error: unknown option {option} (did you mean {option}s?); options are not abbreviated\n"
    )
    assert not (tmp_path / "out").exists()


def test_an_unexpected_error_keeps_its_traceback_and_the_debug_flag_shows_every_one(tmp_path, capsys, monkeypatch):
    from fabric_lin import pretrain
    from fabric_lin.cli import main as cli_main

    argv = ["pretrain", "--model_name", "gla-debug", "--out_dir", str(tmp_path / "out"), "--train.max_steps", "1",
            "--train.global_batch_size", "2", "--train.micro_batch_size", "2", "--data", "TokenChunks",
            "--data.data_path", str(tmp_path / "nothing")]
    assert cli_error(argv, capsys).startswith("fabric-lin pretrain: error: Prepared data directory")
    monkeypatch.setenv("FABRIC_LIN_DEBUG", "1")  # the exception itself, with its traceback
    with pytest.raises(FileNotFoundError, match="Prepared data directory"):
        cli_main(argv)
    monkeypatch.delenv("FABRIC_LIN_DEBUG")

    def bug(*args, **kwargs):
        return {}["no such key"]

    monkeypatch.setattr(pretrain, "check_out_dir", bug)
    with pytest.raises(KeyError):  # not an anticipated failure: not turned into one line
        cli_main(argv)


def test_a_data_modules_own_check_is_one_line_though_jsonargparse_wraps_it(tmp_path, capsys):
    err = cli_error(["pretrain", "--model_name", "gla-debug", "--out_dir", str(tmp_path / "out"), "--train.max_steps", "1",
                     "--data", "SlimPajamaStarcoder", "--data.weights", "[1, -1]"], capsys)
    assert err.startswith("fabric-lin pretrain: error: data.weights must be two positive numbers, the shares of SlimPajama and "
                          "Starcoder (default [0.693584, 0.306416]); got [1.0, -1.0]")


def test_anticipated_failures_are_told_from_bugs():
    import errno

    from fabric_lin.cli import expected_failure

    def raised(f):
        try:
            f()
        except Exception as e:
            return e

    assert expected_failure(raised(lambda: Config.from_name("gla-340m")))  # a UserError, where the mistake is found
    assert expected_failure(raised(lambda: TrainArgs(max_steps=0).total_steps()))
    assert not expected_failure(raised(lambda: int("x")))  # raised outside fabric_lin
    assert not expected_failure(ValueError("a ValueError that is no UserError"))
    assert not expected_failure(raised(lambda: torch.zeros(2).view(3)))
    assert not expected_failure(raised(lambda: learning_rate(0, None, 0, 0, 1, "cosine", 0.1)))  # a TypeError inside fabric_lin
    assert expected_failure(OSError(errno.ENOSPC, "No space left on device", "/data/out/step-00000100/lit_model.pth"))


def test_errors_are_printed_by_rank_0_only(monkeypatch, capsys):
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    from fabric_lin.cli import report

    report("fabric-lin pretrain", "error: once")
    monkeypatch.setattr(rank_zero_only, "rank", 3)
    report("fabric-lin pretrain", "error: from rank 3")
    assert capsys.readouterr().err == "fabric-lin pretrain: error: once\n"


def test_help_describes_every_command_in_whole_sentences(capsys):
    """`fabric-lin --help` lists each command with its docstring's first paragraph, which jsonargparse cuts
    at the first line break: each first line is a whole sentence."""
    from fabric_lin.cli import COMMANDS, main as cli_main

    with pytest.raises(SystemExit) as info:
        cli_main(["--help"])
    assert info.value.code == 0
    listing = capsys.readouterr().out.split("Available subcommands:")[1]
    descriptions, name = {}, None
    for line in listing.splitlines():
        words = line.split(None, 1)
        if words and words[0] in COMMANDS and line.startswith("    ") and not line.startswith("     "):
            name = words[0]
            descriptions[name] = words[1] if len(words) > 1 else ""
        elif name and line.strip():
            descriptions[name] += " " + line.strip()
    assert sorted(descriptions) == sorted(COMMANDS)
    for name, description in descriptions.items():
        assert description.strip().endswith("."), (name, description)


def test_error_negative_num_workers_is_one_line(tmp_path, capsys):
    err = cli_error(["pretrain", "--model_name", "gla-debug", "--out_dir", str(tmp_path / "out"), "--train.max_steps", "1",
                     "--data", "SampleCorpus", "--data.num_workers", "-1"], capsys)
    assert err.startswith("fabric-lin pretrain: error: data.num_workers must be 0 (load in the training process) or a "
                          "positive number of DataLoader worker processes per rank, got -1")
    assert not (tmp_path / "out").exists()


def test_error_more_cpu_processes_than_cores(tmp_path, capsys, monkeypatch):
    from fabric_lin.pretrain import usable_cpu_cores

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cores = usable_cpu_cores()
    err = cli_error(["pretrain", "--model_name", "gla-debug", "--out_dir", str(tmp_path / "out"), "--train.max_steps", "1",
                     "--devices", str(cores + 6), "--train.global_batch_size", str(4 * (cores + 6))], capsys)
    assert err == (f"fabric-lin pretrain: error: --devices {cores + 6}: without a CUDA GPU each device is a CPU process, and "
                   f"this machine gives this run {cores} CPU core(s); give --devices {cores} or fewer\n")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("device,message", [
    ("cuda", "--device cuda: this machine has no CUDA GPU that PyTorch can use; give --device cpu"),
    ("gpu0", "--device 'gpu0': expected cpu, cuda or cuda:<index>"),
])
def test_generate_error_device_is_one_line(tmp_path, capsys, monkeypatch, device, message):
    from test_convert_hf import make_model_dir, small_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    make_model_dir(tmp_path / "model", small_config())
    err = cli_error(["generate", str(tmp_path / "model"), "--device", device], capsys)
    assert err == f"fabric-lin generate: error: {message}\n"


# ---- resuming a run with changes of the run itself


def metrics_records(out_dir: Path) -> list:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def test_resume_with_another_global_batch_size_refuses_in_one_line(tmp_path, capsys):
    train = ["--train.max_steps", "1", "--train.micro_batch_size", "2", "--train.max_seq_length", "32"]
    _setup(tmp_path, eval=EvalArgs(final_validation=False))
    final = tmp_path / "out" / "final"
    base = ["pretrain", "--out_dir", str(tmp_path / "again"), "--resume", str(final), "--logger_name", "csv", *train]
    err = cli_error([*base, "--model_name", "gla-debug", "--train.global_batch_size", "4"], capsys)
    assert err == (f"fabric-lin pretrain: error: --resume {final}: this run differs from the checkpoint's in "
                   f"train.global_batch_size: 2 in the checkpoint, 4 here. Resume with the checkpoint's values (its "
                   f"hyperparameters.yaml), or change them on purpose with --resume_changes '[train.global_batch_size]' "
                   f"(tutorials/resume.md says what then happens)\n")
    err = cli_error([*base, "--model_name", "gla-debug", "--train.global_batch_size", "2", "--resume_changes", "[optimizer.lr]"], capsys)
    assert err == ("fabric-lin pretrain: error: --resume_changes optimizer.lr: expected names among train.global_batch_size, "
                   "train.max_steps, train.max_tokens, data, seed\n")


def test_resume_with_another_model_refuses_naming_the_fields(tmp_path):
    _setup(tmp_path, eval=EvalArgs(final_validation=False))
    final = tmp_path / "out" / "final"
    with pytest.raises(ValueError, match=rf"--resume {final}: a resumed run trains the checkpoint's run, and this one differs in "
                       r"model: num_layers 4 in the checkpoint, 1 here; train.max_seq_length: 32 in the checkpoint, 16 here\. "
                       r"To start another run from its weights"):
        _setup(tmp_path, out_dir=tmp_path / "again", resume=final, model_name=None,
               model_config=Config.from_name("gla-debug", num_layers=1),
               train=TrainArgs(global_batch_size=2, micro_batch_size=2, max_steps=1, max_seq_length=16))


def test_a_larger_global_batch_on_resume_keeps_tokens_and_the_schedule_in_tokens(tmp_path, capsys):
    """Four steps of 2 x 32 tokens, then with --resume_changes a global batch of 4 to the end of a 512-token
    budget: two more steps of 128 tokens. The tokens count on, the learning rate is the schedule's at the
    tokens trained on (in steps of the first size), and the change is logged."""
    common = dict(eval=EvalArgs(final_validation=False), optimizer=OptimizerArgs(lr=1e-3))
    train = dict(micro_batch_size=2, max_seq_length=32, lr_warmup_steps=2, min_lr=1e-4, log_interval=1)
    _setup(tmp_path, train=TrainArgs(global_batch_size=2, max_tokens=256, **train), **common)
    final = tmp_path / "out" / "final"
    capsys.readouterr()
    _setup(tmp_path, resume=final, resume_changes=["train.global_batch_size", "train.max_tokens"],
           train=TrainArgs(global_batch_size=4, max_tokens=512, **train), **common)
    out = capsys.readouterr().out
    assert "Training finished: 512 tokens in total (256 in this run) | elapsed " in out
    assert " tokens/s after the first step (compilation and warm-up left out, as are validation and saving)" in out
    assert "Resuming with a change of the run (--resume_changes): train.global_batch_size: 2 in the checkpoint, 4 here" in out
    assert "Resuming with a change of the run (--resume_changes): train.max_tokens: 256 in the checkpoint, 512 here" in out
    records = metrics_records(tmp_path / "out")
    losses = [r for r in records if "loss" in r and "lr" in r]
    assert [r["step"] for r in losses] == [1, 2, 3, 4, 5, 6]
    tokens = {r["step"]: r["tokens"] for r in records if "tokens" in r}
    assert tokens == {1: 64, 2: 128, 3: 192, 4: 256, 5: 384, 6: 512}
    # the first attempt's schedule: 4 steps; then, stretched to 512 tokens, 8 steps of 64 tokens, in which
    # steps 5 and 6 start at 256 and 384 tokens: positions 4 and 6
    expected = [learning_rate(position, 1e-3, 1e-4, 2, 4) for position in range(4)]
    expected += [learning_rate(position, 1e-3, 1e-4, 2, 8) for position in (4, 6)]
    assert [r["lr"] for r in losses] == pytest.approx(expected, rel=1e-12)
    (change,) = [r for r in records if "resume_changes" in r]
    assert change["step"] == 4 and change["attempt"] == 2 and len(change["resume_changes"]) == 2
    # the next resume goes on from the new batch size without naming it again
    _setup(tmp_path, resume=final, resume_changes=["train.max_tokens"],
           train=TrainArgs(global_batch_size=4, max_tokens=1024, **train), **common)
    tokens = {r["step"]: r["tokens"] for r in metrics_records(tmp_path / "out") if "tokens" in r}
    assert tokens[10] == 1024 and max(tokens) == 10


def test_cpu_threads_are_the_cores_shared_by_the_processes(monkeypatch, capsys):
    from fabric_lin import pretrain

    threads = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(pretrain, "usable_cpu_cores", lambda: 8)
    monkeypatch.setattr(os, "getloadavg", lambda: (1.0, 1.0, 1.0))
    try:
        pretrain.set_cpu_threads(2)
        assert torch.get_num_threads() == 4 and capsys.readouterr().out == ""
        monkeypatch.setattr(os, "getloadavg", lambda: (9.5, 9.0, 9.0))  # other work keeps every core busy
        pretrain.set_cpu_threads(1)
        assert torch.get_num_threads() == 8
        assert ("Note: this machine is busy (load average 9.5 on 8 cores); training uses 8 threads per process. If steps "
                "are slow, OMP_NUM_THREADS=1 fabric-lin pretrain ...") in capsys.readouterr().out
        monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's choice stands
        pretrain.set_cpu_threads(1)
        assert torch.get_num_threads() == 8
    finally:
        torch.set_num_threads(threads)
