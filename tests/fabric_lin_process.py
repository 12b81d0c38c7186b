"""`fabric-lin` as a process of its own, started the way the tests need: `run` to its end (its output captured),
`start` in the background (its output in a file). Each process starts a session of its own, so that a test sends a
signal to the whole job (the run, its DataLoader workers, the ranks Fabric launched) as a terminal or a scheduler
does, and so that nothing of it outlives the test: every wait here has a bound, and whatever ends a wait (the bound,
pytest-timeout's failure, Ctrl-C) or the test (conftest.py's teardown calls `stop_all`) kills every process the job
started. A rank left waiting for a peer that hung would hold a core, and keep pytest from exiting: at exit,
multiprocessing joins the forked runs below.

On a machine without CUDA (CI's), `python -m fabric_lin.cli ...` is forked from an interpreter that has imported
the libraries it spends ~4 of a debug run's ~6 s importing (torch, torch._dynamo through lightning_fabric, litdata,
jsonargparse, triton) and nothing else: multiprocessing's forkserver, one per pytest worker. The run still imports
fabric_lin afresh and executes `fabric_lin.cli` as `__main__`, in its own process: its own pid, session, working
directory, environment, stdout and stderr, signal handlers, exit code (or -signal) and DataLoader workers (forked
from it, as from any Python on Linux); the other ranks of a multi-process run are started by Fabric as new Pythons.
A new Python starts for every other command, where CUDA is present (a CUDA context must not come through a fork),
and where the environment differs from this one in a variable a library reads as it is imported (HF_HOME,
TRITON_INTERPRET): any variable but OMP_NUM_THREADS and CUDA_VISIBLE_DEVICES (read when used), PYTEST_CURRENT_TEST
(read by nothing; an environment copied at import, as helpers.CPU_ONLY, holds another test's), torchrun's
rendezvous variables and Fabric's NODE_RANK (read when the process group starts; Lightning's rank_zero_only rank, read
at import, is set again by Fabric's strategy as it starts).

With `scripts=True`, `python script.py ...` and `python -c code ...` are forked the same way (the script run as
`__main__`, its folder, or the working directory for -c, first on sys.path), for the tests whose scripts set nothing
that an import reads before their imports (a script that sets TRITON_INTERPRET itself, say, must start anew).

`start(..., held_before=NAME)` starts a run that stops just before it renames a finished temporary file onto NAME (the
last step of `fabric_lin.files.atomic_write`), says so on stdout and waits there: a test's signal then reaches the
command mid-write, at a point it knows, not after a guessed sleep.

`run(..., tmpfs=(PATH, SIZE, COPY_TO))` runs a command where PATH is a tmpfs of SIZE, in a mount namespace of its own
(`enter_small_tmpfs`), and copies what it wrote there to COPY_TO at its end: a full disk without a new Python.

`start_ranks` starts the processes of a multi-process run as torchrun's agents would, one per rank with torchrun's
variables set, forked as above: Fabric then launches nothing itself, as under torchrun. (Fabric's own launch of
`--devices N` starts the other ranks as new Pythons: a second import of torch for each.)
"""
import atexit
import multiprocessing
import multiprocessing.util
import os
import runpy
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple, Union

import torch

FABRIC_LIN = [sys.executable, "-m", "fabric_lin.cli"]
PRELOADED = ["fabric_lin_process", "torch", "torch._dynamo", "lightning_fabric", "litdata", "jsonargparse", "triton"]
_forkserver = None
STOP_TIMEOUT = 30  # seconds for processes sent SIGKILL to be gone (they go at once, unless stuck in the kernel)


def is_python_script(command: List[str]) -> bool:
    """`python script.py ...` or `python -c code ...`, as this Python runs them."""
    return len(command) >= 2 and command[0] == sys.executable and (command[1] == "-c" or command[1].endswith(".py"))


