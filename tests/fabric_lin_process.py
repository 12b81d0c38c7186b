"""`fabric-lin` as a process of its own, started the way the tests need: `run` to its end (its output captured),
`start` in the background (its output in a file, in a session of its own where a test sends signals to the whole
job as a terminal or a scheduler does).

On a machine without CUDA (CI's), `python -m fabric_lin.cli ...` is forked from an interpreter that has imported
the libraries it spends ~4 of a debug run's ~6 s importing (torch, torch._dynamo through lightning_fabric, litdata,
jsonargparse, triton) and nothing else: multiprocessing's forkserver, one per pytest worker. The run still imports
fabric_lin afresh and executes `fabric_lin.cli` as `__main__`, in its own process: its own pid, session, working
directory, environment, stdout and stderr, signal handlers, exit code (or -signal) and DataLoader workers (forked
from it, as from any Python on Linux); the other ranks of a multi-process run are started by Fabric as new Pythons.
A new Python starts for every other command, where CUDA is present (a CUDA context must not come through a fork),
and where the environment differs from this one in a variable a library reads as it is imported (HF_HOME,
TRITON_INTERPRET): any variable but OMP_NUM_THREADS and CUDA_VISIBLE_DEVICES (read when used), PYTEST_CURRENT_TEST
(read by nothing; an environment copied at import, as helpers.CPU_ONLY, holds another test's) and torchrun's
rendezvous variables (read when the process group starts; Lightning's rank_zero_only rank, read at import, is set
again by Fabric's strategy as it starts).

`start_ranks` starts the processes of a multi-process run as torchrun's agents would, one per rank with torchrun's
variables set, forked as above: Fabric then launches nothing itself, as under torchrun. (Fabric's own launch of
`--devices N` starts the other ranks as new Pythons: a second import of torch for each.)
"""
import atexit
import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Dict, List, Optional, Union

import torch

FABRIC_LIN = [sys.executable, "-m", "fabric_lin.cli"]
PRELOADED = ["fabric_lin_process", "torch", "torch._dynamo", "lightning_fabric", "litdata", "jsonargparse", "triton"]
_forkserver = None


def forkable(command: List[str], env: Optional[Dict[str, str]]) -> bool:
    if command[:3] != FABRIC_LIN or torch.cuda.is_available():
        return False
    env = os.environ if env is None else env
    changed = {key for key in set(os.environ) | set(env) if os.environ.get(key) != env.get(key)}
    # read when used (CUDA is not, on this machine); PYTEST_CURRENT_TEST, which pytest sets for each test, by nothing
    return changed <= {"OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "PYTEST_CURRENT_TEST", *TORCHRUN_VARIABLES}


TORCHRUN_VARIABLES = ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK",
                      "LOCAL_WORLD_SIZE", "GROUP_RANK")


def _as_fabric_lin(argv: List[str], env: Dict[str, str], cwd: str, stdout: str, stderr: str, new_session: bool) -> None:
    """In the forked process: become `python -m fabric_lin.cli <argv>`, to its exit as Python's: the exit code
    SystemExit's (1 after an uncaught exception's traceback), the atexit functions run."""
    if new_session:
        os.setsid()
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, stdout), (2, stderr)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.argv = [FABRIC_LIN[2], *argv]
    multiprocessing.set_start_method(None, force=True)  # the platform's own (fork on Linux), not the forkserver
    try:
        runpy.run_module("fabric_lin.cli", run_name="__main__", alter_sys=True)
        status = None
    except SystemExit as stop:
        status = stop.code
    except BaseException:
        traceback.print_exc()
        status = 1
    # Out of the except blocks, the failure's traceback no longer holds the run's frames, nor what they hold (the
    # DataLoader's workers, shut down as their iterator goes): as at Python's exit, before the atexit functions
    atexit._run_exitfuncs()
    sys.exit(status)


class ForkedRun:
    """A forked run, answering as subprocess.Popen does (pid, poll, wait, returncode, send_signal, kill)."""

    def __init__(self, command: List[str], process: multiprocessing.Process):
        self.args, self._process, self.pid = command, process, process.pid

    @property
    def returncode(self) -> Optional[int]:
        return self._process.exitcode

    def poll(self) -> Optional[int]:
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        self._process.join(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(9)


def start(command: List[str], log: Union[str, Path], env: Optional[Dict[str, str]] = None,
          new_session: bool = False) -> Union[subprocess.Popen, ForkedRun]:
    """`command` in the background, stdout and stderr appended to `log`."""
    return _start(command, str(log), str(log), env, new_session)


def run(command: List[str], timeout: float, env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    """`command` to its end (killed past `timeout`, raising subprocess.TimeoutExpired), its output captured."""
    if not forkable(command, env):
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        proc = _start(command, str(out), str(err), env, False)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        return subprocess.CompletedProcess(command, proc.returncode, out.read_text(), err.read_text())


def _start(command, stdout: str, stderr: str, env, new_session: bool):
    global _forkserver
    for path in (stdout, stderr):  # there before start returns, as a subprocess's output file is
        Path(path).touch()
    if not forkable(command, env):
        log = open(stdout, "ab")
        try:
            return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=new_session)
        finally:
            log.close()
    if _forkserver is None:
        _forkserver = multiprocessing.get_context("forkserver")
        _forkserver.set_forkserver_preload(PRELOADED)
    process = _forkserver.Process(target=_as_fabric_lin, daemon=False, args=(
        command[3:], dict(os.environ if env is None else env), os.getcwd(), stdout, stderr, new_session))
    process.start()
    return ForkedRun(command, process)


def start_ranks(command: List[str], log_dir: Union[str, Path], nodes: int, devices: int, port: int,
                env: Optional[Dict[str, str]] = None) -> List[Union[subprocess.Popen, ForkedRun]]:
    """The `nodes x devices` processes of a run of `command` on this machine, as torchrun's agents start them
    (torchrun's variables, a rendezvous at 127.0.0.1:`port`), in rank order; rank r's output in log_dir/rank-r.log."""
    env = dict(os.environ if env is None else env)
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    ranks = []
    for rank in range(nodes * devices):
        variables = dict(TORCHELASTIC_RUN_ID="fabric-lin-test", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                         WORLD_SIZE=str(nodes * devices), RANK=str(rank), LOCAL_RANK=str(rank % devices),
                         LOCAL_WORLD_SIZE=str(devices), GROUP_RANK=str(rank // devices))
        ranks.append(start(command, Path(log_dir) / f"rank-{rank}.log", {**env, **variables}))
    return ranks
