"""The CPU cores a process may run on, and how busy other work keeps them: what a run on the CPU divides
among its processes' threads, how many data loader workers a process starts, and what it says about a machine that
others use too."""
import os
import time
from pathlib import Path
from typing import Iterable, Optional, Tuple

from fabric_lin.errors import InvalidValue

PROC_STAT = Path("/proc/stat")


def usable_cpu_cores() -> int:
    """The CPU cores this process may run on (its affinity mask: a scheduler's allocation, taskset)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cores_busy_with_other_work(seconds: float = 0.25) -> Optional[float]:
    """How many of this process's cores other work keeps busy now, in cores (1.0: one core's time): the busy
    time that the kernel counts on them over `seconds` while this process sleeps, less this process's own CPU
    time. Unlike a load average, which takes a minute to rise, it sees work that started a moment ago. None
    where the counters cannot be read (not Linux)."""
    try:
        cpus = os.sched_getaffinity(0)
        (busy_before, total_before), own_before = cpu_ticks(PROC_STAT.read_text(), cpus), os.times()
        time.sleep(seconds)
        (busy_after, total_after), own_after = cpu_ticks(PROC_STAT.read_text(), cpus), os.times()
    except (AttributeError, OSError, ValueError):
        return None
    own = (own_after.user + own_after.system - own_before.user - own_before.system) * os.sysconf("SC_CLK_TCK")
    total = total_after - total_before
    return max(0.0, busy_after - busy_before - own) * len(cpus) / total if total > 0 else None


def cpu_ticks(proc_stat: str, cpus: Iterable[int]) -> Tuple[int, int]:
    """The busy and the total clock ticks of the cores `cpus` since boot, from the text of /proc/stat. Its per-core
    lines count user, nice, system, idle, iowait, irq, softirq, steal, guest, guest_nice (guest time is inside
    user and nice); steal, the time a hypervisor gave the core to other machines, is busy for this run too."""
    names = {f"cpu{cpu}" for cpu in cpus}
    busy = total = 0
    for line in proc_stat.splitlines():
        fields = line.split()
        if fields and fields[0] in names:
            ticks = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
            idle, iowait = ticks[3], ticks[4]
            busy += sum(ticks) - idle - iowait
            total += sum(ticks)
    return busy, total


def check_cpu_processes(devices: int) -> None:
    """On the CPU, each of `devices` processes computes with at least one core of its own: more processes than
    cores would only take turns on them, slower than fewer processes, with nothing gained."""
    cores = usable_cpu_cores()
    if devices > cores:
        raise InvalidValue(
            f"--devices {devices}: without a CUDA GPU each device is a CPU process, and this machine gives this run "
            f"{cores} CPU core(s); give --devices {cores} or fewer"
        )


def set_cpu_threads(devices: int) -> None:
    """On the CPU, each of this node's `devices` processes computes with its share of the cores (unless
    OMP_NUM_THREADS sets it): the same threads, so the same sums and losses, whatever else runs. Where other
    work keeps the cores busy as the run starts, threads that wait for each other can make a step many times
    slower, so that is said, with what to set."""
    import torch

    if os.environ.get("OMP_NUM_THREADS"):
        return  # torch took it at import
    cores = usable_cpu_cores()
    threads = max(1, cores // devices)
    torch.set_num_threads(threads)
    # rank 0 speaks for the node; where torchrun started the node's processes together, their own start-up
    # would count as other work
    if threads == 1 or os.environ.get("LOCAL_RANK", "0") != "0" or int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1:
        return
    busy = cores_busy_with_other_work()
    if busy is not None and busy >= 0.5:  # half a core: more than a machine's own daemons, enough to stall a thread
        print(f"Note: other work keeps {busy:.1f} of this run's {cores} CPU cores busy; training uses {threads} threads "
              f"per process. If steps are slow, OMP_NUM_THREADS=1 fabric-lin pretrain ... keeps them from waiting "
              f"for each other", flush=True)


def loader_workers(asked: int, processes: int = 1) -> int:
    """The DataLoader worker processes that each of this node's `processes` processes starts where `asked` for
    (data.num_workers): at most one per CPU core of its share of the cores this process may use, as set_cpu_threads
    shares them out, for more would only take turns on those cores with each other and with the process's own
    threads. A recipe's count, written for a large machine, is lowered with a note (the node's rank 0 speaks for it)."""
    cores = usable_cpu_cores()
    share = max(1, cores // processes)
    if asked <= share:
        return asked
    if os.environ.get("LOCAL_RANK", "0") == "0":
        workers = f"{share} loader worker{'s' if share > 1 else ''}"
        why = ("one per CPU core this process may use (more would only take turns on them)" if processes == 1 else
               f"one per CPU core of each of this node's {processes} processes ({cores} cores in all; more would only "
               f"take turns on them)")
        print(f"Note: data.num_workers {asked}: {workers}{'' if processes == 1 else ' per process'}, {why}", flush=True)
    return share
