"""`fabric-lin generate` reads what `evaluate` reads, through its loader (fabric_lin.checkpoint_kinds): a model
directory, a training checkpoint (one file and sharded) and an fla export of the same weights give the same text, the
greedy continuation of a full forward pass; a training checkpoint keeps a transformer within the length its run
trained at, as the model directory converted from it does; and the errors are evaluate's: a run's directory, a
checkpoint still being written, another model's weights, a damaged checkpoint, weights without their tokenizer (told
before a training checkpoint's checksums are read)."""
import shutil
from pathlib import Path
from typing import Optional

import pytest
import torch

from fabric_lin.config import Config
from fabric_lin.data import Tokenizer
from fabric_lin.generate import main as generate
from fabric_lin.model import GPT
from helpers import cli_error, make_model_dir, small_config

PROMPT = "the gated model"


class OneProcess:
    """What write_manifest asks of Fabric, for one process."""

    global_rank, world_size = 0, 1

    def broadcast(self, obj, src=0):
        return obj


def training_checkpoint(model_dir: Path, checkpoint: Path, hparams: str = "model_name: gla-debug\n",
                        sharded: bool = False, optimizer: Optional[dict] = None) -> Path:
    """A training checkpoint of the weights of `model_dir` as pretrain writes one: lit_model.pth (the model beside the
    optimizer's state, `optimizer` or an empty one, and the counters, or a directory of shards), the other files of
    the model directory, hyperparameters.yaml (`hparams`), step.json, and manifest.json last."""
    import torch.distributed.checkpoint as dcp

    from fabric_lin.checkpoint import write_manifest

    checkpoint.mkdir(parents=True)
    for path in model_dir.iterdir():
        if path.name != "lit_model.pth":
            shutil.copy(path, checkpoint)
    state = torch.load(model_dir / "lit_model.pth")
    if sharded:
        dcp.save({"model": state, **({"optimizer": optimizer} if optimizer else {})},
                 checkpoint_id=checkpoint / "lit_model.pth", no_dist=True)
        torch.save({"step_count": 2}, checkpoint / "lit_model.pth" / "meta.pt")
    else:
        torch.save({"model": state, "optimizer": optimizer or {"state": {}}, "iter_num": 4, "step_count": 2},
                   checkpoint / "lit_model.pth")
    (checkpoint / "hyperparameters.yaml").write_text(hparams)
    (checkpoint / "step.json").write_text('{"step_count": 2}\n')
    write_manifest(OneProcess(), checkpoint)
    return checkpoint


def greedy_text(config: Config, state: dict, tokenizer: Tokenizer, max_new_tokens: int) -> str:
    """The prompt and the tokens picked greedily after end-of-text and the prompt, each the argmax of one full forward
    pass over everything before it (no cache), decoded together."""
    model = GPT(config).eval()
    model.load_state_dict(state)
    prompt_ids = tokenizer.encode(PROMPT).tolist()
    ids, new = [tokenizer.eos_id] + prompt_ids, []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            new.append(int(model(torch.tensor([ids + new]))[0, -1, :tokenizer.vocab_size].argmax()))
            if new[-1] == tokenizer.eos_id:
                break
    return tokenizer.decode(prompt_ids + new)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_every_kind_of_checkpoint_generates_the_text_of_its_weights(tmp_path, capsys):
    from fabric_lin.convert.hf import convert_to_hf

    config = small_config()
    state = make_model_dir(tmp_path / "model", config)
    convert_to_hf(tmp_path / "model", tmp_path / "fla")
    kinds = [tmp_path / "model", tmp_path / "fla",
             training_checkpoint(tmp_path / "model", tmp_path / "run" / "final"),
             training_checkpoint(tmp_path / "model", tmp_path / "sharded" / "step-00000002", sharded=True)]
    expected = greedy_text(config, state, Tokenizer(tmp_path / "model"), 8)
    assert expected != PROMPT
    for directory in kinds:
        capsys.readouterr()
        assert generate(directory, prompt=PROMPT, max_new_tokens=8, temperature=0.0, device="cpu") == expected, directory
        assert capsys.readouterr().out == expected + "\n"


