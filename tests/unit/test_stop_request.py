"""The stop-signal request of one process: parsing, handlers, the usual effect before the program
asks, duplicates, "stop now", the check cadence, and the checkpoint manager saving at a stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import ddpkit
from ddpkit.env import ProcessInfo
from ddpkit.errors import ConfigError
from ddpkit.runtime import stop as stop_module
from ddpkit.runtime.stop import (
    StopRequest,
    TrainingStopped,
    default_stop_signals,
    grace_period_s,
    parse_stop_signals,
)


@pytest.fixture
def request_usr1():
    """A StopRequest on SIGUSR1 and SIGUSR2, installed; handlers restored afterwards."""
    before = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGUSR2)}
    request = StopRequest((signal.SIGUSR1, signal.SIGUSR2))
    assert request.install()
    yield request
    request.clear()
    request.restore()
    assert {s: signal.getsignal(s) for s in before} == before


def _deliver(sig: int) -> None:
    """Send ``sig`` to this process and let the main thread run its Python handler."""
    os.kill(os.getpid(), sig)
    time.sleep(0.01)


def test_parse_names_numbers_and_none():
    assert parse_stop_signals("SIGTERM, usr1,2") == (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
    assert parse_stop_signals("none") == () == parse_stop_signals("")
    assert parse_stop_signals("TERM,SIGTERM") == (signal.SIGTERM,)
    with pytest.raises(ConfigError, match="SIGKILL.*bogus|bogus.*SIGKILL") as err:
        parse_stop_signals("SIGKILL,bogus")
    assert "cannot be caught" in str(err.value)


def test_defaults_and_grace_from_the_environment():
    assert default_stop_signals({}) == (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
    assert default_stop_signals({"DDPKIT_STOP_SIGNALS": "SIGUSR2"}) == (signal.SIGUSR2,)
    assert grace_period_s({}) is None  # no launcher: nobody SIGKILLs this process
    assert grace_period_s({"TORCHELASTIC_RUN_ID": "x"}) == 30.0  # torchrun's default
    assert grace_period_s({"TORCHELASTIC_RUN_ID": "x", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "7"}) == 7
    assert (
        grace_period_s({"DDPKIT_GRACE_PERIOD_S": "12", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "7"}) == 12
    )


def test_training_stopped_is_an_exit_with_128_plus_the_signal():
    stopped = TrainingStopped(signal.SIGTERM, step=250, checkpoint="ck/step-00000250", saved=True)
    assert isinstance(stopped, SystemExit) and stopped.code == 143
    assert str(stopped) == "stopped by SIGTERM after step 250; saved checkpoint ck/step-00000250"
    assert TrainingStopped(signal.SIGINT, now=True).code == 130
    assert "second SIGUSR1" in str(TrainingStopped(signal.SIGUSR1, now=True))


def test_before_the_program_asks_a_signal_has_its_usual_effect():
    calls = []
    signal.signal(signal.SIGUSR1, lambda s, f: calls.append(s))  # the program's own handler
    request = StopRequest((signal.SIGUSR1,))
    try:
        assert request.install()
        _deliver(signal.SIGUSR1)
        assert calls == [signal.SIGUSR1] and request.received is None
        request.arm()
        _deliver(signal.SIGUSR1)
        assert calls == [signal.SIGUSR1] and request.received == signal.SIGUSR1  # deferred
    finally:
        request.restore()
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)


def test_ctrl_c_before_the_program_asks_raises_keyboard_interrupt():
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's, as in a terminal
    request = StopRequest((signal.SIGINT,))
    assert request.install()
    try:
        with pytest.raises(KeyboardInterrupt):
            _deliver(signal.SIGINT)
    finally:
        request.restore()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_one_process_agrees_at_once_and_repeats_are_the_same_request(request_usr1):
    runtime = ddpkit.Runtime(ProcessInfo(), stop=request_usr1)
    assert runtime.stop_requested() is False  # arms
    _deliver(signal.SIGUSR1)
    _deliver(signal.SIGUSR1)  # within the duplicate window: the same request, no "stop now"
    assert runtime.stop_requested() is True and request_usr1.agreed == signal.SIGUSR1
    assert runtime.stop_requested() is True  # stays agreed


def test_a_second_signal_means_stop_now_and_a_third_has_its_usual_effect():
    calls = []
    signal.signal(signal.SIGUSR2, lambda s, f: calls.append(s))  # what was there before
    request = StopRequest((signal.SIGUSR1, signal.SIGUSR2))
    try:
        assert request.install()
        request.arm()
        _deliver(signal.SIGUSR1)
        with pytest.raises(TrainingStopped) as stopped:
            _deliver(signal.SIGUSR2)  # another stop signal: at once
        assert stopped.value.now and stopped.value.signal == signal.SIGUSR2
        _deliver(signal.SIGUSR2)
        assert calls == [signal.SIGUSR2]  # the handler that was there before ran
    finally:
        request.clear()
        request.restore()
        signal.signal(signal.SIGUSR2, signal.SIG_DFL)


def test_after_a_stop_the_closed_runtime_still_swallows_the_duplicate():
    calls = []
    signal.signal(signal.SIGUSR1, lambda s, f: calls.append(s))  # what was there before
    request = StopRequest((signal.SIGUSR1,))
    try:
        assert request.install()
        request.arm()
        _deliver(signal.SIGUSR1)
        request.restore()  # the runtime closes after the stop
        _deliver(signal.SIGUSR1)  # torchrun's late copy: the process must not end from it
        assert calls == []
        time.sleep(stop_module.DUPLICATE_WINDOW_S)
        _deliver(signal.SIGUSR1)  # later: the signal's usual effect
        assert calls == [signal.SIGUSR1]
    finally:
        request.clear()
        request.restore()
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)


def test_the_same_signal_after_the_window_is_stop_now(request_usr1, monkeypatch):
    monkeypatch.setattr(stop_module, "DUPLICATE_WINDOW_S", 0.05)
    request_usr1.arm()
    _deliver(signal.SIGUSR1)
    time.sleep(0.1)
    with pytest.raises(TrainingStopped, match="second SIGUSR1"):
        _deliver(signal.SIGUSR1)


def test_a_stop_now_names_the_newest_checkpoint_the_job_saved(request_usr1, monkeypatch, tmp_path):
    monkeypatch.setattr(stop_module, "DUPLICATE_WINDOW_S", 0.05)
    runtime = ddpkit.Runtime(ProcessInfo(), stop=request_usr1)
    ckpt = ddpkit.CheckpointManager(tmp_path, runtime, state={"model": torch.nn.Linear(2, 2)})
    ckpt.save(20)  # a periodic save, before any signal
    request_usr1.arm()
    _deliver(signal.SIGUSR1)
    time.sleep(0.1)
    with pytest.raises(TrainingStopped) as stopped:
        _deliver(signal.SIGUSR1)  # a second one: at once, nothing saved at the stop
    assert stopped.value.now and stopped.value.checkpoint == tmp_path / "step-00000020"
    assert str(stopped.value) == (
        f"stopped now by a second SIGUSR1; newest checkpoint {tmp_path / 'step-00000020'}"
    )


def test_check_interval_keeps_the_checks_within_budget_and_a_second_apart():
    request = StopRequest((signal.SIGUSR1,))
    assert request._next_interval(0.0) == 1  # no measurement yet: check at the next call
    request._calls, request._mark, request._check_s = 10, (100.0, 0), 0.00018
    # 10 calls in 0.05 s (5 ms each); a check of 0.18 ms: 1 % needs a check every 4 calls
    assert request._next_interval(100.05) == 4
    request._check_s = 0.5  # a slow check: as rare as 20 calls apart allows
    assert request._next_interval(100.05) == 20
    request._calls, request._mark = 2, (0.0, 0)  # 2 calls in 0.25 s, a 0.5 s check:
    assert request._next_interval(0.25) == 8  # 1 s of training between checks
    request._mark = (100.0, 9)  # one call took 2 s: check at every call
    assert request._next_interval(102.0) == 1


def _state():
    model = torch.nn.Linear(2, 2)
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}


def test_maybe_save_saves_the_agreed_step_then_raises(tmp_path, request_usr1):
    runtime = ddpkit.Runtime(ProcessInfo(), stop=request_usr1)
    ckpt = ddpkit.CheckpointManager(tmp_path, runtime, state=_state(), every_steps=4)
    assert ckpt.maybe_save(1) is None
    request_usr1.arm()  # maybe_save armed it already; explicit, so a regression fails, not kills
    _deliver(signal.SIGUSR1)
    with pytest.raises(TrainingStopped) as stopped:
        ckpt.maybe_save(3)
    assert stopped.value.step == 3 and stopped.value.saved
    assert stopped.value.checkpoint == tmp_path / "step-00000003"
    assert (tmp_path / "step-00000003" / "manifest.json").is_file()
    assert ckpt.save_s > 0
    # a resumed run stopped before its first new step saves nothing new
    again = ddpkit.CheckpointManager(tmp_path, runtime, state=_state())
    assert again.resume() == 3
    with pytest.raises(TrainingStopped) as stopped:
        again.maybe_save(3)
    assert not stopped.value.saved and stopped.value.checkpoint == tmp_path / "step-00000003"


def test_without_stop_signals_the_runtime_never_stops(tmp_path):
    runtime = ddpkit.Runtime(ProcessInfo())
    assert runtime.stop is None and runtime.stop_requested() is False


UNANSWERED = """
import os, signal, sys, time
from ddpkit.runtime.stop import StopRequest
request = StopRequest((signal.SIGTERM,), fallback_s=0.5)
request.install()
request.arm()
print("ready", flush=True)
time.sleep(30)  # a loop that no longer asks
"""


@pytest.mark.slow
def test_a_request_no_step_answers_ends_the_process_after_the_fallback():
    proc = subprocess.Popen(
        [sys.executable, "-c", UNANSWERED],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "ready"  # torch imported: not timed
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=20)
    finally:
        proc.kill()
        proc.wait()
    errors = proc.stderr.read()
    assert code == 143, errors
    assert "SIGTERM: no step boundary asked for the stop within 0.5 s" in errors, errors
    assert time.monotonic() - start < 10  # the fallback, not the script's 30 s sleep


def test_under_ddpkit_run_the_stop_record_is_written_before_the_teardown(tmp_path, monkeypatch):
    # a teardown that hangs (a peer gone) must not turn a clean stop into "did not stop within
    # the grace period": the launcher's record exists before the runtime closes
    from ddpkit.diagnostics.failures import RUN_DIR_ENV, read_stop_records
    from ddpkit.runtime.process_group import Runtime

    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path))
    seen_at_close: list[list] = []
    close = Runtime.close
    monkeypatch.setattr(
        Runtime,
        "close",
        lambda self: (seen_at_close.append(read_stop_records(tmp_path)), close(self)),
    )
    stopped = TrainingStopped(signal.SIGTERM, step=7, saved=True)
    with pytest.raises(TrainingStopped):
        with ddpkit.init_runtime("gloo"):
            raise stopped
    assert stopped.recorded
    [[record]] = seen_at_close
    assert (record.signal, record.step, record.saved) == ("SIGTERM", 7, True)


@pytest.mark.parametrize(
    ("elastic", "here", "now", "code"),
    [
        (False, True, False, 0),  # a clean stop: the launcher reports it
        (False, False, False, 0),  # fixed membership: the peers' stop ends this node's part too
        (True, True, False, 0),  # elastic, signalled on this node: this node stops
        (True, False, False, 143),  # elastic, asked on another node: the agent restarts us
        (False, True, True, 143),  # a second signal: stop now
    ],
)
def test_under_ddpkit_run_the_worker_exit_status_after_a_stop(
    tmp_path, monkeypatch, elastic, here, now, code
):
    # the bug: an elastic agent's membership restart (SIGTERM to its own workers) reached every
    # node's ranks through the agreement; a node whose workers then exited 0 left the job
    from ddpkit.diagnostics.failures import RUN_DIR_ENV
    from ddpkit.launch import worker
    from ddpkit.launch.elastic import ELASTIC_ENV

    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path))
    monkeypatch.delenv(ELASTIC_ENV, raising=False)
    if elastic:
        monkeypatch.setenv(ELASTIC_ENV, "1")
    stopped = TrainingStopped(signal.SIGTERM, step=None if now else 5, now=now, here=here)
    assert worker._stopped(stopped) == code
    assert list(tmp_path.glob("stop-*.json"))  # the record for the launcher's line either way


def test_a_stop_agreed_on_a_request_of_this_process_is_marked_here():
    request = StopRequest([signal.SIGUSR1])
    request.received = signal.SIGUSR1
    request._agree(signal.SIGUSR1)
    assert request.agreed_here
    request.clear()
    request._agree(signal.SIGUSR1)  # the agreement brought another rank's request
    assert not request.agreed_here


AGREE_AND_RETURN = """
import signal, sys
from ddpkit.runtime.stop import StopRequest

