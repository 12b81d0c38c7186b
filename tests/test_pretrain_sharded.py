"""End to end: `fabric-lin pretrain` on several CPU processes (gloo), sharded with FSDP2 (gla-debug, the sample
corpus, a global batch of 4). One process, two (one node: plain sharding, Fabric's own launch) and four (two nodes of
two: replicated across the nodes, sharded within each) train on the same samples with the same losses, to the order
of the sums, and validate on the same blocks to the same val_loss; a checkpoint taken on any of these meshes resumes
on another one holding the same state bit for bit (4 -> 2 -> 1, 1 -> 4), and a DDP run continues a sharded one.
Killed by SIGKILL of one rank in the middle of a save, a run leaves no checkpoint that is taken for complete (the
other rank says so in one line) and resumes as if never stopped; so does a run of two torchrun agents stopped by
SIGTERM. Rank 0 killed before the rank it started has joined ends that rank within seconds, in one line. Two nodes
started by hand that do not meet (a mistyped MASTER_PORT) stop at parallelism.join_timeout_minutes, in one line each;
a MASTER_PORT in use is said in one line.
A sharded checkpoint is converted and evaluated in one process. An error every rank meets is printed once.

The four-process runs are started as torchrun's agents would start them (fabric_lin_process.start_ranks: forked, no
second import of torch), two nodes of two processes on this machine; the torchrun test starts real agents."""
import json
import os
import re
import shutil
import signal
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

import fabric_lin_process
from conftest import logged_data_fingerprints
from helpers import (
    CPU_ONLY,
    DEBUG_ARGS,
    DEBUG_STEPS as STEPS,
    RUN_TIMEOUT as TIMEOUT,
    assert_same_run,
    free_port,
    load_whole_checkpoint,
    logged_losses,
    metrics_records,
    pretrain_command,
    read_dcp,
    run_ok,
    wait_for,
)

pytestmark = pytest.mark.slow

# The global batch of 4 sequences is one micro batch per process: 1, 2 and 4 processes take the same samples at
# every step (fewer, larger micro batches than DEBUG_ARGS' cost less).
# AdamW's eps at 1e-4 instead of 1e-8: a gradient component near zero is a sum that nearly cancels, whose last bits
# follow the order of the sums (which the number of processes changes); with eps far below it, AdamW turns those bits
# into updates of up to +-lr, and the losses of 1, 2 and 4 processes differ by up to 1e-4 (relative) within 8 steps.
# With 1e-4 they agree to about 1e-6 over the whole run, so a difference of 1e-5 is a fault, not rounding. The first
# step's gradient norm (the same weights on every mesh) agrees to 2e-6: its sums' rounding.
GLOBAL_BATCH = 4
ARGS = [*DEBUG_ARGS, "--train.global_batch_size", str(GLOBAL_BATCH), "--optimizer.eps", "1e-4"]
LOSS_RTOL = 1e-5
# The runs of 1, 2 and 4 processes end with a validation of one global batch (DEBUG_ARGS' eval.max_iters): the same
# blocks on any mesh. The runs resumed from their checkpoints do not validate: they save the state they loaded, and a
# validation draws from torch's random generator (as the start of any DataLoader's iteration does).
FINAL_VALIDATION = ["--eval.final_validation", "true"]


