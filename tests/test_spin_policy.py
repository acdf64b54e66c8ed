"""The spin gate's decisions (shmclient/_spin_gate.h): given a sequence of observations of
the host it stops or starts spinning. Not timed: the benchmark's contention matrix is
where the latency targets are checked.

The old policy (a spin budget adapted only to whether the data came within the spin,
``doorbell.Spin``, plus a sched_yield loop) had no notion of these observations: a spin
that saw its answer late because it had lost its CPU still counted as one that paid, and
an oversubscribed host or a CPU quota never stopped it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from shmclient import _ring

HOLD_MIN = 20e-3


def quiet(g: _ring.SpinGate, now: float, cpus: int = 2) -> None:
    g.host(now, 2, cpus, 0.0)


def test_quiet_host_allows_spinning():
    g = _ring.SpinGate()
    quiet(g, 0.0)
    assert g.allows(0.0)
    # us and the peer, one CPU each
    g.host(0.1, 2, 2, 0.0)
    assert g.allows(0.1)


@pytest.mark.parametrize("nr_running", [3, 4, 9])
def test_more_runnable_threads_than_cpus_stops_spinning(nr_running):
    g = _ring.SpinGate()
    quiet(g, 0.0)
    g.host(0.01, nr_running, 2, 0.0)
    assert not g.allows(0.01)
    assert not g.state()["host_ok"]


def test_spinning_resumes_when_the_load_goes_away():
    g = _ring.SpinGate()
    seq = [(3, False), (3, False), (2, True), (1, True), (4, False), (2, True)]
    for i, (nr, expect) in enumerate(seq):
        now = i * 0.01
        g.host(now, nr, 2, 0.0)
        assert g.allows(now) is expect, (i, nr)


@pytest.mark.parametrize("quota, expect", [(0.5, False), (1.0, False), (1.5, False), (2.0, True), (8.0, True), (0.0, True)])
def test_cpu_quota_below_two_cpus_stops_spinning(quota, expect):
    # a spinning waiter burns the quota its peer needs to answer; 0 means no quota
    g = _ring.SpinGate()
    g.host(0.0, 1, 16, quota)
    assert g.allows(0.0) is expect


def test_pinned_process_ignores_the_host_run_queue():
    # cpus=0: this process's affinity is narrower than the host (cores given to it), so
    # other work elsewhere on the host says nothing about its own CPUs
    g = _ring.SpinGate()
    g.host(0.0, 40, 0, 0.0)
    assert g.allows(0.0)
    # ... but a quota still applies
    g.host(0.1, 40, 0, 1.0)
    assert not g.allows(0.1)


def test_a_preempted_spin_holds_spinning_off_then_resumes():
    g = _ring.SpinGate()
    quiet(g, 0.0)
    assert g.allows(0.0)
    g.preempted(1.0)  # the run queue looked free, but the spin lost its CPU
    assert not g.allows(1.0)
    assert not g.allows(1.0 + HOLD_MIN / 2)
    quiet(g, 1.0 + HOLD_MIN / 2)  # a free-looking reading does not cut the hold-off short
    assert not g.allows(1.0 + HOLD_MIN / 2)
    assert g.allows(1.0 + HOLD_MIN * 1.01)


def test_repeated_preemptions_lengthen_the_hold_off_and_a_clean_spin_resets_it():
    g = _ring.SpinGate()
    quiet(g, 0.0)
    now = 0.0
    holds = []
    for _ in range(8):
        g.preempted(now)
        holds.append(g.state()["hold_s"])
        now = g.state()["hold_until"]
        assert g.allows(now)
    assert holds[:3] == pytest.approx([HOLD_MIN, 2 * HOLD_MIN, 4 * HOLD_MIN])
    assert holds[-1] == pytest.approx(1.0)  # capped
    g.clean()
    g.preempted(now)
    assert g.state()["hold_s"] == pytest.approx(HOLD_MIN)


def test_a_gap_is_a_preemption_only_with_an_involuntary_switch_in_it():
    g = _ring.SpinGate()
    quiet(g, 0.0)
    assert g.gap(0.0, 5e-6, True) is False  # no gap: the spin's own pace
    # time the hypervisor took (steal) or an interrupt: the spin cost no one a CPU, and
    # a sleep would not have avoided it
    assert g.gap(0.1, 2e-3, False) is False
    assert g.allows(0.1) and g.state()["preemptions"] == 0
    # another thread of this host ran on our CPU meanwhile
    assert g.gap(0.2, 2e-3, True) is True
    assert not g.allows(0.2) and g.state()["preemptions"] == 1


def test_spin_mode_always_counts_a_preemption_but_spins_on():
    """SHMCLIENT_SPIN=always spins as configured whatever the host (README): a
    preemption is counted, the spin not cut (it was, on this 2-CPU host the first
    spins of a run ended after 0-28 ms of the 200 asked)."""
    g = _ring.SpinGate(mode="always")
    assert g.gap(0.2, 2e-3, True) is False
    assert g.allows(0.2) and g.state()["preemptions"] == 1


def test_free_cpu_follows_the_readings_and_the_hold_off_and_counts_no_spin():
    # free_cpu(now): whether a peer woken now finds a CPU (the engine's choice between
    # writing its outputs itself and handing them to its output thread)
    g = _ring.SpinGate()
    g.host(0.0, 1, 2, 0.0)  # us alone: the peer gets the other CPU
    assert g.free_cpu(0.0)
    g.host(0.001, 2, 2, 0.0)  # as many runnable threads as CPUs: the woken peer would wait
    assert not g.free_cpu(0.001) and g.allows(0.001)  # (a spinning peer already has its CPU)
    g.host(0.002, 3, 4, 0.0)
    assert g.free_cpu(0.002)
    g.host(0.003, 1, 16, 1.0)  # a quota of one CPU
    assert not g.free_cpu(0.003)
    g.host(0.004, 1, 0, 0.0)  # pinned: the host's run queue says nothing about our CPUs
    assert g.free_cpu(0.004)
    g.host(0.005, 1, 2, 0.0)
    g.preempted(0.005)
    assert not g.free_cpu(0.005)  # a spin just lost its CPU
    g.host(0.005 + HOLD_MIN / 2, 1, 2, 0.0)
    assert not g.free_cpu(0.005 + HOLD_MIN / 2)  # a free-looking reading does not cut it short
    later = 0.005 + HOLD_MIN * 1.01
    g.host(later, 1, 2, 0.0)
    assert g.free_cpu(later)
    assert g.state()["spins_allowed"] == g.state()["spins_denied"] == 0


def test_free_cpu_reads_the_host_again_when_its_reading_is_old():
    g = _ring.SpinGate()
    g.host(0.0, 99, 2, 0.0)
    assert not g.free_cpu(0.001)  # within the sample interval: the reading stands
    samples = g.state()["samples"]
    g.free_cpu(10.0)
    st = g.state()
    assert st["samples"] == samples + 1 and st["nr_running"] != 99


def test_free_cpu_modes():
    always = _ring.SpinGate("always")
    always.host(0.0, 50, 2, 0.5)
    assert always.free_cpu(0.0)  # cores the user dedicated
    never = _ring.SpinGate("never")  # no spinning, but the readings still say whether a CPU is free
    never.host(0.0, 50, 2, 0.0)
    assert not never.free_cpu(0.0)
    never.host(0.0, 1, 2, 0.0)
    assert never.free_cpu(0.0)


def test_unknown_run_queue_does_not_close_the_gate():
    g = _ring.SpinGate()
    g.host(0.0, -1, 2, 0.0)  # /proc/loadavg unreadable
    assert g.allows(0.0)


def test_modes():
    always = _ring.SpinGate("always")
    always.host(0.0, 50, 2, 0.5)
    always.preempted(0.0)
    assert always.allows(0.0)
    never = _ring.SpinGate("never")
    never.host(0.0, 1, 2, 0.0)
    assert not never.allows(0.0)
    with pytest.raises(ValueError, match="'adaptive', 'always' or 'never'"):
        _ring.SpinGate("sometimes")
    with pytest.raises(ValueError, match="spin mode"):
        always.mode = "fast"
    always.mode = "adaptive"
    assert not always.allows(0.0)  # its own readings now count


def _child(code: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout, env=e
    )


def test_bad_spin_mode_in_the_environment_is_named():
    """A ConfigError (every error a client raises is a ShmClientError; the ring's
    module is imported by the first client)."""
    r = _child("import shmclient._ring", {"SHMCLIENT_SPIN": "fast"})
    assert r.returncode != 0
    assert ("shmclient.errors.ConfigError: SHMCLIENT_SPIN must be 'adaptive', 'always' or "
            "'never', got 'fast'") in r.stderr


WAIT_ON_EMPTY_RING = """
    import json, os
    from shmclient.ring_consumer import RingConsumer
    from shmclient.ring_producer import RingProducer
    from shmclient import _ring
    p = RingProducer.create(4096, spin_us=1000)
    c = RingConsumer.attach(p.spec, spin_us=1000)
    try:
        for _ in range(WAITS):
            c.wait_readable(0.002, spin=0.002)
        print(json.dumps(_ring.gate.state()))
    finally:
        c.close(); p.close(); c.unlink(); p.unlink()
