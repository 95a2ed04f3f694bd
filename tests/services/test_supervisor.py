"""The restart policy of `baton up` over real child processes (no model): backoff, the limit,
the window, the log lines a user reads, and the others left alone."""

from __future__ import annotations

import logging
import signal
import sys
import time

import pytest

from baton.ops.supervisor import Child, RestartPolicy, Supervisor

CRASH = [sys.executable, "-c", "import sys; sys.exit(3)"]
SLEEP = ["sleep", "60"]


def _poll_until(supervisor: Supervisor, predicate, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        supervisor.poll()
        time.sleep(0.01)


@pytest.fixture
def children():
    made: list[Child] = []
    yield made
    for child in made:
        child.stop(5.0)


def test_first_restart_is_immediate_then_backoff_doubles_from_one_second_and_is_capped():
    policy = RestartPolicy()
    assert [policy.delay_s(n) for n in range(1, 9)] == [0, 1, 2, 4, 8, 16, 30, 30]
    for bad in ({"max_restarts": -1}, {"window_s": 0}, {"first_delay_s": 2, "max_delay_s": 1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            RestartPolicy(**bad)


def test_killed_child_is_restarted_with_the_same_command_and_comes_back(children, caplog):
    caplog.set_level(logging.INFO, logger="baton.ops.supervisor")
    ready = {"ok": False}
    child = Child("completion-0", SLEEP, is_ready=lambda: ready["ok"])
    other = Child("prompt-0", SLEEP)
    children += [child, other]
    supervisor = Supervisor(children, RestartPolicy(first_delay_s=0.05))
    first_pid, other_pid = child.proc.pid, other.proc.pid
    child.proc.send_signal(signal.SIGKILL)
    _poll_until(supervisor, lambda: child.proc.pid != first_pid)
    assert child.proc.poll() is None and child.proc.args == SLEEP
    assert "completion-0 exited (signal 9); restarting in 0 s (restart 1 of 5)" in caplog.text
    assert "is back" not in caplog.text  # not ready yet
    ready["ok"] = True
    _poll_until(supervisor, lambda: "completion-0 is back (restart 1 of 5," in caplog.text)
    assert other.proc.pid == other_pid and other.proc.poll() is None
    assert supervisor.num_restarts == 1 and not supervisor.given_up


def test_crash_loop_is_given_up_and_the_others_keep_running(children, caplog):
    caplog.set_level(logging.INFO, logger="baton.ops.supervisor")
    crashing, other = Child("prompt-1", CRASH), Child("router", SLEEP)
    children += [crashing, other]
    supervisor = Supervisor(children, RestartPolicy(max_restarts=2, first_delay_s=0.05,
                                                    max_delay_s=0.08))
    _poll_until(supervisor, lambda: supervisor.given_up)
    assert supervisor.given_up == ["prompt-1"] and supervisor.num_restarts == 2
    lines = [r.getMessage() for r in caplog.records if "prompt-1 exited" in r.getMessage()]
    assert lines == [
        "prompt-1 exited (status 3); restarting in 0 s (restart 1 of 2)",
        "prompt-1 exited (status 3); restarting in 0.05 s (restart 2 of 2)",
        "prompt-1 exited (status 3) after 2 restarts within 10 minutes; giving up on it, "
        "the others keep serving"]
    assert other.proc.poll() is None


def test_restarts_older_than_the_window_are_forgotten(children):
    now = [0.0]
    child = Child("completion-1", CRASH)
    children.append(child)
    supervisor = Supervisor(children, RestartPolicy(max_restarts=1, window_s=10,
                                                    first_delay_s=1), clock=lambda: now[0])
    child.proc.wait(10)
    for t in (0.0, 1.0):  # the exit, then the restart it schedules
        now[0] = t
        supervisor.poll()
    assert supervisor.num_restarts == 1
    child.proc.wait(10)
    now[0] = 12.0  # the restart at t=1 is 11 s old: out of the window, so this one is allowed
    supervisor.poll()
    assert not supervisor.given_up
    now[0] = 13.0
    supervisor.poll()
    assert supervisor.num_restarts == 2
    child.proc.wait(10)
    now[0] = 14.0  # one restart within the window already: given up
    supervisor.poll()
    assert supervisor.given_up == ["completion-1"]


# A spare that says when it got the go (what `--standby` engines do before binding).
STANDBY = [sys.executable, "-c", "import sys, time; sys.stdin.readline(); print('promoted', "
           "flush=True); time.sleep(60)"]


def test_warm_standby_is_promoted_on_exit_and_replaced_once_back(children, caplog):
    caplog.set_level(logging.INFO, logger="baton.ops.supervisor")
    ready = {"ok": True}
    child = Child("completion-0", SLEEP, is_ready=lambda: ready["ok"], standby_argv=STANDBY)
    children.append(child)
    child.spawn_standby()
    spare = child.standby
    assert spare is not None and spare.poll() is None
    supervisor = Supervisor(children, RestartPolicy())
    child.proc.send_signal(signal.SIGKILL)
    _poll_until(supervisor, lambda: "completion-0 is back (restart 1 of 5," in caplog.text)
    assert child.proc is spare and spare.poll() is None  # the spare runs on as the child
    assert "warm standby promoted" in caplog.text
    assert child.standby is not None and child.standby is not spare  # the next one, waiting
    # A spare that died meanwhile is not promoted: the child starts from nothing.
    child.standby.kill()
    child.standby.wait(5)
    child.proc.send_signal(signal.SIGKILL)
    _poll_until(supervisor, lambda: "completion-0 is back (restart 2 of 5," in caplog.text)
    assert child.proc.args == SLEEP and child.proc.poll() is None
