"""Masking what code writes to file descriptors 1 and 2 itself.

Decides: while a python tool attempt runs (`masking_file_descriptors`, a decorator of the tool's
function), file descriptors 1 and 2 of the worker process are pipes; one thread per descriptor
reads its pipe, masks every secret form (secret_registry.mask_text) line by line and writes the
result to where the descriptor pointed before (the worker's log). So `os.write(1, ...)`, a C
library's printf and a subprocess that inherits the descriptors (`psql`, `curl -v`) are masked
like print() and logging are. Attempts that overlap in one process (a thread pool) share the
pipes; the last one to end puts the descriptors back.

- A line is written once its newline arrives; a line longer than HOLD_LIMIT is written in parts,
  each masked, keeping back its last HOLD_TAIL characters (a secret form is shorter) until more
  arrives, so a secret split across reads is still masked.
- The pipes and their pumps are made once per process, at its first attempt; entering and leaving
  an attempt is two dup2() per descriptor. When the attempt ends the descriptors point at the log
  again (a background process the code started keeps writing through the pipe, masked). A line
  without its newline is written once the pipe was quiet for IDLE_SECONDS.
- The pump writes the output, not the attempt, so leaving an attempt waits (LEAVE_WAIT_SECONDS at
  most) until each pipe is empty and its pump has written what it read: what the process writes
  after the attempt follows the attempt's output in the log instead of cutting into it.
- Where the pipes cannot be made (no descriptor left), the attempt runs unmasked at the fd level
  and a warning is logged; print() and logging are masked either way.

Not covered: code that opens the log file (or /dev/tty, /proc/self/fd/...) itself, writes to a
descriptor it duplicated before the attempt, or sends a secret anywhere else (a socket, a file):
playbook code is trusted (docs/operations.md, security model).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import functools
import logging
import os
import select
import struct
import sys
import termios
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from noetl_celery.config import secret_registry
from noetl_celery.observe import log_format

log = logging.getLogger(__name__)

MASKED_FDS = (1, 2)
HOLD_LIMIT = 64 * 1024  # characters of a line without its newline before a part is written
HOLD_TAIL = 4096  # characters kept back from such a part (longer than any secret form)
IDLE_SECONDS = 0.05  # a line without its newline is written once the pipe was quiet this long
PIPE_SIZE = 1024 * 1024  # bytes a pipe holds (Linux) before a writer waits for the pump
LEAVE_WAIT_SECONDS = 2.0  # longest wait, at an attempt's end, for the pumps to write what it wrote

_lock = threading.Lock()
# pipes: [(fd, its copy, pipe write end, pipe read end)]; busy: read end -> its pump holds unwritten output
_state: dict[str, Any] = {"depth": 0, "pipes": None, "pumps": [], "busy": {}}

F = TypeVar("F", bound=Callable[..., Any])


def masking_file_descriptors(function: F) -> F:
    """Run `function` with file descriptors 1 and 2 masked (see the module docstring)."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with masked_file_descriptors():
            return function(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


@contextlib.contextmanager
def masked_file_descriptors() -> Iterator[None]:
    installed = _enter()
    try:
        yield
    finally:
        if installed:
            _leave()


def _flush_std_streams() -> None:
    for stream in (sys.__stdout__, sys.__stderr__, sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or odd stream: nothing to flush
            if stream is not None:
                stream.flush()


def _pipes() -> list[tuple[int, int, int, int]]:
    """The process's pipes and pumps, made once: [(fd, a copy of where it points, write end, read end)]."""
    if _state["pipes"] is None:
        made: list[tuple[int, int, int, int]] = []
        try:
            for fd in MASKED_FDS:
                made.append(_pipe_for(fd))
        except OSError:
            for _, _, write_end, _ in made:
                os.close(write_end)  # its pump reads the end of the pipe and closes the rest
            raise
        _state["pipes"] = made
        atexit.register(_drain)
    return _state["pipes"]


def _drain() -> None:
    """At a normal interpreter exit: the pipes end, each pump writes what it holds (a second at most)."""
    with _lock:
        pipes, _state["pipes"] = _state["pipes"] or [], None
        for fd, out, write_end, _ in pipes:
            if _state["depth"]:
                os.dup2(out, fd)
            os.close(write_end)
        _state["depth"] = 0
    for pump in _state["pumps"]:
        pump.join(1.0)


def _pipe_for(fd: int) -> tuple[int, int, int, int]:
    read_end, write_end = os.pipe()
    try:
        out = os.dup(fd)
    except OSError:
        os.close(read_end)
        os.close(write_end)
        raise
    _grow(write_end)
    _state["busy"][read_end] = False
    stream = "stdout" if fd == 1 else "stderr"
    pump = threading.Thread(target=_pump, args=(read_end, out, stream), name=f"noetl-mask-fd{fd}", daemon=True)
    pump.start()
    _state["pumps"].append(pump)
    return fd, out, write_end, read_end


def _enter() -> bool:
    with _lock:
        if _state["depth"]:
            _state["depth"] += 1
            return True
        try:
            pipes = _pipes()
        except OSError as exc:
            log.warning("cannot mask file descriptors 1/2 of this attempt (%s): they go to the log unmasked", exc)
            return False
        _flush_std_streams()
        for fd, out, write_end, _ in pipes:
            os.dup2(fd, out)  # the pump writes where the descriptor points now
            os.dup2(write_end, fd)
        _state["depth"] = 1
        return True


def _leave() -> None:
    with _lock:
        _state["depth"] -= 1
        if _state["depth"]:
            return
        _flush_std_streams()
        for fd, out, _, _ in _state["pipes"]:
            os.dup2(out, fd)
        _wait_written([read_end for _, _, _, read_end in _state["pipes"]])


def _wait_written(read_ends: list[int]) -> None:
    """Until each pipe is empty and its pump holds nothing unwritten (LEAVE_WAIT_SECONDS at most).

    The pump marks itself busy before it reads, so an empty pipe whose pump is not busy means
    everything written to it before this call has reached the log."""
    deadline = time.monotonic() + LEAVE_WAIT_SECONDS
    for read_end in read_ends:
        while time.monotonic() < deadline:
            try:
                pending = struct.unpack("i", fcntl.ioctl(read_end, termios.FIONREAD, b"\0\0\0\0"))[0]
            except OSError:  # the pipe is gone (the process is exiting): nothing to wait for
                break
            if not pending and not _state["busy"].get(read_end):
                break
            time.sleep(0.002)


def _grow(fd: int) -> None:
    """A larger pipe: code writing much at once (holding the GIL in C) waits less for the pump."""
    set_size = getattr(fcntl, "F_SETPIPE_SZ", None)  # Linux
    if set_size is not None:
        with contextlib.suppress(OSError):  # above the system's limit: the default size
            fcntl.fcntl(fd, set_size, PIPE_SIZE)


def _pump(read_end: int, out: int, stream: str = "stderr") -> None:
    """Copy the pipe to `out`, masked, for the life of the process (as JSON log lines with
    NOETL_LOG_FORMAT=json: log_format.json_line)."""
    busy = _state["busy"]
    held = ""
    while True:
        # a line without its newline yet is written once the pipe is quiet for IDLE_SECONDS
        try:
            ready, _, _ = select.select([read_end], [], [], IDLE_SECONDS if held else None)
        except InterruptedError:
            continue
        if not ready:
            _emit(out, stream, secret_registry.mask_text(held))
            held = ""
            busy[read_end] = False
            continue
        busy[read_end] = True  # before the read empties the pipe (see _wait_written)
        try:
            chunk = os.read(read_end, 65536)
        except InterruptedError:
            continue
        if not chunk:  # no writer left
            break
        held += chunk.decode("utf-8", "surrogateescape")
        cut = held.rfind("\n") + 1
        if cut:
            _emit(out, stream, secret_registry.mask_text(held[:cut]))
            held = held[cut:]
        elif len(held) > HOLD_LIMIT:
            masked = secret_registry.mask_text(held)
            _emit(out, stream, masked[:-HOLD_TAIL])
            held = masked[-HOLD_TAIL:]
        if not held:
            busy[read_end] = False
    if held:
        _emit(out, stream, secret_registry.mask_text(held))
    busy[read_end] = False
    os.close(read_end)
    os.close(out)


def _emit(out: int, stream: str, text: str) -> None:
    """Write masked `text` to `out`: as it is, or each line as a JSON log line (a line that is one
    already, a handler's record written while fd 2 is the pipe, goes as it is)."""
    if not text or log_format.format_name() != "json":
        _write(out, text)
        return
    lines = (line if line.startswith('{"') else log_format.json_line(line, stream) for line in text.splitlines())
    _write(out, "".join(line + "\n" for line in lines if line.strip()))


def _write(fd: int, text: str) -> None:
    data = text.encode("utf-8", "surrogateescape")
    while data:
        try:
            written = os.write(fd, data)
        except InterruptedError:
            continue
        except OSError:  # the log is gone: what remains cannot be written anywhere
            return
        data = data[written:]
