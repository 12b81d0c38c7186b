"""What the test modules share, written once: the repository's paths, `fabric-lin` run in this process (its
one-line errors, pretrain's setup, a config file parsed as the command line does) or as a subprocess, what a run
writes (metrics.jsonl, its final weights), small inputs (a SentencePiece tokenizer, a model directory, a prepared
token directory) and how the kernel tests compare (inputs as leaves, gradients, tolerances). pytest puts tests/ on
sys.path: `from helpers import ...`. The kernel tests' references and inputs (fp64 recurrences, the Triton
interpreter's fla adjustments) stay in conftest.py."""
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import warnings
from pathlib import Path
from typing import Dict, List, Optional

import lightning_fabric  # noqa: F401  (see below)
import pytest
import torch

import fabric_lin_process

# Lightning's log handler writes to the sys.stderr of the moment lightning_fabric is first imported. Imported here,
# while pytest collects, its INFO lines ("Seed set to 42") go to pytest's own capture, not into a test's capsys,
# where cli_error counts the lines of an error (the test modules that called it first imported it at their top).

REPO = Path(__file__).resolve().parents[1]
CONFIG_HUB = REPO / "config_hub"


# ---- fabric-lin in this process


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


def setup_pretrain(tmp_path, **kwargs) -> None:
    """pretrain's `setup` in this process: one step of gla-debug (global and micro batch 2, 32 tokens) into
    tmp_path/out with the CSV logger, unless kwargs say otherwise."""
    from fabric_lin.args import TrainArgs
    from fabric_lin.pretrain import setup

    defaults = dict(
        model_name="gla-debug", out_dir=tmp_path / "out", logger_name="csv", devices=1,
        train=TrainArgs(global_batch_size=2, micro_batch_size=2, max_steps=1, max_seq_length=32),
    )
    setup(**{**defaults, **kwargs})


def parse_run_config(path: Path):
    """Parse a config_hub YAML exactly as `fabric-lin pretrain --config` does, without running it."""
    from jsonargparse import ArgumentParser

    from fabric_lin.pretrain import setup

    parser = ArgumentParser(exit_on_error=False)
    parser.add_function_arguments(setup)
    parser.add_argument("--config", action="config")
    return parser.instantiate(parser.parse_args(["--config", str(path)]))


# ---- fabric-lin as a subprocess


def pretrain_command(out_dir: Path, *args: str) -> List[str]:
    """`fabric-lin pretrain <args> --out_dir <out_dir>` as this Python runs it."""
    return [*fabric_lin_process.FABRIC_LIN, "pretrain", *args, "--out_dir", str(out_dir)]