def test_a_training_checkpoint_keeps_a_transformer_within_the_length_its_run_trained_at(tmp_path, capsys, monkeypatch):
    """The run trained at train.max_seq_length 16, its model config's max_seq_length the default 2048: generate of the
    checkpoint refuses a 17th position as generate of the model directory converted from it does, before the weights
    are read, and generates up to the 16th."""
    import fabric_lin.checkpoint_kinds as kinds
    from fabric_lin.convert.pretrained_checkpoint import convert_pretrained_checkpoint

    config = Config.from_name("transformer-debug", vocab_size=64, num_layers=2)
    assert config.max_seq_length == 2048
    make_model_dir(tmp_path / "model", config)
    final = training_checkpoint(tmp_path / "model", tmp_path / "run" / "final",
                                hparams="model_name: transformer-debug\ntrain:\n  max_seq_length: 16\n")
    convert_pretrained_checkpoint(final, tmp_path / "converted")
    prompt_length = 1 + len(Tokenizer(final).encode(PROMPT))  # the end-of-text token first
    room = 16 - prompt_length
    assert room > 0
    texts = []
    for directory in (final, tmp_path / "converted"):
        with monkeypatch.context() as patch:
            patch.setattr(kinds.FoundCheckpoint, "read", lambda self: pytest.fail("the weights were read"))
            err = cli_error(["generate", str(directory), "--prompt", PROMPT, "--device", "cpu", "--temperature", "0",
                             "--max_new_tokens", str(room + 1)], capsys)
        assert err == (f"fabric-lin generate: error: --max_new_tokens {room + 1}: a prompt of {prompt_length} tokens (the "
                       f"end-of-text token before it included) and {room + 1} new ones are 17 positions, past the "
                       f"max_seq_length of 16 that this transformer was trained at: give --max_new_tokens {room} or less, "
                       f"or a shorter prompt\n"), err
        texts.append(generate(directory, prompt=PROMPT, max_new_tokens=room, temperature=0.0, device="cpu"))
    assert texts[0] == texts[1] and texts[0].startswith(PROMPT)


def error_of(command: str, directory: Path, capsys) -> str:
    """The error line of `fabric-lin <command> <directory>` on the CPU, without its `fabric-lin <command>: ` prefix."""
    err = cli_error([command, str(directory), "--device", "cpu"], capsys)
    prefix = f"fabric-lin {command}: error: "
    assert err.startswith(prefix), err
    return err[len(prefix):]


def test_generate_refuses_what_evaluate_refuses_in_its_words(tmp_path, capsys):
    """A run's directory, a checkpoint that the run is still writing, and a training checkpoint beside another model's
    config: generate's line is evaluate's (where generate named model directories and conversions)."""
    from fabric_lin.checkpoint import write_manifest

    make_model_dir(tmp_path / "model", small_config())
    run = tmp_path / "run"
    training_checkpoint(tmp_path / "model", run / "step-00000002")
    shutil.copytree(run / "step-00000002", run / ".tmp-step-00000004")
    other = training_checkpoint(tmp_path / "model", tmp_path / "other" / "final")
    Config.from_name("gdn-debug", vocab_size=64, num_layers=2).save(other / "model_config.yaml")
    write_manifest(OneProcess(), other)  # the checkpoint as pretrain wrote it: its manifest lists this config
    said = {
        run: f"{run} is not a checkpoint: it holds none of lit_model.pth, model.safetensors or config.json; expected a "
             f"training checkpoint (a run's step-XXXXXXXX/ or final/), a model directory (convert_pretrained_checkpoint's "
             f"output) or an fla export (convert_to_hf's output); it holds a run's checkpoints (step-00000002): pass one of "
             f"them\n",
        run / "step-00000004": f"{run / 'step-00000004'} is not there yet: {run / '.tmp-step-00000004'} is being written",
        other: f"{other / 'lit_model.pth'} holds a GLA model (2 layers, width 128; its layers hold attn.gk_proj.0.weight) "
               f"and {other / 'model_config.yaml'} describes gdn-debug, a Gated DeltaNet model",
    }
    for directory, start in said.items():
        line = error_of("generate", directory, capsys)
        assert line.startswith(start), line
        assert line == error_of("evaluate", directory, capsys)


