"""fabric_lin/cpu_cores.py: the cores a process may run on, and how busy other work keeps them, from the kernel's
counters (given here as /proc/stat texts, so the figures are known)."""
import os

import pytest
import torch

from fabric_lin import cpu_cores


def test_cores_busy_with_other_work_counts_the_run_s_cores_less_its_own_time(monkeypatch, tmp_path):
    """Two readings of /proc/stat a quarter second apart (25 ticks of 10 ms per core) on a machine of 4 cores, of
    which the run may use cpu1 and cpu2: there, 30 ticks busy (user 10 + system 5 + irq 1 + softirq 1 + steal 3 on
    cpu1, user 10 on cpu2; guest 2 is inside user) of 50, 0.04 s of them the run's own. cpu0 and cpu3, busy too,
    are not the run's."""
    readings = iter([
        "cpu  900 0 900 900 0 0 0 0 0 0\n"
        "cpu0 100 0 100 100 0 0 0 0 0 0\ncpu1 100 7 100 100 3 0 0 0 0 0\n"
        "cpu2 100 0 100 100 0 0 0 0 0 0\ncpu3 100 0 100 100 0 0 0 0 0 0\nintr 1 2 3\n",
        "cpu  999 0 999 999 0 0 0 0 0 0\n"
        "cpu0 125 0 100 100 0 0 0 0 0 0\ncpu1 110 7 105 105 3 1 1 3 2 0\n"
        "cpu2 110 0 100 115 0 0 0 0 0 0\ncpu3 125 0 100 100 0 0 0 0 0 0\nintr 4 5 6\n",
    ])
    times = iter([os.times_result((1.0, 0.5, 0, 0, 0)), os.times_result((1.03, 0.51, 0, 0, 0))])
    proc_stat = tmp_path / "stat"
    proc_stat.write_text(next(readings))
    monkeypatch.setattr(cpu_cores, "PROC_STAT", proc_stat)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {1, 2})
    monkeypatch.setattr(os, "times", lambda: next(times))
    monkeypatch.setattr(cpu_cores.time, "sleep", lambda seconds: proc_stat.write_text(next(readings)))
    own_ticks = 0.04 * os.sysconf("SC_CLK_TCK")  # 4 at Linux's 100 ticks per second
    assert cpu_cores.cores_busy_with_other_work() == pytest.approx(2 * (30 - own_ticks) / 50)
    monkeypatch.setattr(cpu_cores, "PROC_STAT", tmp_path / "missing")  # no /proc (not Linux): nothing to say
    assert cpu_cores.cores_busy_with_other_work() is None


def test_usable_cores_are_the_affinity_mask_not_the_machine(monkeypatch):
    """A scheduler's allocation (or taskset) of 3 cores of a larger machine: the run divides those 3."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 3, 5})
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert cpu_cores.usable_cpu_cores() == 3
    monkeypatch.delattr(os, "sched_getaffinity")  # not Linux: the machine's count, at least 1
    assert cpu_cores.usable_cpu_cores() == 64
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert cpu_cores.usable_cpu_cores() == 1


def test_cpu_ticks_count_idle_and_iowait_as_not_busy():
    """Per core: user 1, nice 2, system 4, idle 8, iowait 16, irq 32, softirq 64, steal 128, then guest 256 and
    guest_nice 512 (inside user and nice: not counted again). Busy is every field but idle and iowait; the
    machine's summary line and the cores not asked for count nothing."""
    proc_stat = ("cpu  9 9 9 9 9 9 9 9 9 9\n"
                 "cpu0 1 2 4 8 16 32 64 128 256 512\n"
                 "cpu1 1 2 4 8 16 32 64 128 256 512\n"
                 "cpu10 1000 0 0 0 0 0 0 0 0 0\n"
                 "intr 5 6\n")
    busy_one, total_one = 1 + 2 + 4 + 32 + 64 + 128, 1 + 2 + 4 + 8 + 16 + 32 + 64 + 128
    assert cpu_cores.cpu_ticks(proc_stat, [0]) == (busy_one, total_one)
    assert cpu_cores.cpu_ticks(proc_stat, [0, 1]) == (2 * busy_one, 2 * total_one)
    assert cpu_cores.cpu_ticks(proc_stat, [2]) == (0, 0)