def command(out_dir: Path, nodes: int, devices: int, *extra: str) -> List[str]:
    """The run on `nodes` x `devices` processes, each taking its share of the global batch in one micro batch."""
    return [*pretrain_command(out_dir, *ARGS), "--train.micro_batch_size", str(GLOBAL_BATCH // (nodes * devices)),
            "--devices", str(devices), "--num_nodes", str(nodes), *extra]


def run_ranks(out_dir: Path, nodes: int, devices: int, *extra: str) -> str:
    """The run on `nodes` x `devices` processes started as torchrun's agents would (rank 0's log returned)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    logs = out_dir.parent / f"{out_dir.name}-logs"
    ranks = fabric_lin_process.start_ranks(command(out_dir, nodes, devices, *extra), logs, nodes, devices, free_port(),
                                           CPU_ONLY)
    codes = fabric_lin_process.wait_all(ranks, TIMEOUT)
    assert codes == [0] * len(ranks), "".join((logs / f"rank-{r}.log").read_text()[-2000:] for r in range(len(ranks)))
    return (logs / "rank-0.log").read_text()


@pytest.fixture(scope="module")
def one(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("one") / "out"
    run_ok(command(out, 1, 1, *FINAL_VALIDATION), TIMEOUT, CPU_ONLY)
    return out


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> Path:
    """Two processes of one node, launched by Fabric itself (`--devices 2`): FSDP2 shards over both."""
    out = tmp_path_factory.mktemp("two") / "out"
    run_ok(command(out, 1, 2, *FINAL_VALIDATION), TIMEOUT, CPU_ONLY)
    return out


@pytest.fixture(scope="module")
def four(tmp_path_factory) -> Path:
    """Two nodes of two processes: a (2, 2) mesh, replicated across the nodes and sharded within each."""
    out = tmp_path_factory.mktemp("four") / "out"
    run_ranks(out, 2, 2, *FINAL_VALIDATION)
    return out


# ---------------------------------------------------------------- what a checkpoint holds


def optimizer_order(config) -> List[str]:
    """The parameters in the order of pretrain's two AdamW groups (with weight decay, then without): the order
    a one-file checkpoint's optimizer state numbers them in."""
    from fabric_lin.model_setup import no_decay_parameter_names
    from fabric_lin.weights import meta_model

    model = meta_model(config)
    no_decay = no_decay_parameter_names(model)
    names = [name for name, _ in model.named_parameters()]
    return [n for n in names if n not in no_decay] + [n for n in names if n in no_decay]


def train_state_contents(checkpoint_dir: Path) -> Dict[str, Any]:
    """Everything a training checkpoint's lit_model.pth holds, keyed alike whether it is one file or sharded:
    model.<parameter>, optimizer.state.<parameter>.<exp_avg|exp_avg_sq|step>, optimizer.param_groups.<i>.<setting>,
    and the rest (counters, data position, RNG states) under their own names."""
    from fabric_lin.config import Config

    path = checkpoint_dir / "lit_model.pth"
    if path.is_dir():
        contents = {key: value for key, value in read_dcp(path).items() if not key.endswith(".params")}
        contents.update(load_whole_checkpoint(path / "meta.pt"))
        return contents
    saved = load_whole_checkpoint(path)
    order = optimizer_order(Config.from_checkpoint(checkpoint_dir))
    contents = {f"model.{name}": tensor for name, tensor in saved.pop("model").items()}
    optimizer = saved.pop("optimizer")
    for index, moments in optimizer["state"].items():
        contents.update({f"optimizer.state.{order[index]}.{key}": value for key, value in moments.items()})
    for i, group in enumerate(optimizer["param_groups"]):
        contents.update({f"optimizer.param_groups.{i}.{key}": value for key, value in group.items() if key != "params"})
    contents.update(saved)
    return contents


def assert_same_contents(got: Any, expected: Any, where: str = "") -> None:
    """Equal bit for bit: tensors of the same dtype and values, containers of equal items, equal plain values."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == expected.dtype and torch.equal(got, expected), where
    elif isinstance(expected, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(expected), (where, sorted(set(got) ^ set(expected))[:6])
        for key in expected:
            assert_same_contents(got[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(expected), where
        for i, (a, b) in enumerate(zip(got, expected)):
            assert_same_contents(a, b, f"{where}[{i}]")
    else:
        assert got == expected, (where, got, expected)


def sharded_files(checkpoint_dir: Path) -> List[str]:
    return sorted(p.name for p in (checkpoint_dir / "lit_model.pth").iterdir())


# ---------------------------------------------------------------- the tests


def test_one_two_and_four_processes_train_on_the_same_samples_with_the_same_losses(one, two, four):
    """The same samples at every step (the sum of per-sample checksums); the losses equal to LOSS_RTOL, and the
    first step's gradient norm (the same weights, gradients summed in another order) to 2e-6. The final validation
    reads the same blocks and gives the same val_loss."""
    from fabric_lin.checkpoint import verify_checkpoint

    expected = logged_data_fingerprints(one)
    assert sorted(expected) == list(range(1, STEPS + 1)) and len(set(expected.values())) == STEPS
    reference, first = logged_losses(one), metrics_records(one)
    for run in (two, four):
        assert logged_data_fingerprints(run) == expected
        losses = logged_losses(run)
        for step in range(1, STEPS + 1):
            assert losses[step] == pytest.approx(reference[step], rel=LOSS_RTOL), (run, step)
        norm = next(r["grad_norm"] for r in metrics_records(run) if r.get("step") == 1 and "grad_norm" in r)
        assert norm == pytest.approx(next(r["grad_norm"] for r in first if r.get("step") == 1 and "grad_norm" in r), rel=2e-6)
    seq_len = int(ARGS[ARGS.index("--train.max_seq_length") + 1])
    validations = {run: [r for r in metrics_records(run) if "val_loss" in r] for run in (one, two, four)}
    for run, records in validations.items():
        assert [(r["step"], r["val_tokens"]) for r in records] == [(STEPS, GLOBAL_BATCH * seq_len)], run
        assert records[0]["val_loss"] == pytest.approx(validations[one][0]["val_loss"], rel=LOSS_RTOL), run
    # every rank wrote its shard; the manifest, written last, lists every file of the checkpoint
    assert sharded_files(two / "final") == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    assert sharded_files(four / "final") == [".metadata", *(f"__{r}_0.distcp" for r in range(4)), "meta.pt"]
    for run in (two, four):
        manifest = json.loads((run / "final" / "manifest.json").read_text())
        assert set(manifest["files"]) == {p.relative_to(run / "final").as_posix() for p in (run / "final").rglob("*")
                                          if p.is_file() and p.name != "manifest.json"}
        assert verify_checkpoint(run / "final").ok


@pytest.mark.parametrize("source, meshes", [("four", [(1, 2), (1, 1)]), ("one", [(2, 2)])], ids=["4->2->1", "1->4"])
def test_a_checkpoint_resumed_on_another_mesh_holds_the_same_state(one, four, tmp_path, source, meshes):
    """The final checkpoint of one mesh (nodes, devices) resumed on the next, with nothing left to train, so that the
    run saves the state it loaded as its own final/: the weights, AdamW's moments and steps, the data position,
    counters and random generators' states are the first run's, bit for bit, on every mesh of the chain."""
    previous = {"one": one, "four": four}[source]
    expected = train_state_contents(previous / "final")
    for i, (nodes, devices) in enumerate(meshes):
        out = tmp_path / f"mesh-{i}"
        log = run_ranks(out, nodes, devices, "--resume", str(previous / "final"))
        assert "Nothing to train: the checkpoint is at step 8" in log
        assert (out / "final" / "lit_model.pth").is_dir() == (nodes * devices > 1)
        assert_same_contents(train_state_contents(out / "final"), expected)
        previous = out


def test_ddp_continues_a_sharded_run_on_its_samples(four, tmp_path):
    """DDP over two processes resumes the four-process sharded run at step 4 (its tensors reassembled whole): steps
    5-8 train on the uninterrupted run's samples, and their losses follow its losses."""
    out = tmp_path / "out"
    out.mkdir()
    shutil.copytree(four / "step-00000004", out / "step-00000004")
    log = run_ranks(out, 1, 2, "--parallelism.data_parallel", "ddp", "--resume", "auto")
    assert "is sharded and this run is not: its tensors are reassembled whole" in log
    assert sorted(logged_losses(out)) == [5, 6, 7, 8]
    expected = logged_data_fingerprints(four)
    assert logged_data_fingerprints(out) == {step: expected[step] for step in range(5, STEPS + 1)}
    reference = logged_losses(four)
    for step, loss in logged_losses(out).items():
        assert loss == pytest.approx(reference[step], rel=LOSS_RTOL), step
    assert (out / "final" / "lit_model.pth").is_file()  # DDP writes one file


def environment_of(pid: int) -> bytes:
    """The environment a process was started with, each entry between NUL bytes (empty where it has ended)."""
    try:
        return b"\0" + Path(f"/proc/{pid}/environ").read_bytes() + b"\0"
    except OSError:
        return b""


def test_rank_0_gone_before_the_other_joined_ends_it_within_seconds(tmp_path):
    """Fabric's own launch of two processes: rank 0 is stopped before rank 1 has joined the process group, so that
    rank 1 waits in the rendezvous, then killed. Rank 1, which torch.distributed would keep waiting for rank 0's store
    for parallelism.timeout_minutes and longer, ends within seconds with the one line of a lost peer and exit code 75.
    (This process adopts the orphaned rank 1, as Linux's subreaper, to read its exit code.)"""
    import ctypes
    import time

    from fabric_lin.cli import PEER_LOST_EXIT_CODE

    out, log = tmp_path / "out", tmp_path / "run.log"
    libc = ctypes.CDLL(None, use_errno=True)
    subreaper = 36  # prctl's PR_SET_CHILD_SUBREAPER
    assert libc.prctl(subreaper, 1, 0, 0, 0) == 0
    rank_0 = fabric_lin_process.start(command(out, 1, 2, "--parallelism.timeout_minutes", "5"), log, CPU_ONLY)
    rank_1, status, waited = None, None, None
    try:
        def started_by_rank_0():
            """Rank 0's child that is rank 1 (Fabric starts it with LOCAL_RANK=1), not a short-lived helper process
            that rank 0 may run while it starts."""
            return [pid for pid, (_, parent, _) in fabric_lin_process.process_table().items()
                    if parent == rank_0.pid and b"\0LOCAL_RANK=1\0" in environment_of(pid)]

        assert wait_for(started_by_rank_0, rank_0, poll=0.01), fabric_lin_process.describe([rank_0])
        os.kill(rank_0.pid, signal.SIGSTOP)
        [rank_1] = started_by_rank_0()
        # Fabric's line just before torch.distributed's rendezvous, where rank 1 then waits for the stopped rank 0
        assert wait_for(lambda: "GLOBAL_RANK: 1," in log.read_text(), rank_0), log.read_text()[-3000:]
        time.sleep(0.5)
        rank_0.kill()
        assert rank_0.wait(10) == -signal.SIGKILL
        killed = time.monotonic()
        while status is None and time.monotonic() - killed < 30:
            time.sleep(0.05)
            ended, wait_status = os.waitpid(rank_1, os.WNOHANG)
            status = os.waitstatus_to_exitcode(wait_status) if ended else None
        waited = time.monotonic() - killed
    finally:
        libc.prctl(subreaper, 0, 0, 0, 0)
        fabric_lin_process.stop(rank_0)  # and rank 1, in its session, where it still waits
        if rank_1 is not None and status is None:
            os.waitpid(rank_1, 0)  # this process's child now: collected
    assert status == PEER_LOST_EXIT_CODE and waited < 10, f"rank 1: {status} after {waited:.1f} s\n{log.read_text()[-3000:]}"
    said = [line for line in log.read_text().splitlines() if line.startswith("fabric-lin")]
    assert said == [
        f"fabric-lin pretrain: error on rank 1: a peer process of the run ended or became unreachable during the start-up "
        f"(process {rank_0.pid}, the rank that started this one, ended before every process had joined); no checkpoint "
        f"in {out} is complete: to start again, run the same command with --resume auto"], log.read_text()[-3000:]


def test_nodes_that_do_not_meet_stop_at_the_join_bound_in_one_line_each(tmp_path):
    """Fabric's own launch of two nodes of one process each, node 1's MASTER_PORT mistyped: node 0 waits at its port for
    a node that never comes, node 1 at a port where nothing answers, both of which torch.distributed would let wait
    without a word for parallelism.timeout_minutes (30) and longer. With parallelism.join_timeout_minutes at 3 s, each
    says once for what it waits, then stops in one line saying what joined and what to check, with exit code 69; the
    out_dir they share is gone again."""
    import time

    from fabric_lin.errors import JOIN_FAILED_EXIT_CODE

    out, logs = tmp_path / "out", [tmp_path / "node-0.log", tmp_path / "node-1.log"]
    ports = [free_port()]
    while len(ports) < 2:
        ports += [port for port in [free_port()] if port != ports[0]]
    started = time.monotonic()
    nodes = [fabric_lin_process.start(command(out, 2, 1, "--parallelism.join_timeout_minutes", "0.05"), log, {
        **CPU_ONLY, "NODE_RANK": str(node), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        for node, (log, port) in enumerate(zip(logs, ports))]
    codes = fabric_lin_process.wait_all(nodes, TIMEOUT)
    elapsed = time.monotonic() - started
    texts = [log.read_text() for log in logs]
    assert codes == [JOIN_FAILED_EXIT_CODE] * 2 and elapsed < 60, (codes, elapsed, texts[0][-3000:], texts[1][-3000:])
    node_0, node_1 = (f"127.0.0.1:{port}" for port in ports)
    assert [line for line in texts[0].splitlines() if line.startswith("fabric-lin")] == [
        f"fabric-lin pretrain: waiting for 1 of 2 processes to join at {node_0} (missing on node 1); the run stops after "
        f"3 s without them (parallelism.join_timeout_minutes)",
        f"fabric-lin pretrain: error: 1 of 2 processes joined at {node_0} within 3 s (parallelism.join_timeout_minutes; "
        f"missing on node 1): check that the command was started on every node with --num_nodes 2 --devices 1 and the "
        f"same MASTER_ADDR and MASTER_PORT, and that no firewall closes port {ports[0]} to the other nodes; nothing was "
        f"written"], texts[0][-3000:]
    assert [line for line in texts[1].splitlines() if line.startswith("fabric-lin")] == [
        f"fabric-lin pretrain: waiting for rank 0's store at {node_1} (MASTER_ADDR:MASTER_PORT), which answers once node "
        f"0's command runs; this process stops after 3 s without it (parallelism.join_timeout_minutes) (rank 1)",
        f"fabric-lin pretrain: error on rank 1: nothing answered at {node_1} (MASTER_ADDR:MASTER_PORT) within 3 s "
        f"(parallelism.join_timeout_minutes): check that node 0's command runs with the same MASTER_ADDR and MASTER_PORT "
        f"as this node's, and that no firewall closes that port to this node; nothing was written"], texts[1][-3000:]
    assert not any("Traceback" in text for text in texts) and not out.exists()


def test_a_master_port_in_use_is_said_in_one_line(tmp_path):
    """Fabric's own launch of two processes with MASTER_PORT set to a port another process listens on (another run's
    store): rank 0 cannot open its store there, which torch.distributed reports in a traceback, and rank 1, started
    already, would wait for it. Rank 0 ends rank 1 and says in one line which port is in use and what to do (exit 2);
    the out_dir is gone again. (The other mistakes of the address: test_rendezvous.py.)"""
    import socket

    out = tmp_path / "out"
    with socket.socket() as other_run:
        other_run.bind(("127.0.0.1", 0))
        other_run.listen()
        port = other_run.getsockname()[1]
        result = fabric_lin_process.run(command(out, 1, 2), TIMEOUT, {**CPU_ONLY, "MASTER_PORT": str(port)})
    said = [line for line in result.stderr.splitlines() if line.startswith("fabric-lin")]
    assert result.returncode == 2 and said == [
        f"fabric-lin pretrain: error: MASTER_PORT {port} is in use on this host, where rank 0 opens the run's store "
        f"(127.0.0.1:{port}, MASTER_ADDR:MASTER_PORT): another run, or a process left over from one, listens there; "
        f"give another MASTER_PORT, or end that process; nothing was written"], result.stderr[-3000:]
    assert "Traceback" not in result.stderr and not out.exists()


def test_sigkill_of_a_rank_in_the_middle_of_a_save_leaves_no_checkpoint_taken_for_complete(two, tmp_path):
    """Rank 0 is frozen while it saves (its checkpoint directory still `.tmp-`: rank 0 renames it last), then
    killed: rank 1 finds it gone and exits with one line saying so, naming the checkpoint before and how to continue;
    the unfinished checkpoint is never resumed, and the run resumes from the checkpoint before as if never stopped."""
    from fabric_lin.checkpoint import explicit_resume_dir, verify_checkpoint
    from fabric_lin.cli import PEER_LOST_EXIT_CODE

    out = tmp_path / "out"
    out.mkdir()
    ranks = fabric_lin_process.start_ranks(command(out, 1, 2), tmp_path / "logs", 1, 2, free_port(), CPU_ONLY)
    caught = None
    for step in (4, 6):  # a save caught in flight; where one ended before the test froze rank 0, the next one
        unfinished = out / f".tmp-step-{step:08d}"
        reached = wait_for(unfinished.exists, ranks[0], poll=0.001)
        assert reached, f"rank 0 ended before its step-{step} save:\n{fabric_lin_process.describe(ranks)}"
        os.kill(ranks[0].pid, signal.SIGSTOP)
        if not (out / f"step-{step:08d}").exists():
            caught = step
            break
        os.kill(ranks[0].pid, signal.SIGCONT)
    assert caught is not None, "no save was caught before its end"
    os.kill(ranks[0].pid, signal.SIGKILL)
    # the other rank finds its peer gone at its next collective (gloo reads the closed connection) and exits: within
    # 3 s on a machine of 2 cores with load 8; past the bound, the failure says what it was doing
    assert fabric_lin_process.wait_all([ranks[1]], 60) == [PEER_LOST_EXIT_CODE]
    assert ranks[0].wait(10) == -signal.SIGKILL
    survivor = (tmp_path / "logs" / "rank-1.log").read_text()
    said = [line for line in survivor.splitlines() if "error" in line]
    # the connection closed, or reset where rank 0 had not read all that rank 1 sent
    assert len(said) == 1 and re.fullmatch(
        r"fabric-lin pretrain: error on rank 1: a peer process of the run ended or became unreachable during a "
        r"checkpoint save \(gloo: Connection (closed|reset) by peer\); the newest complete checkpoint is "
        + re.escape(str(out / f"step-{caught - 2:08d}")) + ": to continue from it, run the same command with --resume auto",
        said[0]) and "Traceback" not in survivor, survivor[-3000:]
    unfinished = out / f".tmp-step-{caught:08d}"
    assert unfinished.is_dir() and not (out / f"step-{caught:08d}").exists()
    assert not verify_checkpoint(unfinished).ok
    with pytest.raises(ValueError, match="an unfinished checkpoint"):
        explicit_resume_dir(unfinished)
    log = run_ranks(out, 1, 2, "--resume", "auto")
    assert f"Resuming from {out / f'step-{caught - 2:08d}'}" in log
    assert_same_run(out, two)


def test_two_torchrun_agents_of_two_processes_stop_on_sigterm_and_resume_exactly(four, tmp_path):
    """The multi-node tutorial's launch, two nodes of two processes on this host: SIGTERM to both agents saves a
    checkpoint. Resumed with --resume auto (its processes started as the agents start theirs), the run ends with
    the uninterrupted (2, 2) run's losses, samples and weights, bit for bit."""
    fabric_lin = shutil.which("fabric-lin") or pytest.skip("the fabric-lin console script is not installed")
    out = tmp_path / "out"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    logs = [tmp_path / f"node-{node}.log" for node in (0, 1)]
    agents = [fabric_lin_process.start(
        [*torchrun, "--node-rank", str(node), fabric_lin, *command(out, 2, 2)[len(fabric_lin_process.FABRIC_LIN):]],
        log, CPU_ONLY) for node, log in enumerate(logs)]
    wait_for(lambda: max(logged_losses(out), default=0) >= 3, agents[0])
    for agent in agents:
        agent.send_signal(signal.SIGTERM)
    # torchrun exits 1 once signalled (multi_node.md); its workers' line says what happened
    fabric_lin_process.wait_all(agents, TIMEOUT)
    stopped = [line for line in logs[0].read_text().splitlines() if line.startswith("Stopped by SIGTERM at step")]
    assert stopped, logs[0].read_text()[-3000:]
    assert not (out / "final").exists()
    run_ranks(out, 2, 2, "--resume", "auto")
    assert_same_run(out, four)


def test_a_sharded_checkpoint_is_converted_and_evaluated_in_one_process(four, tmp_path):
    """convert_pretrained_checkpoint reassembles the four processes' shards into the weights they hold; evaluate
    reads the sharded checkpoint and the converted model directory alike. A damaged shard is named, and a run
    whose model has other parameters is told which."""
    from fabric_lin.config import Config
    from fabric_lin.convert.pretrained_checkpoint import convert_pretrained_checkpoint
    from fabric_lin.data import SampleCorpus
    from fabric_lin.evaluate import main as evaluate
    from fabric_lin.model import GPT
    from fabric_lin.model_bytes import model_ranges
    from fabric_lin.sharded_checkpoint import load_sharded_train_state

    final = four / "final"
    convert_pretrained_checkpoint(final, tmp_path / "model")
    weights = torch.load(tmp_path / "model" / "lit_model.pth", weights_only=True)
    assert_same_contents(weights, {k.removeprefix("model."): v for k, v in read_dcp(final / "lit_model.pth").items()
                                   if k.startswith("model.")})
    sharded = evaluate(final, max_batches=1, out_dir=tmp_path / "eval-sharded")["lengths"][0]
    converted = evaluate(tmp_path / "model", data=SampleCorpus(), seq_len=64, batch_size=1, max_batches=1,
                         out_dir=tmp_path / "eval-model")["lengths"][0]
    assert sharded["data_fingerprint"] == converted["data_fingerprint"] and sharded["loss"] == converted["loss"]

    # each rank recorded the checksum of its shard's bytes of the model: a byte of them changed is refused, one of the
    # optimizer's state, which a conversion does not read, is not
    manifest = json.loads((final / "manifest.json").read_text())["files"]
    assert all("model_crc32" in manifest[f"lit_model.pth/__{rank}_0.distcp"] for rank in range(4))
    for entry in ("optimizer", "model"):
        damaged = tmp_path / f"damaged-{entry}"
        shutil.copytree(final, damaged)
        offset, length = model_ranges(damaged / "lit_model.pth", entry)["__3_0.distcp"][0]
        with open(damaged / "lit_model.pth" / "__3_0.distcp", "r+b") as f:
            f.seek(offset + length // 2)
            f.write(b"\xff" if f.read(1) != b"\xff" else b"\x00")
    convert_pretrained_checkpoint(tmp_path / "damaged-optimizer", tmp_path / "model-of-damaged-optimizer")
    assert_same_contents(torch.load(tmp_path / "model-of-damaged-optimizer" / "lit_model.pth", weights_only=True), weights)
    with pytest.raises(ValueError, match=r"the checkpoint is damaged: lit_model.pth/__3_0.distcp's bytes of the model "
                                         r"changed"):
        convert_pretrained_checkpoint(tmp_path / "damaged-model", tmp_path / "model2")

    class Loader:
        def load_state_dict(self, state):
            pass

    other = GPT(Config.from_name("gla-debug", num_layers=1))
    state = {"model": other, "optimizer": torch.optim.AdamW(other.parameters()), "train_dataloader": Loader()}
    with pytest.raises(ValueError, match=r"the checkpoint's model does not fit this run's: missing \[\], unexpected \['layers.1"):
        load_sharded_train_state(final / "lit_model.pth", state)


def test_an_error_every_rank_meets_is_printed_once(tmp_path):
    """Two processes (Fabric's own launch) both find the --resume directory missing (after the launch): rank 0
    alone reports it; the out_dir the run created is removed again."""
    missing = tmp_path / "nothing"
    result = fabric_lin_process.run(command(tmp_path / "out", 1, 2, "--resume", str(missing)), TIMEOUT, CPU_ONLY)
    assert result.returncode == 2
    line = (f"fabric-lin pretrain: error: --resume {missing} does not exist: expected a training checkpoint (a run's "
            f"step-XXXXXXXX/ or final/)\n")
    assert (result.stdout + result.stderr).count(line) == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()
