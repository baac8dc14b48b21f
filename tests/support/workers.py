"""Real Celery worker processes for tests.

`WorkerProcess` runs ``sys.executable -m celery -A <app> worker ...`` in its own session (so its
pid is also its process-group id and `.kill()` takes the pool children with it), with stdout and
stderr in a log file. Readiness is read from that log (celery logs ``<node> ready.``); there is
no ``app.control.ping`` since workers run with gossip and mingle off.

Environment: the worker gets this process's environment *without* any ``NOETL_*`` variable
(except ``NOETL_TEST_*``), so a developer's shell settings never point a test worker at a real
broker or database; the test passes what it wants in `env`. ``PYTHONUNBUFFERED=1`` and the repo
root on ``PYTHONPATH`` are added.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Self

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_QUEUES = ("noetl.tasks", "noetl.events")
READY_RE = re.compile(r"@\S+ ready\.")
PROBLEM_RE = re.compile(r": (WARNING|ERROR|CRITICAL)/|Traceback|Error:")

_counter = itertools.count(1)


class WorkerStartError(RuntimeError):
    pass


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) pids whose process group is `pgid`, read from /proc."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        # fields: state, ppid, pgrp, ...
        if fields[0] not in ("Z", "X") and int(fields[2]) == pgid:
            pids.append(int(entry))
    return pids


def process_alive(pid: int) -> bool:
    """True if `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def worker_env(overrides: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NOETL_") or k.startswith("NOETL_TEST_")}
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    env.update({k: str(v) for k, v in (overrides or {}).items()})
    return env


class WorkerProcess:
    """A real ``celery worker`` process.

    >>> with WorkerProcess(env={"NOETL_BROKER_URL": url}, concurrency=2) as w:
    ...     ...                               # started and ready; stopped at exit
    """

    def __init__(
        self,
        app: str = "noetl_celery",
        *,
        env: Mapping[str, str] | None = None,
        concurrency: int = 4,
        pool: str = "prefork",
        queues: Sequence[str] | str | None = DEFAULT_QUEUES,
        name: str | None = None,
        log_dir: str | Path | None = None,
        loglevel: str = "INFO",
        extra_args: Sequence[str] = (),
        cwd: str | Path | None = None,
        die_with_parent: bool = True,
    ):
        self.app = app
        self.env_overrides = dict(env or {})
        self.concurrency = concurrency
        self.pool = pool
        self.queues = queues if isinstance(queues, (str, type(None))) else ",".join(queues)
        self.name = name or f"w{next(_counter)}-{os.getpid()}@%h"
        self._own_log_dir = log_dir is None
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="noetl-worker-"))
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", self.name.split("@")[0])
        self.log_path = self.log_dir / f"worker-{safe}.log"
        self.loglevel = loglevel
        self.extra_args = list(extra_args)
        self.cwd = Path(cwd) if cwd else REPO_ROOT
        self.die_with_parent = die_with_parent
        self.proc: subprocess.Popen | None = None
        self.returncode: int | None = None
        self._term_sent = False

    # ------------------------------------------------------------------ command
    def argv(self) -> list[str]:
        argv = [sys.executable, "-m", "celery", "-A", self.app, "worker"]
        if self.queues:
            argv += ["-Q", self.queues]
        argv += [
            "-c",
            str(self.concurrency),
            "-P",
            self.pool,
            "--without-heartbeat",
            "--without-gossip",
            "--without-mingle",
            "-n",
            self.name,
            "-l",
            self.loglevel,
        ]
        return argv + self.extra_args

    @property
    def node(self) -> str:
        """The node name with %h/%n/%d expanded as celery does."""
        host = socket.gethostname()
        short, _, domain = host.partition(".")
        return self.name.replace("%h", host).replace("%n", short).replace("%d", domain)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def pgid(self) -> int | None:
        return self.proc.pid if self.proc else None  # own session: pgid == pid

    # ------------------------------------------------------------------ life cycle
    def start(self, timeout: float = 30) -> WorkerProcess:
        if self.proc is not None:
            raise RuntimeError("worker already started")
        argv = self.argv()
        setpriv = shutil.which("setpriv") if self.die_with_parent else None
        if setpriv:  # SIGTERM (warm shutdown) if the thread that started it dies
            argv = [setpriv, "--pdeathsig=TERM", "--", *argv]
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            log.write(f"### start: {' '.join(self.argv())}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                argv,
                cwd=self.cwd,
                env=worker_env(self.env_overrides),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while True:
            if READY_RE.search(self._read_log(offset)):
                return self
            if self.proc.poll() is not None:
                self.returncode = self.proc.returncode
                raise WorkerStartError(
                    f"worker {self.name} exited with {self.returncode} before "
                    f"it was ready; log tail:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                self.kill()
                raise WorkerStartError(f"worker {self.name} not ready after {timeout} s; log tail:\n{self.log_tail()}")
            time.sleep(0.1)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def alive_group(self) -> list[int]:
        """Live pids of the worker's process group (main process and pool children)."""
        return group_members(self.pgid) if self.pgid else []

    def request_stop(self) -> None:
        """Send SIGTERM (warm shutdown) without waiting; `stop()` then only waits."""
        if self.proc is not None and self.proc.poll() is None and not self._term_sent:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            self._term_sent = True

    def stop(self, timeout: float = 20) -> int | None:
        """Warm shutdown: SIGTERM, wait up to `timeout` s, then SIGKILL of the whole group.

        Returns the exit code of the main process (negative: killed by that signal).
        """
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.request_stop()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
        self._kill_group_and_wait()
        self._term_sent = False
        return self.returncode

    def kill(self, timeout: float = 10) -> int | None:
        """SIGKILL the whole process group at once (a crash) and wait until it is gone."""
        if self.proc is None:
            return None
        self._kill_group_and_wait(timeout)
        return self.returncode

    def _kill_group_and_wait(self, timeout: float = 10) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(0.05)
            if self.proc.poll() is not None and not self.alive_group():
                break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"worker {self.name}: process group {self.proc.pid} still has {self.alive_group()} after SIGKILL"
                )
            time.sleep(0.05)
        self.returncode = self.proc.returncode

    # ------------------------------------------------------------------ logs
    def _read_log(self, offset: int = 0) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def log_text(self) -> str:
        return self._read_log()

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def wait_for_log(self, pattern: str | re.Pattern[str], timeout: float = 10) -> re.Match[str]:
        """Wait until `pattern` (a regex) appears in the log; returns the match."""
        rx = re.compile(pattern) if isinstance(pattern, str) else pattern
        deadline = time.monotonic() + timeout
        while True:
            m = rx.search(self.log_text())
            if m:
                return m
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{rx.pattern!r} not in worker {self.name} log after {timeout} s; tail:\n{self.log_tail()}"
                )
            time.sleep(0.1)

    def cleanup(self) -> None:
        """Remove the log directory if this object created it."""
        if self._own_log_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> Self:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running() else f"exit={self.returncode}"
        return f"<WorkerProcess {self.node} pid={self.pid} {state}>"


class WorkerGroup:
    """What the `worker_factory` fixture keeps: the workers a test made, stopped at teardown."""

    def __init__(self, log_dir: Path, default_env: Mapping[str, str] | None = None):
        self.log_dir = Path(log_dir)
        self.default_env = dict(default_env or {})
        self.workers: list[WorkerProcess] = []

    def __call__(
        self,
        app: str = "noetl_celery",
        *,
        env: Mapping[str, str] | None = None,
        start: bool = True,
        timeout: float = 30,
        **kwargs,
    ) -> WorkerProcess:
        merged = {**self.default_env, **(env or {})}
        kwargs.setdefault("log_dir", self.log_dir)
        worker = WorkerProcess(app, env=merged, **kwargs)
        self.workers.append(worker)
        if start:
            worker.start(timeout=timeout)
        return worker

    def stop_all(self) -> list[str]:
        """Stop every worker; returns the errors met (empty when all went well). All are told to
        stop first, so their warm shutdowns (about 5 s each on RabbitMQ) overlap."""
        errors = []
        for w in self.workers:
            with contextlib.suppress(Exception):
                w.request_stop()
        for w in self.workers:
            try:
                w.stop()
            except Exception as exc:  # noqa: BLE001 - keep stopping the others
                errors.append(f"{w!r}: {exc}")
        return errors

    def log_sections(self, lines: int = 15, problems: int = 40) -> list[tuple[str, str]]:
        """For a failed test: each worker's last WARNING/ERROR lines and the tail of its log (kept
        short, so the assertion stays readable at the end of a long run's output)."""
        sections = []
        for w in self.workers:
            text = w.log_text().splitlines()
            flagged = [line for line in text if PROBLEM_RE.search(line)][-problems:]
            body = "\n".join(["-- warnings and errors:", *(flagged or ["(none)"]), "-- last lines:", *text[-lines:]])
            sections.append((f"worker {w.node} (pid {w.pid}) log", body))
        return sections