def run_ok(command: List[str], timeout: float, env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    """Run `command` to its end; it must exit 0 (else its output's tail is the failure)."""
    result = fabric_lin_process.run(command, timeout, env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a process group's rendezvous (not a fixed one: the tests run in
    parallel)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_forked_ranks(target, ranks: int = 2, timeout: float = 120) -> List[Optional[int]]:
    """The exit codes of target(rank, port) run in `ranks` forked processes, the CPU ranks of one run meeting at
    `port` (None for one still running after `timeout` s, then killed)."""
    import multiprocessing

    fork = multiprocessing.get_context("fork")
    port = free_port()
    processes = [fork.Process(target=target, args=(rank, port)) for rank in range(ranks)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout)
        if process.exitcode is None:
            process.kill()
    return [process.exitcode for process in processes]


def sharded_gla_rank(rank: int, port: int, run_id: str):
    """(Fabric, its train state, the config) of one of the 2 CPU processes of a sharded (FSDP2) run of a one-layer
    gla-debug, started as torchrun starts them."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2", GROUP_RANK="0", TORCHELASTIC_RUN_ID=run_id)
    from fabric_lin.args import ParallelismArgs
    from fabric_lin.checkpoint import train_state
    from fabric_lin.config import Config
    from fabric_lin.model import GPT
    from fabric_lin.parallelism import make_strategy

    fabric = lightning_fabric.Fabric(accelerator="cpu", devices=2,
                                     strategy=make_strategy(False, 2, 1, ParallelismArgs(), "32-true"))
    fabric.launch()
    config = Config.from_name("gla-debug", num_layers=1)
    with fabric.init_module(empty_init=True):
        model = GPT(config)
    model = fabric.setup(model)
    return fabric, train_state(model, fabric.setup_optimizers(torch.optim.AdamW(model.parameters())), {"samples": 4}), config


# ---- what a run writes


def metrics_records(out_dir: Path) -> list:
    """Every record of out_dir/metrics.jsonl."""
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def logged_losses(out_dir: Path) -> Dict[int, float]:
    """step -> loss; a step logged again after a resume keeps its last value. A line cut by SIGKILL is left
    out, and a run that has logged nothing yet has no losses."""
    losses = {}
    path = out_dir / "metrics.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line cut by SIGKILL
                continue
            if "loss" in record:
                losses[record["step"]] = record["loss"]
    return losses


def final_weights(out_dir: Path) -> Dict[str, torch.Tensor]:
    """The model weights of the run's final checkpoint (out_dir/final), one file or sharded."""
    path = out_dir / "final" / "lit_model.pth"
    if path.is_dir():
        return {key.removeprefix("model."): value for key, value in read_dcp(path).items() if key.startswith("model.")}
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


def read_dcp(path: Path) -> Dict[str, object]:
    """Every entry of a torch.distributed.checkpoint directory (a sharded lit_model.pth), whole, read in this process
    by torch's own reader: {"model.<parameter>": tensor, "optimizer.state.<parameter>.<name>": tensor, ...}."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(path))
    entries = {key: torch.empty(item.size, dtype=item.properties.dtype) if isinstance(item, TensorStorageMetadata) else None
               for key, item in reader.read_metadata().state_dict_metadata.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(entries, storage_reader=reader, no_dist=True)
    return entries


# ---- end to end: the debug run (gla-debug on the sample corpus) as a subprocess, stopped and resumed

DEBUG_STEPS = 8
DEBUG_ARGS = [
    "--model_name", "gla-debug",
    "--train.max_steps", str(DEBUG_STEPS), "--train.global_batch_size", "4", "--train.micro_batch_size", "2",
    "--train.max_seq_length", "64", "--train.lr_warmup_steps", "2", "--train.save_interval", "2",
    "--eval.interval", "1000", "--eval.max_iters", "1", "--eval.final_validation", "false",
    "--optimizer.lr", "3e-3", "--logger_name", "csv",
]
RUN_TIMEOUT = 300
# the runs of several processes are on the CPU (gloo), also on a machine with one GPU (where NCCL over 2 GPUs
# could not start)
CPU_ONLY = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
LOADER_WORKERS = ("--data", "SampleCorpus", "--data.num_workers", "2")


def debug_command(out_dir: Path, *extra: str) -> List[str]:
    return [*pretrain_command(out_dir, *DEBUG_ARGS), *extra]


def debug_run(out_dir: Path, *extra: str, env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    return run_ok(debug_command(out_dir, *extra), RUN_TIMEOUT, env)


def start_debug_run(out_dir: Path, *extra: str, env: Optional[Dict[str, str]] = None):
    """The run in the background (a subprocess.Popen or its forked equivalent), its output in <out_dir>.log; in a
    session of its own, as a terminal's foreground job (for `ctrl_c` and `signal_job`)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return fabric_lin_process.start(debug_command(out_dir, *extra), out_dir.parent / f"{out_dir.name}.log", env)


def run_with_a_small_tmpfs(small: Path, size: str, argv, *, env: str = "", copy_to: Path = None):
    """`argv` run where `small` is a tmpfs of `size` (a mount namespace of its own, with a user namespace where the
    user may not mount), after `env` (NAME=value words); what it wrote there is copied to `copy_to`, as the tmpfs
    goes with the namespace. Skips the test where no tmpfs can be mounted. A command that is forked with nothing
    set in its environment is forked into the namespace (fabric_lin_process.run's tmpfs), not a new Python: a new
    Python in `sh` under `unshare` costs seconds of imports. (`env`'s variables may be read by a library at its
    import, which a forked command has done already: TMPDIR, by tempfile's first use.)"""
    if shutil.which("unshare") is None:
        pytest.skip("needs util-linux's unshare")
    small.mkdir()
    mount = f"mount -t tmpfs -o size={size} tmpfs {small}"
    unshare = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c"]
    probe = subprocess.run([*unshare, mount], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {probe.stderr.decode().strip()}")
    if not env and fabric_lin_process.forkable(list(argv), None):
        return fabric_lin_process.run(list(argv), RUN_TIMEOUT, tmpfs=(small, size, copy_to))
    copy = f"cp -a {small}/. {copy_to}" if copy_to is not None else "true"
    script = f'{mount} && {{ env {env} "$@"; status=$?; {copy}; exit $status; }}'
    return subprocess.run([*unshare, script, "sh", *argv], capture_output=True, text=True, timeout=RUN_TIMEOUT)


def ctrl_c(proc: subprocess.Popen) -> None:
    """What a terminal's Ctrl-C does: SIGINT to every process of the foreground job (the trainer, its
    DataLoader workers)."""
    signal_job(proc, signal.SIGINT)


def signal_job(proc: subprocess.Popen, signum: int) -> None:
    """`signum` to every process of the job (its session), as schedulers send SIGTERM: SLURM's preemption and
    scancel, Kubernetes, systemd, `timeout`."""
    try:
        os.killpg(proc.pid, signum)
    except ProcessLookupError:
        pass


def wait_for(condition, proc: subprocess.Popen, timeout: float = RUN_TIMEOUT, poll: float = 0.02) -> bool:
    """Poll `condition()` until true; False if the process ended first. Past `timeout` seconds the process is
    killed with every process it started, and TimeoutError names it."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if condition():
            return True
        if proc.poll() is not None:
            return condition()
        time.sleep(poll)
    fabric_lin_process.stop(proc)
    raise TimeoutError(f"pid {proc.pid}, {fabric_lin_process.command_line(proc.args)}, did not reach the expected "
                       f"point within {timeout:g} s: killed with every process it started")


def assert_one_history(out_dir: Path, steps: int = DEBUG_STEPS) -> None:
    """metrics.jsonl reads as one run: each step's loss once, in order, every record numbered by its attempt,
    and no record of a step after the one its attempt resumed from (replayed steps are in the superseded file)."""
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, steps + 1))
    assert all(isinstance(r["attempt"], int) and r["attempt"] >= 1 for r in records)
    attempts = [r["attempt"] for r in records]
    assert attempts == sorted(attempts)  # a later attempt's records come after the earlier one's


def assert_same_run(out_dir: Path, reference: Path) -> None:
    """The run in out_dir, however often stopped and resumed, is the uninterrupted `reference` bit for bit."""
    from conftest import logged_data_fingerprints

    got, expected = logged_losses(out_dir), logged_losses(reference)
    assert sorted(expected) == list(range(1, DEBUG_STEPS + 1))
    assert got == expected  # exact float equality, every step
    assert_one_history(out_dir)
    # the same samples in the same order: none repeated or skipped across the interruptions
    assert logged_data_fingerprints(out_dir) == logged_data_fingerprints(reference)
    a, b = final_weights(out_dir), final_weights(reference)
    assert a.keys() == b.keys()
    for key in b:
        assert torch.equal(a[key], b[key]), key


# ---- checkpoints


def write_checkpoint_dir_files(ckpt_dir: Path, config) -> None:
    """model_config.yaml, hyperparameters.yaml and tokenizer files (a 64-piece tokenizer), as pretrain writes beside
    lit_model.pth."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    config.save(ckpt_dir / "model_config.yaml")
    (ckpt_dir / "hyperparameters.yaml").write_text("model_name: gla-debug\n")
    train_sentencepiece(ckpt_dir)
    (ckpt_dir / "tokenizer_config.json").write_text('{"bos_token": "<s>"}')


def load_whole_checkpoint(path: Path) -> dict:
    """A training checkpoint written by the tests or by pretrain, read whole: tensors, containers and
    the arrays of NumPy's RNG state (no other global is admitted)."""
    import numpy as np

    multiarray = getattr(np, "_core", None) or np.core
    allowed = [multiarray.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype("uint32"))]
    with torch.serialization.safe_globals(allowed):
        return torch.load(path, weights_only=True)


def assert_same_tensors(got: dict, expected: dict):
    assert sorted(got) == sorted(expected)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0, msg=name)


