"""The `shell` tool: run a playbook's shell commands on the worker, each in a process group of its own.

Forms (NoETL's): `cmds:` a list of programs (or one string), `cmd:` / `command:` one program, or
`script:` (tools/script.py: inline, file or http source) one program read from elsewhere. Each
program runs as `<shell> -c <program>` (`shell:`, default `sh`, as NoETL's default), one after
the other; the first that exits non-zero stops the rest. `cwd:` the working folder; `env:` the
variables added; `stdin:` text given to each program's standard input (none: /dev/null);
`timeout_seconds:` (NoETL's) or `timeout:` the seconds the whole call may run (default 600, as
NoETL's); `capture: false` discards the output.

Result (NoETL's shape): `{returncode, exit_code, stdout, stderr, commands: [{cmd_preview,
returncode, stdout, stderr, duration_ms}], duration_ms}`; `exit_code` is the Rust tool's name of
`returncode`. A non-zero exit fails the attempt with error kind `shell`, the result in the error's
data; a timeout fails it with kind `timeout`, a cancelled execution with kind `cancelled`.

What it decides:
- Environment: the programs see only PATH, HOME, LANG/LC_*, TZ, TMPDIR, USER and LOGNAME of the
  worker's environment (never NOETL_* variables, the store's URL or credentials), then `env:`,
  then the task's credential (`auth:`) as AUTH_<FIELD> variables (a DSN string: AUTH_DSN). A
  credential reaches a program only as an environment variable; its values, like every
  configured secret, are masked in the output by the worker before anything is written.
- Lifetime: each program is the leader of a new session (its own process group). When it exits,
  when the call times out, when the execution is cancelled (polled every CANCEL_POLL seconds),
  and when the attempt is interrupted (Celery's soft time limit, the pool process ending), the
  whole group is sent SIGTERM, then SIGKILL after KILL_GRACE seconds: nothing a program started
  in its group outlives the attempt. A guard in the group waits on a pipe only the worker holds:
  if the worker process dies (SIGKILL, OOM), the pipe closes and the guard kills the group.
- Output: at most OUTPUT_LIMIT bytes of each stream are kept per program (a note says how many
  were dropped); a result above NOETL_MAX_RESULT_BYTES is stored by reference by the worker.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from noetl_celery.core.vocabulary import ErrorKind, ToolErrorKind
from noetl_celery.tools import script as scripts
from noetl_celery.tools.base import Outcome, ToolCall, register
from noetl_celery.tools.settings import ToolSettings

DEFAULT_SHELL = "sh"  # NoETL's default (POSIX, present everywhere)
DEFAULT_TIMEOUT = 600.0  # seconds: NoETL's default for a shell call
OUTPUT_LIMIT = 8 * 1024 * 1024  # bytes of each stream kept per program
CANCEL_POLL = 1.0  # seconds between two checks that the execution still runs
KILL_GRACE = 2.0  # seconds between SIGTERM and SIGKILL of a program's group
PREVIEW_CHARS = 120  # characters of a program's first line in `cmd_preview`
READ_CHUNK = 65536
PASSED_VARIABLES = ("PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR", "USER", "LOGNAME")
FALLBACK_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
CREDENTIAL_PREFIX = "AUTH_"
# Started as the session leader: puts a guard in the background (it kills the whole group when the
# pipe on fd $1 reaches its end: the worker died), then becomes the program's shell. (The pipe's
# read end stays open in the program too: only its write end, held by the worker, decides.)
GUARD_WRAPPER = 'fd=$1; shift; { read -r _ < "/dev/fd/$fd"; kill -9 0; } </dev/null >/dev/null 2>&1 & exec "$@"'


class ShellSettings(ToolSettings):
    cmds: list[str] | str | None = None
    cmd: str | None = None
    command: str | None = None
    script: scripts.Script | None = None
    shell: str | None = None
    cwd: str | None = None
    env: dict[str, str | int | float | bool | None] | None = None
    stdin: str | None = None
    timeout_seconds: float | None = None
    capture: bool | None = None


@dataclass
class Stream:
    """One output stream of one program, kept up to OUTPUT_LIMIT bytes."""

    kept: bytearray = field(default_factory=bytearray)
    dropped: int = 0

    def text(self) -> str:
        text = self.kept.decode("utf-8", errors="replace")
        return f"{text}\n[... {self.dropped} more bytes not kept]" if self.dropped else text


@dataclass
class Ran:
    """How one program ended: `ended` is exit, timeout or cancelled."""

    returncode: int
    stdout: str
    stderr: str
    duration_ms: int
    ended: str = "exit"


class _Stop(Exception):
    """The call must stop now (`reason`: timeout or cancelled)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def programs(config: dict[str, Any], source_file: str | None) -> list[str]:
    """The programs the call runs, in order (raises ValueError when it names none)."""
    raw = config.get("cmds")
    if isinstance(raw, list):
        found = [str(program) for program in raw]
    elif isinstance(raw, str) and raw.strip():
        found = [raw]
    elif config.get("script") is not None:
        found = [scripts.load(config["script"], source_file)]
    else:
        found = [v for v in (config.get("cmd"), config.get("command")) if isinstance(v, str) and v.strip()][:1]
    found = [program for program in found if program.strip()]
    if not found:
        raise ValueError("shell: `cmds`, `cmd`, `command` or `script` must give a non-empty program")
    return found