def readings_of(monkeypatch, tmp_path, stats, own_seconds):
    """cores_busy_with_other_work on the run's cores {0}, reading `stats` (two /proc/stat texts) and this process
    using `own_seconds` of CPU time between them."""
    readings, slept = iter(stats), []
    times = iter([os.times_result((1.0, 0.0, 0, 0, 0)), os.times_result((1.0 + own_seconds, 0.0, 0, 0, 0))])
    proc_stat = tmp_path / "stat"
    proc_stat.write_text(next(readings))
    monkeypatch.setattr(cpu_cores, "PROC_STAT", proc_stat)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    monkeypatch.setattr(os, "times", lambda: next(times))
    monkeypatch.setattr(cpu_cores.time, "sleep",
                        lambda seconds: slept.append(seconds) or proc_stat.write_text(next(readings)))
    busy = cpu_cores.cores_busy_with_other_work()
    assert slept == [0.25]  # the readings a quarter second apart, as the default asks
    return busy


def test_no_ticks_between_the_readings_say_nothing_and_the_run_s_own_time_is_never_others(monkeypatch, tmp_path):
    same = "cpu0 100 0 100 100 0 0 0 0 0 0\n"
    assert readings_of(monkeypatch, tmp_path, [same, same], own_seconds=0.0) is None
    # 25 ticks, 5 busy, while this process counted more than that (its own time is sampled at another moment)
    later = "cpu0 105 0 100 120 0 0 0 0 0 0\n"
    assert readings_of(monkeypatch, tmp_path, [same, later], own_seconds=0.2) == 0.0


def test_cpu_threads_are_the_cores_shared_by_the_processes(monkeypatch, capsys):
    threads = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(cpu_cores, "usable_cpu_cores", lambda: 8)
    busy = {"cores": 0.1}  # what the measurement at the start finds
    monkeypatch.setattr(cpu_cores, "cores_busy_with_other_work", lambda: busy["cores"])
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))  # work that started a moment ago: not in it yet
    try:
        cpu_cores.set_cpu_threads(2)
        assert torch.get_num_threads() == 4 and capsys.readouterr().out == ""
        busy["cores"] = 1.04  # other work keeps a core busy
        cpu_cores.set_cpu_threads(1)
        assert torch.get_num_threads() == 8
        assert ("Note: other work keeps 1.0 of this run's 8 CPU cores busy; training uses 8 threads per process. If steps "
                "are slow, OMP_NUM_THREADS=1 fabric-lin pretrain ...") in capsys.readouterr().out
        cpu_cores.set_cpu_threads(8)  # one thread per process waits for no other
        assert torch.get_num_threads() == 1 and capsys.readouterr().out == ""
        monkeypatch.setenv("LOCAL_RANK", "1")  # Fabric's launcher starts rank 1 with LOCAL_RANK alone: rank 0 speaks
        cpu_cores.set_cpu_threads(2)
        assert torch.get_num_threads() == 4 and capsys.readouterr().out == ""
        monkeypatch.delenv("LOCAL_RANK")
        busy["cores"] = None  # the counters cannot be read (not Linux): nothing to say
        cpu_cores.set_cpu_threads(2)
        assert torch.get_num_threads() == 4 and capsys.readouterr().out == ""
        busy["cores"] = 1.04
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun's processes start together: each other's start-up is no other work
        cpu_cores.set_cpu_threads(2)
        assert torch.get_num_threads() == 4 and capsys.readouterr().out == ""
        monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's choice stands
        cpu_cores.set_cpu_threads(1)
        assert torch.get_num_threads() == 4
    finally:
        torch.set_num_threads(threads)


def test_loader_workers_are_at_most_one_per_core_of_each_process_s_share(monkeypatch, capsys):
    """A recipe's data.num_workers on a machine of 4 cores: one process starts at most 4 loader workers, each of 2
    processes at most 2 and each of 8 one (every process loads its own batches); fewer asked, as many, or none, stand
    without a word. Lowered, it says what was asked, what is used and why, from the node's rank 0 alone."""
    monkeypatch.setattr(cpu_cores, "usable_cpu_cores", lambda: 4)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert [cpu_cores.loader_workers(asked, processes) for asked, processes in ((8, 1), (8, 2), (8, 8), (3, 1), (0, 2),
                                                                                (4, 1), (2, 2))] == [4, 2, 1, 3, 0, 4, 2]
    assert capsys.readouterr().out.splitlines() == [
        "Note: data.num_workers 8: 4 loader workers, one per CPU core this process may use (more would only take turns "
        "on them)",
        "Note: data.num_workers 8: 2 loader workers per process, one per CPU core of each of this node's 2 processes "
        "(4 cores in all; more would only take turns on them)",
        "Note: data.num_workers 8: 1 loader worker per process, one per CPU core of each of this node's 8 processes "
        "(4 cores in all; more would only take turns on them)",
    ]
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert cpu_cores.loader_workers(8, 2) == 2 and capsys.readouterr().out == ""