def forkable(command: List[str], env: Optional[Dict[str, str]], scripts: bool = False) -> bool:
    if not (command[:3] == FABRIC_LIN or scripts and is_python_script(command)) or torch.cuda.is_available():
        return False
    env = os.environ if env is None else env
    changed = {key for key in set(os.environ) | set(env) if os.environ.get(key) != env.get(key)}
    # read when used (CUDA is not, on this machine); PYTEST_CURRENT_TEST, which pytest sets for each test, by nothing
    return changed <= {"OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "PYTEST_CURRENT_TEST", *TORCHRUN_VARIABLES, "NODE_RANK"}


TORCHRUN_VARIABLES = ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK",
                      "LOCAL_WORLD_SIZE", "GROUP_RANK")


HELD = "held before renaming a temporary file onto {}"


def hold_before_renaming_onto(name: str) -> None:
    """In the run's process, before the command starts: its first rename of a file onto one named `name` (os.replace,
    as atomic_write makes a finished temporary file the output) prints HELD, then sleeps instead, until a signal
    ends the sleep (its handler raising, as SIGTERM's does in every command but pretrain) or the test kills the run."""
    replace = os.replace

    def held(src, dst, *args, **kwargs):
        if Path(dst).name == name:
            print(HELD.format(name), flush=True)
            while True:
                time.sleep(60)
        return replace(src, dst, *args, **kwargs)

    os.replace = held


def run_held(argv: List[str]) -> None:
    """`python -c` that imported this module: argv is [the file name to hold before (or ""), fabric-lin's arguments]."""
    if argv[0]:
        hold_before_renaming_onto(argv[0])
    sys.argv = [FABRIC_LIN[2], *argv[1:]]
    runpy.run_module("fabric_lin.cli", run_name="__main__", alter_sys=True)


def _main_of(command: List[str]):
    """What `command` (`python -m fabric_lin.cli ...`, `python script.py ...` or `python -c code ...`) runs as
    __main__, as a function, once sys.argv and sys.path are set as that Python's would be."""
    if command[:3] == FABRIC_LIN:
        sys.argv = [FABRIC_LIN[2], *command[3:]]
        return lambda: runpy.run_module("fabric_lin.cli", run_name="__main__", alter_sys=True)
    if command[1] == "-c":
        sys.argv = ["-c", *command[3:]]
        sys.path.insert(0, "")  # the working directory first, as for `python -c`
        return lambda: exec(compile(command[2], "<string>", "exec"), {"__name__": "__main__"})
    sys.argv = command[1:]
    sys.path.insert(0, str(Path(command[1]).resolve().parent))  # the script's folder first, as `python script.py`
    return lambda: runpy.run_path(command[1], run_name="__main__")


# Linux's constants (sched.h, mount.h) for enter_small_tmpfs
CLONE_NEWNS, CLONE_NEWUSER, MS_REC, MS_PRIVATE = 0x00020000, 0x10000000, 0x4000, 0x40000


