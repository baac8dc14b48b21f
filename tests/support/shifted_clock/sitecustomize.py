"""A wall clock shifted by NOETL_TEST_CLOCK_SHIFT seconds, for the processes that get this
directory on their PYTHONPATH (Python imports `sitecustomize` at start-up, before anything else):
time.time and time.time_ns are replaced, so every clock read derived from them (the engine's
store/clock.py, kombu's timers, logging) runs ahead or behind. datetime.now is not replaced (it
reads the system clock in C); the engine takes its time from time.time only. (libfaketime
does not work in this environment.)"""

import os
import time

_shift = float(os.environ.get("NOETL_TEST_CLOCK_SHIFT", "0") or 0)
if _shift:
    _time, _time_ns = time.time, time.time_ns

    def _shifted_time() -> float:
        return _time() + _shift

    def _shifted_time_ns() -> int:
        return _time_ns() + int(_shift * 1e9)

    time.time = _shifted_time
    time.time_ns = _shifted_time_ns
