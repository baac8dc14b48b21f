"""What belongs to one worker process: its identity in event rows, the caches a forked child
must not inherit from its parent, and how a pool child takes a SIGTERM.

Identity is taken per attempt and caches are reset in `worker_process_init`, never at import: a
prefork pool imports the app once in the parent and forks its children from it.

SIGTERM in a pool child (`defer_termination`): a supervisor that stops a worker by signalling
its whole process group or cgroup (systemd's default `KillMode=control-group`, supervisord
`stopasgroup`, `tini -g`, `kill -TERM -- -<pgid>`) sends SIGTERM to the pool children as well as
to the main process. The main process answers with Celery's warm shutdown (running tasks finish,
then the pool closes), but billiard's handler in each child raises SystemExit in the middle of
the running attempt. A child therefore lets the first SIGTERM pass while it runs attempts, and the
warm shutdown of its main process ends it once they are done; a second SIGTERM (Celery's cold
shutdown sends one per running task and one per process; a hard time limit sends one before its
SIGKILL) ends it at once, the billiard way. SIGKILL is never deferred.

Whether billiard's handler already ran (`pool_terminating`) is read by the python tool, below the
engine: it lives in tools/pool.py and is named here for the process's story.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import logging
import os
import signal
from types import FrameType
from typing import Any

from noetl_celery.engine.identity import DEFAULT_NODE_PREFIX as DEFAULT_NODE_PREFIX
from noetl_celery.engine.identity import identity as identity
from noetl_celery.engine.identity import node_name as node_name
from noetl_celery.tools.pool import pool_terminating as pool_terminating

log = logging.getLogger(__name__)


def reset_after_fork() -> None:
    """Forget everything per process that a forked child inherited: pooled database
    connections, the publisher, cached execution states, loop collections, values stored by reference and credential
    files."""
    from noetl_celery.config import credentials
    from noetl_celery.engine.context import STATE
    from noetl_celery.engine.decision import loops
    from noetl_celery.engine.transport import publisher
    from noetl_celery.store import blobs
    from noetl_celery.store.db import dispose_engines

    dispose_engines()
    publisher.forget()
    STATE.clear()
    loops.forget_collections()
    blobs.CACHE.clear()  # values stored by reference the parent had read
    credentials.forget_cached_files()


def freeze_startup_heap() -> None:
    """Move every object alive now (modules, the app, settings, compiled templates) into the
    collector's permanent generation, where no later collection looks.

    Called once a process has started (before the prefork pool forks, and when the worker is
    ready). The collections that run while it works and the last ones at exit then skip the
    startup heap: a worker's main process spent about 0.5 s of CPU in those at exit (several
    seconds of a SIGTERM's stop on a busy machine) and 0.05 s after this; and a forked child's
    collections never write to the objects it shares with its parent, so their pages stay
    shared (Python's `gc.freeze` documentation)."""
    gc.freeze()


class _Termination:
    """This pool child's SIGTERM state (see the module docstring)."""

    pool_child = False  # set by mark_pool_child in worker_process_init
    main_pid: int | None = None  # the worker's main process (note_main_process, in worker_init)
    installed = False
    deferred = False  # a SIGTERM was let pass
    previous: Any = None  # billiard's handler, called for the second SIGTERM


def note_main_process() -> None:
    """This process is a worker's main process (worker_init): never a pool child, even where it
    runs attempts itself and Celery sends it `worker_process_init` (`-P solo`)."""
    _Termination.main_pid = os.getpid()


def mark_pool_child() -> None:
    """This process is a prefork pool child: its attempts may defer SIGTERM. Not in a worker's
    main process: with `-P solo` it runs the attempts and gets `worker_process_init` too, but a
    SIGTERM there is the worker's own warm shutdown (the running attempt finishes, then the worker
    exits); deferred, the worker would never stop at a supervisor's SIGTERM."""
    if os.getpid() == _Termination.main_pid:
        return
    _Termination.pool_child = True
    _Termination.installed = False
    _Termination.deferred = False


def defer_termination() -> None:
    """Called as an attempt starts: from now on the first SIGTERM to this pool child is let pass.

    Installed at the first attempt rather than in `worker_process_init`, because billiard replaces
    any handler set there (except SIG_IGN) once the initializer returns; an idle child that has
    run no attempt has nothing to lose and keeps billiard's handler. A no-op outside a prefork
    pool child (an embedded worker, a thread pool, the main process)."""
    if not _Termination.pool_child or _Termination.installed:
        return
    try:
        previous = signal.getsignal(signal.SIGTERM)
        if previous == signal.SIG_IGN:  # already ignored (billiard's REMAP_SIGTERM)
            return
        signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main thread: nothing to defer
        return
    _Termination.previous = previous
    _Termination.installed = True


def stop_requested() -> bool:
    """Whether this pool process let a SIGTERM pass (its worker is being stopped as a group): it
    finishes its running attempt and takes no more (engine/transport/eager.py)."""
    return _Termination.deferred


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    if not _Termination.deferred:
        _Termination.deferred = True
        log.warning(
            "pool process %d: SIGTERM received; its running attempt finishes first (the worker's warm "
            "shutdown ends the process); a second SIGTERM ends it now",
            os.getpid(),
        )
        return
    previous = _Termination.previous
    if callable(previous):
        previous(signum, frame)
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # no handler of billiard's: the default action
    os.kill(os.getpid(), signal.SIGTERM)


def release_freed_memory() -> None:
    """Hand the free memory of the C heap back to the system (glibc's `malloc_trim`; nothing
    where the C library has none). Called after a task that stored a value by reference: a pool
    process that built a big list (a tool's result of a million elements, a loop's completion)
    otherwise keeps about a third of it mapped once the list is freed, and its level rises with
    the biggest value it ever held."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Any:
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