def enter_small_tmpfs(path: str, size: str) -> None:
    """This process (single-threaded, as a forked one is) in a user namespace of its own, where it is root, and a mount
    namespace of its own, with `path` a tmpfs of `size` (e.g. "1536k"): what `unshare --user --map-root-user --mount
    sh -c "mount -t tmpfs -o size=SIZE tmpfs PATH"` makes for the commands it runs. The tmpfs goes with the process;
    other processes see neither it nor the namespaces. OSError where the kernel refuses a step."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    def check(result: int, what: str) -> None:
        if result != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"{what}: {os.strerror(error)}")

    uid, gid = os.getuid(), os.getgid()
    check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS), "unshare")
    for name, line in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
        Path(f"/proc/self/{name}").write_text(line)
    # mounts made here stay here (unshare's own --propagation private)
    check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")
    check(libc.mount(b"tmpfs", str(path).encode(), b"tmpfs", 0, f"size={size}".encode()), f"mount tmpfs {path}")


def _as_fabric_lin(command: List[str], env: Dict[str, str], cwd: str, stdout: str, stderr: str,
                   held_before: Optional[str] = None, tmpfs: Optional[Tuple[str, str, Optional[str]]] = None) -> None:
    """In the forked process: become `command` (a fabric-lin command, or a Python script: `_main_of`) in a session
    of its own, to its exit as Python's: the exit code SystemExit's (1 after an uncaught exception's traceback), the
    atexit functions run. `tmpfs`: (path, size, copy_to), as `run` takes it."""
    os.setsid()
    # Ctrl-C raises KeyboardInterrupt, as in a Python started in a terminal's foreground job, also where this pytest
    # runs as a shell's background job (`pytest &`), which leaves SIGINT ignored in every process it starts
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, stdout), (2, stderr)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(target, fd)
        os.close(target)
    if held_before:
        hold_before_renaming_onto(held_before)
    if tmpfs is not None:
        enter_small_tmpfs(tmpfs[0], tmpfs[1])
    main = _main_of(command)
    multiprocessing.set_start_method(None, force=True)  # the platform's own (fork on Linux), not the forkserver
    interrupted = False
    try:
        main()
        status = None
    except SystemExit as stop:
        status = stop.code
    except BaseException as failure:
        traceback.print_exc()
        status, interrupted = 1, isinstance(failure, KeyboardInterrupt)
    # Out of the except blocks, the failure's traceback no longer holds the run's frames, nor what they hold (the
    # DataLoader's workers, shut down as their iterator goes): as at Python's exit, before the atexit functions
    atexit._run_exitfuncs()
    if tmpfs is not None and tmpfs[2] is not None:  # before the tmpfs goes with this process
        shutil.copytree(tmpfs[0], tmpfs[2], symlinks=True, dirs_exist_ok=True)
    if interrupted:  # Python ends on an uncaught KeyboardInterrupt by SIGINT, its default action, once it is done
        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    sys.exit(status)


class ForkedRun:
    """A forked run, answering as subprocess.Popen does (args, pid, poll, wait, returncode, send_signal, kill), with
    the files its output goes to (`logs`: stdout's, and stderr's where it is another)."""

    def __init__(self, command: List[str], process: multiprocessing.Process, logs: List[str]):
        self.args, self._process, self.pid, self.logs = command, process, process.pid, logs

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


class LoggedPopen(subprocess.Popen):
    """subprocess.Popen with the files its output goes to (`logs`), as ForkedRun."""

    def __init__(self, command: List[str], logs: List[str], **kwargs):
        super().__init__(command, **kwargs)
        self.logs = logs


Job = Union[LoggedPopen, ForkedRun]
_unstopped: List[Job] = []  # every job started here that `stop` has not yet seen to


def start(command: List[str], log: Union[str, Path], env: Optional[Dict[str, str]] = None,
          err_log: Union[str, Path, None] = None, held_before: Optional[str] = None,
          cwd: Union[str, Path, None] = None, scripts: bool = False) -> Job:
    """`command` in the background, in a session of its own, stdout and stderr appended to `log` (stderr to `err_log`
    where given), in the working directory `cwd` (by default this process's). `held_before`: for a fabric-lin
    command, a file name it is held before renaming onto (`hold_before_renaming_onto`). `scripts`: a Python script
    (`python script.py ...`, `python -c code ...`) is forked too, where the environment lets it, as a fabric-lin
    command is; for scripts that set nothing an import reads before their imports."""
    return _start(command, str(log), str(err_log or log), env, held_before, cwd, scripts)


def run(command: List[str], timeout: float, env: Optional[Dict[str, str]] = None, cwd: Union[str, Path, None] = None,
        scripts: bool = False, tmpfs: Optional[Tuple[Union[str, Path], str, Union[str, Path, None]]] = None
        ) -> subprocess.CompletedProcess:
    """`command` to its end, its output captured. Past `timeout` seconds it is killed and TimeoutError names it;
    however the wait ends, even at the command's own end, no process it started is left running. `cwd` and `scripts`
    as for `start`. `tmpfs`: (path, size, copy_to) - the command runs where `path` (an empty directory) is a tmpfs of
    `size` (`enter_small_tmpfs`), and what it wrote there is copied into `copy_to` (None: nowhere) as it ends; for a
    command that is forked, which one with a tmpfs must be."""
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        if tmpfs is not None:
            assert forkable(command, env, scripts), f"a command with a tmpfs must be one that is forked: {command}"
            tmpfs = (str(tmpfs[0]), tmpfs[1], None if tmpfs[2] is None else str(tmpfs[2]))
        job = _start(command, str(out), str(err), env, cwd=cwd, scripts=scripts, tmpfs=tmpfs)
        try:
            [returncode] = wait_all([job], timeout)
        finally:
            stop(job)  # what outlived it: the ranks Fabric launched, DataLoader workers
        return subprocess.CompletedProcess(command, returncode, out.read_text(), err.read_text())


def _start(command, stdout: str, stderr: str, env, held_before: Optional[str] = None, cwd=None,
           scripts: bool = False, tmpfs=None) -> Job:
    global _forkserver
    logs = list(dict.fromkeys((stdout, stderr)))
    for path in logs:  # there before start returns, as a subprocess's output file is
        Path(path).touch()
    if held_before is not None:
        assert command[:3] == FABRIC_LIN, "only a fabric-lin command is held"
    if not forkable(command, env, scripts):
        if held_before is not None:  # a new Python that imports this module first, from tests/
            env = dict(os.environ if env is None else env)
            env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), *filter(None, [env.get("PYTHONPATH")])])
            command = [sys.executable, "-c", "import sys, fabric_lin_process; fabric_lin_process.run_held(sys.argv[1:])",
                       held_before, *command[3:]]
        with open(stdout, "ab") as out, open(stderr, "ab") as err:
            job = LoggedPopen(command, logs, stdout=out, stderr=err, env=env, cwd=cwd, start_new_session=True)
    else:
        if _forkserver is None:
            _forkserver = multiprocessing.get_context("forkserver")
            _forkserver.set_forkserver_preload(PRELOADED)
        process = _forkserver.Process(target=_as_fabric_lin, daemon=False, args=(
            command, dict(os.environ if env is None else env), str(cwd or os.getcwd()), stdout, stderr, held_before,
            tmpfs))
        process.start()
        job = ForkedRun(command, process, logs)
    _unstopped.append(job)
    return job


def wait_all(jobs: List[Job], timeout: float) -> List[int]:
    """The exit codes of `jobs` (the ranks of a run, say) once each has ended, within one bound of `timeout`
    seconds for all. Past it, each job is stopped and TimeoutError names those that had not ended; a wait ended
    otherwise (pytest-timeout's failure, Ctrl-C) stops them too and names them on stderr."""
    deadline = time.monotonic() + timeout
    try:
        for job in jobs:
            job.wait(max(0.0, deadline - time.monotonic()))
    except BaseException as ended:
        hung = [job for job in jobs if job.poll() is None]
        described = describe(hung)  # before the kill: what each was doing
        for job in jobs:
            stop(job)
        hung_of_all = f"{len(hung)} of {len(jobs)} processes"
        killed = f"each killed with every process it started:\n{described}"
        if isinstance(ended, subprocess.TimeoutExpired):
            raise TimeoutError(f"{hung_of_all} did not end within {timeout:g} s, {killed}") from None
        print(f"{hung_of_all} had not ended when the wait for them was interrupted, {killed}", file=sys.stderr)
        raise
    return [job.returncode for job in jobs]


def command_line(command: List[Union[str, Path]]) -> str:
    """`command` as a shell would take it."""
    return shlex.join(str(part) for part in command)


def describe(jobs: List[Job]) -> str:
    """Each job's pid, command, what Linux says its main process is doing, and the last lines of its output."""
    lines = []
    for job in jobs:
        lines.append(f"pid {job.pid}: {command_line(job.args)}")
        lines.append(f"  {process_state(job.pid)}")
        for path in job.logs:
            lines.append(f"  the end of {path}:")
            lines.extend(f"    {line}" for line in Path(path).read_text(errors="replace").splitlines()[-10:])
    return "\n".join(lines)


# /proc/<pid>/stat's states: a process that waits for a peer over a socket sleeps (S), one that waits for the disk or
# a page fault waits uninterruptibly (D), and a stopped one (T) waits for SIGCONT
PROCESS_STATES = {"R": "running", "S": "sleeping", "D": "waiting uninterruptibly (disk I/O, a page fault)",
                  "T": "stopped by a signal", "t": "stopped by a debugger", "Z": "ended, not yet collected"}


def process_state(pid: int) -> str:
    """What process `pid`'s main thread is doing, as Linux tells it: its state and, waiting, the kernel function it
    waits in (e.g. do_epoll_wait, for a peer's message). A process that will not end is told apart: waiting for a peer
    that is gone, held in the kernel, or stopped."""
    entry = process_table().get(pid)
    if entry is None:
        return "no longer there"
    try:
        waiting_in = Path(f"/proc/{pid}/wchan").read_text().strip()
    except OSError:  # ended meanwhile
        waiting_in = ""
    described = PROCESS_STATES.get(entry[0], entry[0])
    return f"{described}, in {waiting_in}" if waiting_in not in ("", "0") else described


def stop(job: Union[subprocess.Popen, ForkedRun]) -> None:
    """SIGKILL to every process of `job` still running: those of its session, and their descendants wherever they
    went (torchrun's workers start sessions of their own); returns once they are gone. They are stopped (SIGSTOP)
    first, listing again until no new one appears: a stopped process starts no other, and a process killed before
    its children were listed would leave them to init, out of reach."""
    stopped: Set[int] = set()
    while True:
        new = _running_processes_of(job) - stopped
        if not new:
            break
        for pid in new:
            _send(pid, signal.SIGSTOP)
        stopped |= new
    for pid in stopped:
        _send(pid, signal.SIGKILL)
    if job in _unstopped:
        _unstopped.remove(job)
    job.wait(STOP_TIMEOUT)
    deadline = time.monotonic() + STOP_TIMEOUT
    while stopped:
        stopped &= _running_pids()
        if not stopped:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"processes {sorted(stopped)} of {command_line(job.args)} did not end {STOP_TIMEOUT} s "
                               "after SIGKILL")
        time.sleep(0.01)


def stop_all() -> List[Job]:
    """`stop` every job started here that it has not yet seen to; returns those whose main process was still
    running (a test that neither waited for nor stopped them)."""
    left = [job for job in _unstopped if job.poll() is None]
    for job in list(_unstopped):
        stop(job)
    return left


# multiprocessing's exit function joins the forked runs still running, forever for one that hangs: this one, added
# later, runs before it (atexit runs the last added first)
atexit.register(stop_all)


def process_table() -> Dict[int, Tuple[str, int, int]]:
    """Every process of this machine, read from Linux's /proc: pid -> (state, parent's pid, process group). A
    process that ends while listed is left out; one that ended and whose parent has not collected it (a zombie)
    is there, in state "Z"."""
    table = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, parent, group = stat.read_text().rsplit(")", 1)[1].split()[:3]  # after "pid (command)"
        except (OSError, IndexError, ValueError):
            continue
        table[int(stat.parent.name)] = (state, int(parent), int(group))
    return table


def _running_pids() -> Set[int]:
    return {pid for pid, (state, _, _) in process_table().items() if state != "Z"}


def _running_processes_of(job) -> Set[int]:
    """The processes of `job`'s session (its process group) and their descendants that have not ended."""
    table = process_table()
    pending = [pid for pid, (_, _, group) in table.items() if group == job.pid]
    if job.poll() is None:  # once collected, its pid may be another process's
        pending.append(job.pid)
    children = defaultdict(list)
    for pid, (_, parent, _) in table.items():
        children[parent].append(pid)
    found = set()
    while pending:
        pid = pending.pop()
        if pid not in found:
            found.add(pid)
            pending.extend(children[pid])
    return {pid for pid in found if pid in table and table[pid][0] != "Z"}


def _send(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:  # ended meanwhile
        pass


def start_ranks(command: List[str], log_dir: Union[str, Path], nodes: int, devices: int, port: int,
                env: Optional[Dict[str, str]] = None) -> List[Job]:
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