request = StopRequest([signal.SIGTERM])
if "here" in sys.argv:
    request.received = signal.SIGTERM
request._agree(signal.SIGTERM)  # what rt.stop_requested() does when the ranks agree
if "clear" in sys.argv:
    request.clear()  # handled: the script trains on, then ends
"""


@pytest.mark.parametrize(
    ("elastic", "how", "code"),
    [
        (True, "elsewhere", 143),  # another node asked: exit 0 would end this node's part
        (True, "here", 0),  # this node was signalled: it stops
        (True, "clear", 0),  # the stop was handled and the script trained on to its end
        (False, "elsewhere", 0),  # fixed membership: the job ends
    ],
)
def test_a_script_that_breaks_on_stop_requested_exits_like_a_training_stopped(
    tmp_path, monkeypatch, elastic, how, code
):
    # an own loop that does `if rt.stop_requested(): save(); break` and returns normally
    from ddpkit.diagnostics.failures import RUN_DIR_ENV
    from ddpkit.launch import worker
    from ddpkit.launch.elastic import ELASTIC_ENV
    from ddpkit.runtime import stop

    monkeypatch.setattr(stop, "_LAST_AGREEMENT", [])
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path))
    monkeypatch.delenv(ELASTIC_ENV, raising=False)
    if elastic:
        monkeypatch.setenv(ELASTIC_ENV, "1")
    script = tmp_path / "loop.py"
    script.write_text(AGREE_AND_RETURN)
    assert worker.run_target([str(script), how]) == code
    assert (tmp_path / "done-r0-rank0").exists() == (code == 0)  # "ran to its end" only then