class TouchOnUnpickle:
    """Unpickled, it runs `touch target`: the file's absence afterwards shows that no code ran."""

    def __init__(self, target: Path):
        self.target = target

    def __reduce__(self):
        return (os.system, (f"touch {self.target}",))


# ---- small inputs


def train_sentencepiece(directory: Path, vocab_size: int = 64,
                        sentence: str = "the gated linear attention model number {} reads tokens") -> None:
    """A BPE tokenizer.model of `vocab_size` pieces (bos 1, eos 2, unk 0) in `directory`, trained on 200 lines of
    `sentence` (numbered where it says {}): another sentence, another tokenizer of the same size."""
    import sentencepiece as spm

    directory.mkdir(parents=True, exist_ok=True)
    text = directory / "corpus.txt"
    text.write_text("\n".join(sentence.format(i) for i in range(200)))
    spm.SentencePieceTrainer.Train(
        input=str(text), model_prefix=str(directory / "tokenizer"), vocab_size=vocab_size, model_type="bpe",
        bos_id=1, eos_id=2, unk_id=0, pad_id=-1, minloglevel=2,
    )
    text.unlink()
    (directory / "tokenizer.vocab").unlink()


def assert_decoding_equals_the_full_forward(config) -> None:
    """A model's logits over 75 tokens equal those of a chunked prefill of 40 then one token at a time from its
    decoding cache. A recurrent first layer then holds constant memory: GLA one [B, H, K, V] state, the delta rule
    the convolutions' windows and its state."""
    from fabric_lin.model import GPT

    torch.manual_seed(0)
    model = GPT(config).eval()
    ids = torch.randint(0, config.vocab_size, (2, 75))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache()
        steps = [model(ids[:, :40], cache=cache)]
        for t in range(40, 75):
            steps.append(model(ids[:, t : t + 1], cache=cache))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-4)
    state_shape = (2, config.num_heads, config.head_k_dim, config.head_v_dim)
    if config.block_type == "gla":
        assert cache.layers[0].shape == state_shape
    elif config.block_type in ("gdn", "deltanet"):
        conv_q, conv_k, conv_v, state = cache.layers[0]
        assert state.shape == state_shape and conv_v.shape == (2, 3, config.value_dim)


