"""tests/fabric_lin_process.py, how the tests run processes (and helpers.wait_for): whatever ends the wait for one (its
time bound, a failure raised into it as pytest-timeout raises one, the test's end), no process of it is left running,
and a process that did not end is named. The processes here are tiny Pythons that hang: each starts a child in its
own session and one in a session of its own (as torchrun's agent starts its workers), writes the three ids, then
sleeps."""
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import fabric_lin_process
from helpers import wait_for

HANGING = """
import os, subprocess, sys, time
sleep = [sys.executable, "-c", "import time; time.sleep(600)"]
children = [subprocess.Popen(sleep, start_new_session=own_session) for own_session in (False, True)]
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(" ".join(str(pid) for pid in (os.getpid(), *(child.pid for child in children))))
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
print("waiting for a peer", "that never comes", flush=True)
time.sleep(600)
"""


def hanging(pids: Path) -> list:
    return [sys.executable, "-c", HANGING, str(pids)]


def started(pids: Path, timeout: float = 30) -> list:
    """The ids of a hanging process and its two children, once it has written them."""
    deadline = time.monotonic() + timeout
    while not pids.exists():
        assert time.monotonic() < deadline, "the hanging process did not start its children"
        time.sleep(0.01)
    return [int(pid) for pid in pids.read_text().split()]


def running(pid: int) -> bool:
    """Whether process `pid` exists and has not ended (a zombie, ended but not yet collected by its parent, has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_a_run_past_its_bound_is_killed_with_every_process_it_started(tmp_path):
    pids = tmp_path / "pids"
    start = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        fabric_lin_process.run(hanging(pids), timeout=1)
    assert time.monotonic() - start < 10
    main, child, own_session_child = started(pids, timeout=0)
    message = str(info.value)
    assert message.startswith(f"1 of 1 processes did not end within 1 s, each killed with every process it started:\n"
                              f"pid {main}: ")
    assert "\n    waiting for a peer that never comes" in message  # the end of its output
    assert not [pid for pid in (main, child, own_session_child) if running(pid)]


def test_ranks_are_waited_for_with_one_bound_and_the_one_that_hung_is_named(tmp_path):
    pids = tmp_path / "pids"
    ranks = [fabric_lin_process.start([sys.executable, "-c", "pass"], tmp_path / "rank-0.log"),
             fabric_lin_process.start(hanging(pids), tmp_path / "rank-1.log")]
    processes = started(pids)
    with pytest.raises(TimeoutError) as info:
        fabric_lin_process.wait_all(ranks, timeout=0.5)
    message = str(info.value)
    assert message.startswith(f"1 of 2 processes did not end within 0.5 s, each killed with every process it started:\n"
                              f"pid {processes[0]}: ")
    assert f"the end of {tmp_path / 'rank-1.log'}:\n    waiting for a peer that never comes" in message
    assert "rank-0.log" not in message
    assert ranks[0].returncode == 0 and ranks[1].returncode == -signal.SIGKILL
    assert not [pid for pid in processes if running(pid)]


def test_a_process_that_did_not_end_is_said_to_be_stopped_or_waiting(tmp_path):
    """What each process that did not end was doing when its wait's bound came, read before it is killed: one stopped
    by SIGSTOP is said to be, one waiting (here in a sleep) is said to be sleeping in the kernel's wait."""
    ranks = [fabric_lin_process.start(hanging(tmp_path / f"pids-{rank}"), tmp_path / f"rank-{rank}.log") for rank in (0, 1)]
    stopped = started(tmp_path / "pids-0")[0]
    started(tmp_path / "pids-1")
    ranks[0].send_signal(signal.SIGSTOP)
    with pytest.raises(TimeoutError) as info:
        fabric_lin_process.wait_all(ranks, timeout=0.5)
    message = str(info.value)
    # each process's state is the line under its command (the command, a script, spans lines), before its output's
    assert message.index(f"pid {stopped}: ") < message.index("\n  stopped by a signal") < message.index("rank-0.log")
    assert message.index("rank-0.log") < message.index("\n  sleeping, in ") < message.index("rank-1.log")


class Interrupted(BaseException):
    """What pytest-timeout raises from its SIGALRM handler: a BaseException, no Exception."""


def test_a_wait_ended_by_a_failure_raised_into_it_kills_every_process(tmp_path, capsys):
    """The failure of pytest-timeout's signal method, raised while a run is waited for (once the run is under way):
    the run is killed, and stderr names it."""
    pids = tmp_path / "pids"

    def interrupt(signum, frame):
        raise Interrupted()

    def interrupt_once_started():
        started(pids)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)

    previous = signal.signal(signal.SIGUSR1, interrupt)
    try:
        threading.Thread(target=interrupt_once_started, daemon=True).start()
        with pytest.raises(Interrupted):
            fabric_lin_process.run(hanging(pids), timeout=60)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    processes = started(pids)
    assert not [pid for pid in processes if running(pid)]
    assert capsys.readouterr().err.startswith("1 of 1 processes had not ended when the wait for them was interrupted, "
                                              f"each killed with every process it started:\npid {processes[0]}: ")


