"""Fabric's own multi-node launch (tutorials/multi_node.md: NODE_RANK, MASTER_ADDR and MASTER_PORT set by hand on each
node) with a variable that is no node or port: one line naming the variable, its value and what is expected, before
any process starts, where a MASTER_PORT or NODE_RANK that is no number was int()'s traceback, and a NODE_RANK past the
last node (or any but 0 with --num_nodes 1) gave ranks past the run's last, which waited until the join bound (10
minutes). torchrun checks its own port; its variables are not Fabric's launch."""
import pytest

from fabric_lin.errors import InvalidValue
from helpers import DEBUG_ARGS, cli_error, run_forked_ranks

LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID",
                      "SLURM_NTASKS", "LSB_JOBID", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
BY_HAND = {"NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
EXPECTED_NODE = "expected this node's number among the run's --num_nodes 2, from 0 to 1 (0 on node 0, whose address " \
                "MASTER_ADDR is)"
EXPECTED_PORT = ("expected a port number from 1 to 65535 (a port free on node 0, the same on every node; on one "
                 "node, leave it unset for a free one)")


@pytest.mark.parametrize("name, value, expected", [("NODE_RANK", "x", EXPECTED_NODE), ("NODE_RANK", "2", EXPECTED_NODE),
                                                   ("NODE_RANK", "-1", EXPECTED_NODE), ("MASTER_PORT", "abc", EXPECTED_PORT),
                                                   ("MASTER_PORT", "70000", EXPECTED_PORT)])
def test_a_launch_variable_that_is_no_node_or_port_is_one_line(tmp_path, capsys, monkeypatch, name, value, expected):
    from fabric_lin.parallelism import check_launch_variables

    for variable in LAUNCHER_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    for variable, given in {**BY_HAND, name: value}.items():
        monkeypatch.setenv(variable, given)
    with pytest.raises(InvalidValue):  # first: were the check missing, the command below would wait or fail later
        check_launch_variables(1, 2)
    err = cli_error(["pretrain", "--model_name", "gla-debug", "--out_dir", str(tmp_path / "out"), "--train.max_steps", "1",
                     "--train.global_batch_size", "2", "--train.micro_batch_size", "1", "--devices", "1",
                     "--num_nodes", "2"], capsys)
    assert err == f"fabric-lin pretrain: error: {name} {value!r}: {expected}\n"
    assert not (tmp_path / "out").exists()


def test_node_rank_on_one_node_and_what_is_left_alone(monkeypatch):
    """NODE_RANK 1 with --num_nodes 1 (left in the shell from a multi-node run): the processes took ranks 2 and 3 of a
    run of 2. One process reads none of these variables; torchrun's processes and SLURM's node numbers are theirs."""
    from fabric_lin.parallelism import check_launch_variables

    for variable in LAUNCHER_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("NODE_RANK", "1")
    with pytest.raises(InvalidValue, match=r"^NODE_RANK '1': expected this node's number among the run's --num_nodes 1, "
                                           r"from 0 to 0 "):
        check_launch_variables(2, 1)
    check_launch_variables(1, 1)
    monkeypatch.setenv("NODE_RANK", "0")
    monkeypatch.setenv("MASTER_PORT", "29500")
    check_launch_variables(2, 1)
    check_launch_variables(8, 4)
    with monkeypatch.context() as slurm:
        slurm.setenv("NODE_RANK", "7")
        slurm.setenv("SLURM_NTASKS", "16")
        slurm.setenv("SLURM_JOB_NAME", "gla")
        slurm.setenv("SLURM_NODELIST", "n[1-2]")
        slurm.setenv("SLURM_PROCID", "0")
        slurm.setenv("SLURM_LOCALID", "0")
        slurm.setenv("SLURM_NODEID", "0")
        check_launch_variables(8, 2)


def launched_by_hand(monkeypatch, **variables) -> None:
    """The environment of one node of Fabric's own launch (BY_HAND), with `variables` set beside or over it."""
    for variable in LAUNCHER_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    for variable, given in {**BY_HAND, **variables}.items():
        monkeypatch.setenv(variable, given)


@pytest.mark.parametrize("name, value", [("MASTER_PORT", "0"), ("MASTER_PORT", "65536"), ("MASTER_PORT", ""),
                                         ("GROUP_RANK", "2"), ("NODE_RANK", "\u00b2"), ("MASTER_PORT", "\u00b2")])
def test_a_port_past_either_end_an_empty_one_and_a_group_rank_past_the_last_node_are_refused(monkeypatch, name, value):
    """Port 0 is "any free port" to the process that listens, which the other nodes cannot know; the empty port was
    int()'s traceback; GROUP_RANK is Fabric's node number where NODE_RANK is not set. A superscript two is a digit to
    str.isdigit, not to int(), whose traceback it was."""
    launched_by_hand(monkeypatch, **{name: value})
    if name == "GROUP_RANK":
        monkeypatch.delenv("NODE_RANK")
    from fabric_lin.parallelism import check_launch_variables

    with pytest.raises(InvalidValue, match=rf"^{name} {value!r}: expected "):
        check_launch_variables(1, 2)


def test_what_fabric_reads_as_a_port_and_node_and_other_launchers_variables_are_left_alone(monkeypatch):
    """The last port and one written with spaces around it (Fabric's int() reads it) pass. Under torchrun a NODE_RANK
    left in the shell is not read (GROUP_RANK is), nor under LSF's jsrun; SLURM's MASTER_PORT is read, and checked."""
    from fabric_lin.parallelism import check_launch_variables

    for port in ("65535", " 29500\n"):
        launched_by_hand(monkeypatch, MASTER_PORT=port, NODE_RANK="1")
        check_launch_variables(4, 2)
    launched_by_hand(monkeypatch, NODE_RANK="5", TORCHELASTIC_RUN_ID="run", GROUP_RANK="1", RANK="4", LOCAL_RANK="0",
                     WORLD_SIZE="8", LOCAL_WORLD_SIZE="4")
    check_launch_variables(4, 2)
    launched_by_hand(monkeypatch, NODE_RANK="5", LSB_JOBID="1", LSB_DJOB_RANKFILE="/tmp/ranks",
                     JSM_NAMESPACE_LOCAL_RANK="0", JSM_NAMESPACE_SIZE="8")
    check_launch_variables(4, 2)
    launched_by_hand(monkeypatch, MASTER_PORT="abc", SLURM_NTASKS="8", SLURM_JOB_NAME="gla", SLURM_NODELIST="n[1-2]",
                     SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0")
    with pytest.raises(InvalidValue, match=r"^MASTER_PORT 'abc': expected a port number from 1 to 65535"):
        check_launch_variables(4, 2)


def _node_by_hand(rank: int, port: int, out_dir, other_node: list) -> None:
    import os
    import sys

    from fabric_lin import cli

    for variable in LAUNCHER_VARIABLES:
        os.environ.pop(variable, None)
    os.environ.update(NODE_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    sys.stderr = open(out_dir.parent / f"stderr-{rank}", "w")
    os.dup2(sys.stderr.fileno(), 2)  # what a signal handler writes itself too
    sys.stdout = open(out_dir.parent / f"stdout-{rank}", "w")
    cli.main(["pretrain", *DEBUG_ARGS, "--out_dir", str(out_dir), "--devices", "1", "--num_nodes", "2",
              *(other_node if rank == 1 else [])])


def test_a_node_started_with_another_command_than_node_0_s_is_refused_by_every_node(tmp_path):
    """Two nodes by hand, node 1 given another seed and data: they would train one model together, each node its own
    replica of other initial weights on other samples, and save rank 0's; every node stops before its first step."""
    codes = run_forked_ranks(lambda rank, port: _node_by_hand(
        rank, port, tmp_path / "out", ["--seed", "7", "--data", "SampleCorpus", "--data.seed", "7"]), timeout=60)
    said = [(tmp_path / f"stderr-{rank}").read_text() for rank in range(2)]
    assert codes == [2, 2], said
    expected = ("the processes of this run were started with different commands, which would train one model on mixed "
                "weights and data: data.seed: 42 on rank 0 (node 0), 7 on rank 1 (node 1); seed: 42 on rank 0 (node 0), 7 on "
                "rank 1 (node 1). Start every node")
    assert f"fabric-lin pretrain: error: {expected}" in said[0]
    assert f"fabric-lin pretrain: error on rank 1: {expected}" in said[1]
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def _node_by_hand_given_ctrl_c(rank: int, port: int, out_dir) -> None:
    import os
    import signal

    from fabric_lin import stopping

    if rank == 1:  # Ctrl-C in node 1's shell alone, as the run starts
        enter = stopping.StopRequest.__enter__

        def enter_and_interrupt(self):
            entered = enter(self)
            os.kill(os.getpid(), signal.SIGINT)
            return entered

        stopping.StopRequest.__enter__ = enter_and_interrupt
    _node_by_hand(rank, port, out_dir, [])


def test_ctrl_c_in_the_shell_of_node_1_is_answered_there_and_ends_that_command_with_130(tmp_path):
    """Each node started by hand has a shell of its own: the node that got the Ctrl-C says at once that it stops with
    a checkpoint, and its command ends as one stopped by Ctrl-C does; node 0's, which got none, ends with 0."""
    codes = run_forked_ranks(lambda rank, port: _node_by_hand_given_ctrl_c(rank, port, tmp_path / "out"), timeout=60)
    said = [(tmp_path / f"stderr-{rank}").read_text() for rank in range(2)]
    assert codes == [0, 130], said
    assert "Ctrl-C: stopping with a checkpoint" not in said[0] and "Ctrl-C: stopping with a checkpoint" in said[1]
    assert "Stopped by SIGINT" in (tmp_path / "stdout-1").read_text(), (tmp_path / "stdout-1").read_text()


def test_the_settings_that_differ_are_named_with_their_values_ranks_and_nodes():
    """Two nodes of two processes: each setting that differs with every value it has and where, the first three of
    them and how many more (a key one process lacks differs too); processes alike, nothing."""
    from fabric_lin.run_identity import settings_across_processes

    node_0, node_1 = {"a": 1, "b": 2, "c": 3, "d": 4, "e": 5}, {"a": 1, "b": 9, "c": 8, "d": 7}
    line = settings_across_processes([node_0, dict(node_0), node_1, {**node_1, "b": 2}], devices=2)
    assert line.startswith("the processes of this run were started with different commands, which would train one "
                           "model on mixed weights and data: b: 2 on ranks 0, 1 and 3 (nodes 0 and 1), 9 on rank 2 "
                           "(node 1); c: 3 on ranks 0 and 1 (node 0), 8 on ranks 2 and 3 (node 1); d: 4 on ranks 0 and 1 "
                           "(node 0), 7 on ranks 2 and 3 (node 1); and 1 more. Start every node"), line
    assert settings_across_processes([node_0, dict(node_0)], devices=1) is None