def assert_packed_documents_equal_separate_documents(config) -> None:
    """Documents of 20, 1 and 70 tokens packed in one row with cu_seqlens give the logits of each run alone."""
    from fabric_lin.model import GPT

    torch.manual_seed(0)
    model = GPT(config).eval()
    docs = [torch.randint(0, config.vocab_size, (1, n)) for n in (20, 1, 70)]
    with torch.no_grad():
        packed = model(torch.cat(docs, dim=1), cu_seqlens=torch.tensor([0, 20, 21, 91]))
        separate = torch.cat([model(d) for d in docs], dim=1)
    torch.testing.assert_close(packed, separate, rtol=1e-4, atol=1e-4)


def assert_fused_path_matches_torch_path(config, seq_len: int) -> None:
    """The model on its fused kernels (Triton; the interpreter without a GPU) and on its PyTorch paths, from the
    same weights: the same loss, and the same gradient for every parameter, none of them zero."""
    from fabric_lin.model import GPT

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    reference = GPT(config, fused=False).to(device)
    fused = GPT(config, fused=True).to(device)
    fused.load_state_dict(reference.state_dict())
    ids = torch.randint(0, config.vocab_size, (2, seq_len), device=device)
    losses, grads = [], []
    for model in (reference, fused):
        loss = model(ids, targets=torch.roll(ids, -1, 1))
        grads.append(torch.autograd.grad(loss, list(model.parameters())))
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)
    for (name, _), a, b in zip(reference.named_parameters(), grads[1], grads[0]):
        assert b.abs().sum() > 0, f"{name} gets no gradient"
        # each gradient to 1e-4 of its own largest entry (a floor of 1e-4 absolute would pass a small one 10% off)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * b.abs().max().item(), msg=lambda m: f"{name}: {m}")