def test_a_damaged_training_checkpoint_is_named_so(tmp_path, capsys):
    make_model_dir(tmp_path / "model", small_config())
    final = training_checkpoint(tmp_path / "model", tmp_path / "run" / "final")
    with open(final / "lit_model.pth", "r+b") as f:
        f.seek(-100, 2)
        f.write(b"x" * 10)
    line = error_of("generate", final, capsys)
    assert line.startswith(f"{final}: the checkpoint is damaged: lit_model.pth's bytes changed since it was written"), line
    assert line.endswith(". It is not read; generate from an older checkpoint of the run\n"), line


def test_weights_without_their_tokenizer_are_refused_before_they_are_read(tmp_path, capsys, monkeypatch):
    """A model directory, an fla export and a training checkpoint without tokenizer.model: one line naming the directory
    and the tokenizer its trained_with.json records, where it records one; a training checkpoint's before its checksums
    are read (every byte of it: minutes for a large model), the others' after their config (which may say that the
    directory holds no model of fabric-lin's)."""
    import fabric_lin.checkpoint_kinds as kinds
    from fabric_lin.convert.hf import convert_to_hf

    make_model_dir(tmp_path / "model", small_config())
    convert_to_hf(tmp_path / "model", tmp_path / "fla")
    final = training_checkpoint(tmp_path / "model", tmp_path / "run" / "final")
    monkeypatch.setattr(kinds, "verify_checkpoint", lambda *args: pytest.fail("the checksums were read"))
    monkeypatch.setattr(kinds.FoundCheckpoint, "read", lambda self: pytest.fail("the weights were read"))
    for directory in (tmp_path / "model", tmp_path / "fla", final):
        (directory / "tokenizer.model").unlink()
        line = error_of("generate", directory, capsys)
        assert line.startswith(f"{directory} has no tokenizer.model, and generate reads and writes text"), line
    assert error_of("generate", tmp_path / "model", capsys) == (
        f"{tmp_path / 'model'} has no tokenizer.model, and generate reads and writes text\n")
    # the export records the tokenizer the weights were trained with (convert_to_hf's trained_with.json)
    assert "; its weights were trained with the tokenizer its trained_with.json records (vocab_size=64" in error_of(
        "generate", tmp_path / "fla", capsys)


@pytest.mark.parametrize("length", [True, 0, -8, "64", 64.0, None])
def test_a_run_s_length_that_is_no_positive_whole_number_leaves_the_config_s(length):
    """hyperparameters.yaml's train.max_seq_length sets a training checkpoint's length only where it is a positive int:
    YAML's true (a bool, which Python takes for the int 1), a string or a float leave the model config's."""
    from fabric_lin.checkpoint_kinds import at_the_trained_length

    config = small_config()
    assert at_the_trained_length(config, {"train": {"max_seq_length": length}}).max_seq_length == config.max_seq_length
    assert at_the_trained_length(config, {"train": {"max_seq_length": 7}}).max_seq_length == 7


def test_no_new_token_reads_no_position_past_the_prompt():
    """A transformer's prompt past its max_seq_length is refused where a token is to be generated after it; with
    max_new_tokens 0 nothing is, and nothing is refused."""
    from fabric_lin.errors import InvalidValue
    from fabric_lin.generate import check_context_length

    config = Config.from_name("transformer-debug", max_seq_length=16)
    check_context_length(config, 40, 0)
    check_context_length(config, 12, 4)
    with pytest.raises(InvalidValue):
        check_context_length(config, 12, 5)