"""


def _gate_after_waits(waits: int, pre: str = "", env: dict | None = None) -> dict:
    import json

    code = textwrap.dedent(pre) + textwrap.dedent(WAIT_ON_EMPTY_RING).replace("WAITS", str(waits))
    r = _child(code, env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_the_process_gate_reads_the_host():
    st = _gate_after_waits(3)
    assert st["samples"] >= 1
    assert st["nr_running"] >= 1  # at least the waiter itself
    if len(os.sched_getaffinity(0)) == os.cpu_count():
        assert st["cpus"] == os.cpu_count()
    assert st["spins_allowed"] + st["spins_denied"] == 3


def test_never_mode_never_spins():
    st = _gate_after_waits(3, env={"SHMCLIENT_SPIN": "never"})
    assert st["spins_allowed"] == 0 and st["spins_denied"] == 3


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs sched_setaffinity")
def test_a_spin_sharing_its_cpu_with_a_busy_process_is_caught_and_stops():
    """A waiter pinned to one CPU beside a busy process pinned there too (the run-queue
    reading is not compared when pinned): its spin loses the CPU, the gate sees the gap
    and the next waits sleep at once. The old policy went on spinning (and yielding to
    the busy process) in every wait."""
    cpu = sorted(os.sched_getaffinity(0))[0]
    hog = subprocess.Popen(
        [sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"]
    )
    try:
        st = _gate_after_waits(200, pre=f"import os; os.sched_setaffinity(0, {{{cpu}}})\n")
    finally:
        hog.kill()
        hog.wait()
    assert st["cpus"] == 0 or os.cpu_count() == 1  # pinned: the run queue is not compared
    assert st["preemptions"] >= 1
    assert st["spins_denied"] >= 1


def _cpu_cgroup_v1() -> str | None:
    root = "/sys/fs/cgroup/cpu"
    if os.geteuid() != 0 or not os.path.exists(os.path.join(root, "cpu.cfs_quota_us")):
        return None
    return root


@pytest.mark.skipif(_cpu_cgroup_v1() is None, reason="needs root and the cgroup v1 cpu controller")
def test_a_cpu_quota_of_one_cpu_is_read_and_stops_spinning(tmp_path):
    root = _cpu_cgroup_v1()
    path = os.path.join(root, f"shmclient-test-{os.getpid()}")
    os.mkdir(path)
    try:
        with open(os.path.join(path, "cpu.cfs_period_us"), "w") as f:
            f.write("100000")
        with open(os.path.join(path, "cpu.cfs_quota_us"), "w") as f:
            f.write("100000")
        pre = f"""
            with open({os.path.join(path, 'cgroup.procs')!r}, "w") as f:
                f.write(str(__import__("os").getpid()))
        """
        st = _gate_after_waits(3, pre=pre)
    finally:
        os.rmdir(path)
    assert st["quota_cpus"] == pytest.approx(1.0)
    assert not st["host_ok"]
    assert st["spins_allowed"] == 0