def write_json_lines(path: Path, rows: list, compress: Optional[str] = None, frames: int = 1,
                     final_newline: bool = True) -> None:
    """JSON lines as real shards come: rows are dicts (dumped), strings or bytes (written as they are), plain or
    compressed - "zst" in `frames` zstd frames cut at equal byte offsets, mid-line, as parallel compressors cut
    them; "gz". final_newline=False: the last line ends without a newline, as many shards' do."""
    import gzip

    import zstandard

    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [r if isinstance(r, bytes) else (r if isinstance(r, str) else json.dumps(r)).encode() for r in rows]
    data = b"\n".join(lines) + (b"\n" if final_newline else b"")
    if compress == "zst":
        per = -(-len(data) // frames)
        data = b"".join(zstandard.ZstdCompressor().compress(data[i : i + per]) for i in range(0, len(data), per))
    elif compress == "gz":
        data = gzip.compress(data)
    path.write_bytes(data)


def write_parquet_with_a_damaged_row_group(path: Path, column: str, texts: List[str], row_group: int = 1) -> None:
    """A parquet file of `texts` in one string column, row groups of 7 rows, whose footer and other row groups
    read but whose `row_group`'s data page is scrambled: the damage is found only while the file is streamed."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({column: texts}), path, row_group_size=7, compression="zstd", use_dictionary=False)
    chunk = pq.ParquetFile(path).metadata.row_group(row_group).column(0)
    data = bytearray(path.read_bytes())
    for i in range(chunk.data_page_offset + 20, chunk.data_page_offset + chunk.total_compressed_size - 4):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))


def eager_model_built_as_from_meta(config, seed: int):
    """GPT(config) built eagerly from `seed`, once it is checked that building it on the meta device and then
    calling reset_parameters() gives the same state dict, names and values (how the trainer builds large models)."""
    from fabric_lin.model import GPT

    torch.manual_seed(seed)
    eager = GPT(config)
    torch.manual_seed(seed)
    with torch.device("meta"):
        lazy = GPT(config)
    lazy.to_empty(device="cpu")
    lazy.reset_parameters()
    eager_state, lazy_state = eager.state_dict(), lazy.state_dict()
    assert eager_state.keys() == lazy_state.keys()
    for key in eager_state:
        assert torch.equal(eager_state[key], lazy_state[key]), key
    return eager


def make_model_dir(directory: Path, config, seed: int = 0) -> dict:
    """A model directory (lit_model.pth, model_config.yaml, a 64-piece tokenizer) of a GPT of `config` whose norms
    and biases are moved away from their init; returns its state dict."""
    from fabric_lin.model import GPT

    torch.manual_seed(seed)
    model = GPT(config)
    with torch.no_grad():  # norms and biases away from their init, so a mix-up would show
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    torch.save(state, directory / "lit_model.pth")
    config.save(directory / "model_config.yaml")
    train_sentencepiece(directory)
    return state


def small_config(**overrides):
    """gla-debug with 2 layers and a vocabulary of 64 (make_model_dir's tokenizer)."""
    from fabric_lin.config import Config

    return Config.from_name("gla-debug", vocab_size=64, num_layers=2, **overrides)


def write_prepared(path: Path, tokens, tokenizer, item: int = 1000, chunk_size: int = 1000, **fields) -> None:
    """A prepared directory of `tokens` as the preprocessors write it (litdata's Cache, then the tokenizer's files and
    prepared.json, with `fields`), written directly: items of `item` tokens (the last one may be shorter) in chunk
    files of `chunk_size` tokens. Without a tokenizer, litdata's files alone: what the sample streams read."""
    from litdata.streaming.cache import Cache
    from litdata.streaming.item_loader import TokensLoader

    from fabric_lin.data.prepared import write_prepared_info

    cache = Cache(str(path), chunk_size=chunk_size, item_loader=TokensLoader())
    for i, start in enumerate(range(0, len(tokens), item)):
        cache[i] = tokens[start : start + item]
    cache.done()
    cache.merge()
    if tokenizer is not None:
        write_prepared_info(path, tokenizer, **{"recipe": "test", **fields})


def paragraphs(n, seed):
    """n distinct real paragraphs (pieces of stdlib modules)."""
    import sysconfig

    import numpy as np

    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        text = sources[int(rng.integers(len(sources)))].read_text(encoding="utf-8", errors="replace")
        start = int(rng.integers(max(1, len(text) - 800)))
        out.append(f"doc {seed}-{i}: " + text[start : start + int(rng.integers(50, 600))])
    return out


def read_tokens(path):
    """Every token of a prepared directory, in order, through StreamingDataset + TokensLoader."""
    import numpy as np
    from litdata.streaming import StreamingDataset, TokensLoader

    dataset = StreamingDataset(str(path), item_loader=TokensLoader(block_size=1), shuffle=False)
    return np.concatenate([np.asarray(item) for item in dataset]).astype(np.int64)


def expected_tokens(tokenizer, texts):
    return [tokenizer.encode(t, bos=False, eos=True).tolist() for t in texts]


def split_documents(tokens, eos_id):
    """The documents of a token stream, each ending with its EOS."""
    import numpy as np

    docs, start = [], 0
    for i in np.flatnonzero(tokens == eos_id):
        docs.append(tokens[start : i + 1].tolist())
        start = i + 1
    assert start == len(tokens), "the token stream must end with EOS"
    return docs


def running_processes_of_group(group: int) -> List[int]:
    """The ids of the processes of process group `group` that still run; a zombie (a process that has ended, whose
    parent has not collected it: here the orphans of a script that ended) does not count."""
    return [pid for pid, (state, _, pgrp) in fabric_lin_process.process_table().items() if pgrp == group and state != "Z"]


def interrupt_preparation(command: List[str], directory: Path, started: str, how: str,
                          stderr: Optional[Path] = None) -> int:
    """Run a data preparation script (`command`) in a session of its own, wait until the glob pattern `started`
    under `directory` names what it writes while it runs (a worker's report of its first file: with many files
    the run is mid-way), then stop it: SIGKILL to the whole session (a killed job: nothing runs after it), SIGINT
    to the script (Ctrl-C), SIGTERM to the script (`kill PID`, `timeout`) or "SIGTERM to the job" (every process
    of the session, as SLURM's scancel sends it). Returns its exit code; unless killed, no process of the run
    (a worker) may outlive the script. Its stderr goes to the file `stderr` where given. (The script is forked from
    an interpreter that has imported torch: fabric_lin_process, scripts=True.)"""
    stdout = Path(tempfile.mkdtemp()) / "stdout"
    process = fabric_lin_process.start(command, stdout, err_log=stderr or stdout.with_name("stderr"), scripts=True)
    try:
        deadline = time.time() + 60
        while not list(directory.glob(started)) and time.time() < deadline and process.poll() is None:
            time.sleep(0.05)
        assert process.poll() is None, "the run ended before it could be interrupted"
        if how == "SIGKILL":
            os.killpg(process.pid, signal.SIGKILL)
        elif how == "SIGTERM to the job":
            os.killpg(process.pid, signal.SIGTERM)
        else:
            process.send_signal(getattr(signal, how))
        returncode = process.wait(timeout=60)
        if how != "SIGKILL":
            left = running_processes_of_group(process.pid)
            assert not left, f"after {how}, processes {left} of the run are still running"
        return returncode
    finally:
        fabric_lin_process.stop(process)  # the script, and any worker left behind
        shutil.rmtree(stdout.parent)


# ---- the kernel tests: values and gradients against a reference

# gdn-340M's decoding step for 16 sequences: test_gdn_recurrent.py's GPU test and test_short_conv.py's sm_90 report,
# here because that file, run as a script, must not import conftest.py (which sets TRITON_INTERPRET)
GDN_STEP_SHAPE = (16, 4, 128, 256)  # B, H, K, V

# where the fused ops' tests run: on the GPU in fp32 and bf16, else in Triton's interpreter in fp32 (its tl.dot on
# bf16 inputs is wrong)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if torch.cuda.is_available() else [torch.float32]

def leaves(*tensors):
    return [t.detach().clone().requires_grad_(True) for t in tensors]


def grads_of(out, inputs, seed=1, allow_unused=False):
    """Gradients of sum(out * r) for a fixed random r, w.r.t. inputs."""
    outs = out if isinstance(out, tuple) else (out,)
    g = torch.Generator().manual_seed(seed)
    loss = sum((o.float() * torch.randn(o.shape, generator=g).to(o.device)).sum() for o in outs)
    return torch.autograd.grad(loss, inputs, allow_unused=allow_unused)


def tol(dtype):
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


def check(a, b, dtype, name):
    torch.testing.assert_close(a.float(), b.float(), **tol(dtype), msg=lambda m: f"{name}: {m}")


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max|x - ref| / max|ref|; against an all-zero reference (dg with T = 1 and no initial state)
    the absolute error, so x must be zero too."""
    x, ref = x.double(), ref.double()
    err = (x - ref).abs().max()
    scale = ref.abs().max()
    return (err / scale if scale > 0 else err).item()


def assert_close_scaled(a, b, name):
    """fp32 agreement: elementwise within 1e-4 relative, or 1e-4 of the tensor's largest magnitude (dg and dgk are
    cumulative sums whose small entries carry the rounding of the large ones)."""
    assert torch.isfinite(a).all(), f"{name}: not finite"
    b = b.to(a.dtype)
    atol = 1e-4 * b.abs().max().item()
    torch.testing.assert_close(a, b, rtol=1e-4, atol=atol, msg=lambda m: f"{name}: {m}")


def assert_close(actual, expected, name, tol=2e-5):
    """fp32 against fp64: within tol of the reference's largest magnitude (sums of up to a few hundred terms)."""
    err = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    bound = tol * max(1.0, expected.abs().max().item() if expected.numel() else 0.0)
    assert err <= bound, f"{name}: max error {err:.3g} > {bound:.3g}"


def parse_error(argv, capsys) -> str:
    """The one-line error of a command line or config file that jsonargparse refuses, followed by the --help hint."""
    from fabric_lin.cli import main as cli_main

    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        cli_main(argv)
    assert info.value.code == 2
    line, hint = capsys.readouterr().err.splitlines()
    assert hint == f"(fabric-lin {argv[0]} --help lists the options)"
    return line
