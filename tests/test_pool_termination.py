"""How a pool process takes SIGTERM (engine/transport/process.py) and what the python tool makes of the
SystemExit with which billiard ends a pool process: in-process, with a forked child standing in
for a prefork pool process. The real thing, a supervisor's stop of a whole worker, is
tests/distributed/test_supervisor_stop.py."""

from __future__ import annotations

import os
import signal
import time

import pytest
from billiard import common

from noetl_celery.engine.transport import process
from noetl_celery.tools import pool
from noetl_celery.tools.base import ToolCall, run_tool

EXIT_CODE = "sys.exit(3)"


def python(code: str):  # type: ignore[no-untyped-def]
    return run_tool(ToolCall(kind="python", config={"code": code}, context={}))


def test_the_codes_own_sys_exit_is_its_error():
    outcome = python(f"import sys\n{EXIT_CODE}\n")
    assert outcome.error is not None and outcome.error["kind"] == "exception"
    assert outcome.error["message"].startswith("SystemExit: 3")


def test_the_pool_processs_own_system_exit_goes_through(monkeypatch):
    monkeypatch.setattr("noetl_celery.tools.python.pool_terminating", lambda: True)
    with pytest.raises(SystemExit):
        python(f"import sys\n{EXIT_CODE}\n")


def test_billiards_flag_is_read(monkeypatch):
    assert not pool.pool_terminating()
    monkeypatch.setattr(common, "_should_have_exited", [True])
    if hasattr(common, "terminate_handler_fired"):
        monkeypatch.setattr(common, "terminate_handler_fired", lambda: common._should_have_exited[0])
    assert pool.pool_terminating()


def _child(deferring: bool, signals: int) -> tuple[int, float]:
    """Fork a stand-in pool process with billiard's SIGTERM handler that sleeps 1.5 s (its attempt)
    and exits 0; send it `signals` SIGTERMs. Returns its exit status and how long it lived."""
    read, write = os.pipe()
    began = time.monotonic()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(read)
            signal.signal(signal.SIGTERM, common._shutdown_cleanup)  # what billiard installs
            process.mark_pool_child()
            if deferring:
                process.defer_termination()
            os.write(write, b"r")
            time.sleep(1.5)
            os._exit(0)
        except SystemExit as exc:
            os._exit(100 + (1 if exc.code else 0))
        except BaseException:
            os._exit(99)
    os.close(write)
    os.read(read, 1)
    os.close(read)
    for _ in range(signals):
        os.kill(pid, signal.SIGTERM)
        time.sleep(0.2)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), time.monotonic() - began


def test_a_pool_process_lets_one_sigterm_pass_and_ends_at_the_second():
    code, lived = _child(deferring=True, signals=1)
    assert code == 0 and lived >= 1.5  # its attempt finished
    code, lived = _child(deferring=True, signals=2)
    assert code == 101 and lived < 1.5  # billiard's SystemExit, at the second
    code, lived = _child(deferring=False, signals=1)
    assert code == 101 and lived < 1.5  # without it: billiard's SystemExit at the first