def test_processes_left_running_by_a_test_are_killed_when_it_ends(tmp_path):
    pids = tmp_path / "pids"
    job = fabric_lin_process.start(hanging(pids), tmp_path / "job.log")
    processes = started(pids)
    assert fabric_lin_process.stop_all() == [job]  # what the tests' teardown (conftest.py) calls
    assert not [pid for pid in processes if running(pid)]
    assert fabric_lin_process.stop_all() == []


def test_a_run_that_never_reaches_the_awaited_point_is_killed_with_every_process_it_started(tmp_path):
    pids = tmp_path / "pids"
    job = fabric_lin_process.start(hanging(pids), tmp_path / "job.log")
    processes = started(pids)
    expected = rf"(?s)^pid {processes[0]}, .* did not reach the expected point within 0.3 s: killed"
    with pytest.raises(TimeoutError, match=expected):
        wait_for(lambda: False, job, timeout=0.3)
    assert not [pid for pid in processes if running(pid)]


ENVIRONMENT_OF_THREE_TESTS = """
import os

import pytest
from lightning_fabric.utilities.seed import seed_everything

import fabric_lin_process

BEFORE = dict(os.environ)


def unchanged():
    changed = {key for key in set(BEFORE) | set(os.environ) if BEFORE.get(key) != os.environ.get(key)}
    assert changed <= {"PYTEST_CURRENT_TEST"}, changed
    assert fabric_lin_process.forkable(fabric_lin_process.FABRIC_LIN + ["pretrain"], BEFORE)


@pytest.fixture(scope="module")
def trained_here():
    seed_everything(3, verbose=False)  # as a module's training run in this process does (evaluate's)
    return 3


def test_that_seeds():
    seed_everything(7, verbose=False)  # as pretrain's main and build_model do
    assert os.environ["PL_GLOBAL_SEED"] == "7" and "PL_SEED_WORKERS" in os.environ


def test_after_it():
    unchanged()


def test_with_a_module_fixture_that_seeded(trained_here):
    unchanged()
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA every run starts a new Python")
def test_a_tests_changes_to_the_environment_are_undone_so_the_next_run_is_forked(pytester):
    """Lightning's seed_everything sets PL_GLOBAL_SEED and PL_SEED_WORKERS; left set after the test or the module
    fixture that called it, every later run of the pytest worker differs from an environment copied before
    (helpers.CPU_ONLY) and starts as a new Python instead of a fork. Three tests run with this suite's conftest: the
    one after a test that seeded and the one using a module fixture that seeded find the environment the first found,
    and a run either starts with that environment is forked."""
    pytester.makepyfile(test_three=ENVIRONMENT_OF_THREE_TESTS)
    result = pytester.runpytest_inprocess("-p", "conftest", "-p", "no:cacheprovider", "-q")
    result.assert_outcomes(passed=3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA every run starts a new Python")
def test_a_forked_script_sees_what_a_new_python_would_and_ends_as_it_does(tmp_path):
    """`python script.py` and `python -c` forked (scripts=True): the script's argv, its folder (or, for -c, the working
    directory) first on sys.path, __name__ "__main__"; an uncaught KeyboardInterrupt ends the process by SIGINT, as
    Python's own ending does, after its traceback."""
    script = tmp_path / "script.py"
    assert fabric_lin_process.forkable([sys.executable, str(script)], None, scripts=True)
    script.write_text("import sys\nprint(sys.argv, sys.path[0], __name__)\nif sys.argv[1:] == ['stop']:\n"
                      "    raise KeyboardInterrupt\n")
    done = fabric_lin_process.run([sys.executable, str(script), "a"], 60, scripts=True)
    assert (done.returncode, done.stdout) == (0, f"{[str(script), 'a']} {tmp_path} __main__\n"), done.stderr
    stopped = fabric_lin_process.run([sys.executable, str(script), "stop"], 60, scripts=True)
    assert stopped.returncode == -signal.SIGINT and stopped.stderr.endswith("KeyboardInterrupt\n"), stopped.stderr
    code = fabric_lin_process.run([sys.executable, "-c", "import sys; print(sys.argv, repr(sys.path[0]))", "b"], 60,
                                  cwd=tmp_path, scripts=True)
    assert (code.returncode, code.stdout) == (0, "['-c', 'b'] ''\n"), code.stderr
