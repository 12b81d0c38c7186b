"""fabric_lin/cpu_cores.py: the cores a process may run on, and how busy other work keeps them, from the kernel's
counters (given here as /proc/stat texts, so the figures are known)."""
import os

import pytest

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