def environment(config: dict[str, Any], credential: Any) -> dict[str, str]:
    """The programs' environment (see the module docstring)."""
    env = {name: os.environ[name] for name in PASSED_VARIABLES if name in os.environ}
    env.setdefault("PATH", FALLBACK_PATH)
    for key, value in (config.get("env") or {}).items():
        if value is not None:
            env[str(key)] = _env_text(value)
    env.update(credential_variables(credential))
    return env


def credential_variables(credential: Any) -> dict[str, str]:
    """The task's credential as AUTH_<FIELD> variables (a DSN or token string: AUTH_DSN)."""
    if credential is None:
        return {}
    if isinstance(credential, dict):
        return {
            CREDENTIAL_PREFIX + _variable_name(key): _env_text(value)
            for key, value in credential.items()
            if value is not None and not isinstance(value, (dict, list))
        }
    return {f"{CREDENTIAL_PREFIX}DSN": str(credential)}


def _variable_name(key: Any) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in str(key)).upper()


def _env_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _timeout(call: ToolCall) -> float:
    for value in (call.config.get("timeout_seconds"), call.config.get("timeout"), call.timeout):
        try:
            if value is not None and float(value) > 0:
                return float(value)
        except (TypeError, ValueError):
            continue
    return DEFAULT_TIMEOUT


def _read(pipe: Any, stream: Stream) -> None:
    """Read `pipe` to its end into `stream` (bounded)."""
    fd = pipe.fileno()
    try:
        with contextlib.suppress(OSError):
            while chunk := os.read(fd, READ_CHUNK):
                room = max(OUTPUT_LIMIT - len(stream.kept), 0)
                stream.kept += chunk[:room]
                stream.dropped += max(len(chunk) - room, 0)
    finally:
        pipe.close()


