"""The CPU cores a process may run on, and how busy other work keeps them: what a run on the CPU divides
among its processes' threads, and what it says about a machine that others use too."""
import os
import time
from pathlib import Path
from typing import Iterable, Optional, Tuple

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