def group_alive(pgid: int) -> bool:
    """Whether a live (non-zombie) process is still in process group `pgid`."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] not in ("Z", "X") and int(fields[2]) == pgid:
            return True
    return not os.path.isdir("/proc")


def end_group(pgid: int, leader: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the whole group, SIGKILL after KILL_GRACE seconds if anything is left."""
    for sig, wait in ((signal.SIGTERM, KILL_GRACE), (signal.SIGKILL, KILL_GRACE)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            leader.poll()  # reap the leader: a zombie would keep the group alive to kill(0)
            if not group_alive(pgid):
                break
            time.sleep(0.02)
        if not group_alive(pgid):
            break
    leader.poll()


def run_program(
    program: str,
    *,
    shell: str,
    cwd: str | None,
    env: dict[str, str],
    stdin: str | None,
    capture: bool,
    deadline: float,
    cancelled: Callable[[], bool] | None,
) -> Ran:
    """Run one program in its own session until it exits, the deadline passes or the execution is
    cancelled; its whole group is ended in every case (also when the attempt is interrupted)."""
    started = time.monotonic()
    guard_read, guard_write = os.pipe()  # the write end stays in this process only
    output = subprocess.PIPE if capture else subprocess.DEVNULL
    try:
        leader = subprocess.Popen(  # noqa: S603 - running the playbook's program is the job
            ["/bin/sh", "-c", GUARD_WRAPPER, "noetl-shell", str(guard_read), shell, "-c", program],
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=output,
            stderr=output,
            cwd=cwd,
            env=env,
            pass_fds=(guard_read,),
            start_new_session=True,
        )
    except BaseException:
        os.close(guard_write)
        raise
    finally:
        os.close(guard_read)
    out, err = Stream(), Stream()
    readers = [
        threading.Thread(target=_read, args=(pipe, stream), daemon=True)
        for pipe, stream in ((leader.stdout, out), (leader.stderr, err))
        if pipe is not None
    ]
    for reader in readers:
        reader.start()
    ended = "exit"
    try:
        if stdin is not None and leader.stdin is not None:
            threading.Thread(target=_feed, args=(leader.stdin, stdin.encode()), daemon=True).start()
        try:
            _wait(leader, deadline, cancelled)
        except _Stop as stop:
            ended = stop.reason
    finally:
        end_group(leader.pid, leader)
        os.close(guard_write)
        for reader in readers:
            reader.join(timeout=KILL_GRACE)
    returncode = leader.returncode if ended == "exit" and leader.returncode is not None else -1
    duration = int((time.monotonic() - started) * 1000)
    return Ran(returncode, out.text(), err.text(), duration, ended)


def _feed(pipe: Any, data: bytes) -> None:
    with contextlib.suppress(OSError):  # the program did not read it all
        pipe.write(data)
    with contextlib.suppress(OSError):
        pipe.close()


def _wait(leader: subprocess.Popen[bytes], deadline: float, cancelled: Callable[[], bool] | None) -> None:
    """Wait for the program's exit; _Stop on the deadline or a cancelled execution."""
    next_check = time.monotonic() + CANCEL_POLL
    while True:
        now = time.monotonic()
        if now >= deadline:
            raise _Stop(ErrorKind.TIMEOUT)
        try:
            leader.wait(timeout=min(deadline - now, max(next_check - now, 0.01)))
            return
        except subprocess.TimeoutExpired:
            pass
        if cancelled is not None and time.monotonic() >= next_check:
            next_check = time.monotonic() + CANCEL_POLL
            if cancelled():
                raise _Stop(ErrorKind.CANCELLED)


def _preview(program: str) -> str:
    lines = program.strip().splitlines()
    return lines[0][:PREVIEW_CHARS] if lines else ""


def _result(ran: list[Ran], previews: list[str], started: float) -> dict[str, Any]:
    last = ran[-1]
    return {
        "returncode": last.returncode,
        "exit_code": last.returncode,
        "stdout": "\n".join(r.stdout for r in ran if r.stdout),
        "stderr": "\n".join(r.stderr for r in ran if r.stderr),
        "commands": [
            {
                "cmd_preview": preview,
                "returncode": r.returncode,
                "stdout": r.stdout,
                "stderr": r.stderr,
                "duration_ms": r.duration_ms,
            }
            for r, preview in zip(ran, previews, strict=False)
        ],
        "duration_ms": int((time.monotonic() - started) * 1000),
    }


def _failure(ran: list[Ran], previews: list[str], started: float, timeout: float) -> Outcome:
    last, preview = ran[-1], previews[len(ran) - 1] or "<empty>"
    data = _result(ran, previews, started)
    if last.ended == ErrorKind.TIMEOUT:
        message = f"shell: command timed out after {timeout:g} s (its process group was killed): {preview}"
        return Outcome.fail(ToolErrorKind.TIMEOUT, message, True, data=data)
    if last.ended == ErrorKind.CANCELLED:
        message = f"shell: the execution was cancelled; the command's process group was killed: {preview}"
        return Outcome.fail(ErrorKind.CANCELLED, message, data=data)
    tail = last.stderr.strip().splitlines()[-1:] if last.stderr.strip() else []
    said = f" ({tail[0][:300]})" if tail else ""
    message = f"shell: command exited with returncode={last.returncode}: {preview}{said}"
    return Outcome.fail(ToolErrorKind.SHELL, message, data=data, returncode=last.returncode)


def _refusal(config: dict[str, Any], shell: str) -> str | None:
    """Why the call cannot start (the shell or the folder is missing), or None."""
    if shutil.which(shell) is None:
        return f"shell: the shell {shell!r} is not installed on this worker"
    cwd = config.get("cwd")
    if cwd and not os.path.isdir(str(cwd)):
        return f"shell: cwd {cwd!r} is not a folder on this worker"
    return None


@register(
    "shell",
    fields={"cmds", "cmd", "command", "script", "shell", "cwd", "env", "stdin", "timeout_seconds", "capture"},
    required=({"cmds", "cmd", "command", "script"},),
    settings=ShellSettings,
)
def run_shell(call: ToolCall) -> Outcome:
    """Run the call's programs (see the module docstring)."""
    config = call.config
    try:
        found = programs(config, call.source_file)
    except scripts.ScriptError as exc:
        return Outcome.fail(ToolErrorKind.SCRIPT, f"shell: {exc}")
    except ValueError as exc:
        return Outcome.fail(ToolErrorKind.INVALID_ARGS, str(exc))
    shell = str(config.get("shell") or DEFAULT_SHELL)
    refused = _refusal(config, shell)
    if refused is not None:
        return Outcome.fail(ToolErrorKind.INVALID_ARGS, refused)
    env = environment(config, call.credential)
    timeout = _timeout(call)
    started = time.monotonic()
    deadline = started + timeout
    stdin = config.get("stdin")
    previews = [_preview(program) for program in found]
    ran: list[Ran] = []
    for program in found:
        ran.append(
            run_program(
                program,
                shell=shell,
                cwd=str(config["cwd"]) if config.get("cwd") else None,
                env=env,
                stdin=None if stdin is None else str(stdin),
                capture=config.get("capture") is not False,
                deadline=deadline,
                cancelled=call.cancelled,
            )
        )
        if ran[-1].ended != "exit" or ran[-1].returncode != 0:
            return _failure(ran, previews, started, timeout)
    return Outcome.ok(_result(ran, previews, started))
