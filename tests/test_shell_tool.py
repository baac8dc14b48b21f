"""The shell tool on its own: NoETL's forms and result shape, the environment a program sees,
and the lifetime of its process group (exit, timeout, cancel, an interrupted attempt); and
NOETL_DISABLED_TOOLS, which turns tool kinds off at validate and in the worker."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from billiard.exceptions import SoftTimeLimitExceeded

from noetl_celery.core.errors import PlaybookError
from noetl_celery.tools import shell
from noetl_celery.tools.base import Outcome, ToolCall, run_tool
from tests.support.workers import group_members, process_alive
from tests.test_tool_settings import call, compile_text, one_step, problems


def run(config: dict, **extra) -> Outcome:  # type: ignore[no-untyped-def]
    return run_tool(ToolCall("shell", config, **extra))


def leader_of(outcome: Outcome) -> int:
    """The pid the program printed first (`echo $$`): its session's, and process group's, id."""
    return int(outcome.data["stdout"].split()[0])


def wait_gone(pgid: int, timeout: float = 5.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return group_members(pgid)


# ------------------------------------------------------------------ forms and result


def test_cmds_run_in_order_and_the_result_has_noetls_shape() -> None:
    outcome = run({"cmds": ["echo one; echo warn >&2", "printf two"]})
    assert outcome.status == "ok", outcome.error
    data = outcome.data
    assert (data["returncode"], data["exit_code"]) == (0, 0)
    assert data["stdout"] == "one\n\ntwo" and data["stderr"] == "warn\n"
    assert [(c["cmd_preview"], c["returncode"], c["stdout"]) for c in data["commands"]] == [
        ("echo one; echo warn >&2", 0, "one\n"),
        ("printf two", 0, "two"),
    ]
    assert all(isinstance(c["duration_ms"], int) for c in data["commands"]) and data["duration_ms"] >= 0


@pytest.mark.parametrize("key", ["cmd", "command", "cmds"])
def test_one_program_by_each_name(key: str) -> None:
    outcome = run({key: "echo $((6 * 7))"})
    assert outcome.status == "ok" and outcome.data["stdout"] == "42\n"


def test_script_stdin_cwd_and_the_shell_chosen(tmp_path: Path) -> None:
    script = {"source": {"type": "inline", "code": 'read -r a; echo "${a^^} in $PWD"'}}
    outcome = run({"script": script, "stdin": "quiet\n", "cwd": str(tmp_path), "shell": "bash"})
    assert outcome.status == "ok", outcome.error
    assert outcome.data["stdout"] == f"QUIET in {tmp_path}\n"
    (tmp_path / "job.sh").write_text("echo from file\n")
    playbook = tmp_path / "p.yaml"
    outcome = run({"script": {"uri": "job.sh"}}, source_file=str(playbook))
    assert outcome.data["stdout"] == "from file\n"


def test_a_non_zero_exit_fails_with_kind_shell_and_stops_the_rest() -> None:
    outcome = run({"cmds": ["echo partial; echo boom >&2; exit 4", "echo never"]})
    assert outcome.status == "error" and outcome.error is not None
    assert outcome.error["kind"] == "shell" and outcome.error["returncode"] == 4
    assert (
        outcome.error["message"]
        == "shell: command exited with returncode=4: echo partial; echo boom >&2; exit 4 (boom)"
    )
    assert outcome.data["returncode"] == 4 and outcome.data["stdout"] == "partial\n"
    assert len(outcome.data["commands"]) == 1


def test_bad_input_is_named() -> None:
    assert run({"cmds": []}).error["message"] == (  # type: ignore[index]
        "shell: `cmds`, `cmd`, `command` or `script` must give a non-empty program"
    )
    missing_shell = run({"cmd": "true", "shell": "no-such-shell-here"})
    assert missing_shell.error["kind"] == "invalid_args"  # type: ignore[index]
    assert missing_shell.error["message"] == "shell: the shell 'no-such-shell-here' is not installed on this worker"  # type: ignore[index]
    assert run({"cmd": "true", "cwd": "/no/such/folder"}).error["message"] == (  # type: ignore[index]
        "shell: cwd '/no/such/folder' is not a folder on this worker"
    )
    found = problems(one_step("kind: shell\nshell_name: bash\n"))
    assert sorted(p.message for p in found) == [
        "shell tool needs one of: cmd, cmds, command, script",
        "unknown key 'shell_name' for the shell tool; did you mean 'shell'?",
    ]
    found = problems(one_step("kind: shell\ncmd: echo\nenv: [A]\n"))
    assert [p.message for p in found] == ["must be a mapping, not a list"]


def test_output_above_the_cap_is_cut_with_a_note(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shell, "OUTPUT_LIMIT", 1000)
    outcome = run({"cmd": "head -c 5000 /dev/zero | tr '\\0' x"})
    assert outcome.data["stdout"] == "x" * 1000 + "\n[... 4000 more bytes not kept]"


# ------------------------------------------------------------------ environment and credentials


def test_the_program_sees_only_safe_worker_variables_env_and_the_credential(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOETL_DATABASE_URL", "postgresql://u:store-password@db/x")
    monkeypatch.setenv("NOETL_AUTH_SOMETHING", "a-credential-value")
    monkeypatch.setenv("SOME_WORKER_SETTING", "worker-only")
    credential = {"user": "svc", "password": "pw-1234", "nested": {"x": 1}}
    outcome = run({"cmd": "env | sort", "env": {"MODE": "fast", "FLAG": True, "SKIP": None}}, credential=credential)
    seen = dict(line.split("=", 1) for line in outcome.data["stdout"].splitlines())
    assert seen["MODE"] == "fast" and seen["FLAG"] == "true" and "SKIP" not in seen
    assert seen["AUTH_USER"] == "svc" and seen["AUTH_PASSWORD"] == "pw-1234" and "AUTH_NESTED" not in seen
    assert "PATH" in seen
    assert not [name for name in seen if name.startswith("NOETL_") or name == "SOME_WORKER_SETTING"]
    assert (
        run({"cmd": 'echo "$AUTH_DSN"'}, credential="postgresql://a:b@h/d").data["stdout"] == "postgresql://a:b@h/d\n"
    )


def test_a_credential_printed_by_the_program_is_masked_in_the_outcome(tmp_path: Path) -> None:
    from noetl_celery.config import secret_registry
    from noetl_celery.engine.attempt import worker

    secrets: set[str] = set()
    outcome = worker._call("shell", {"cmd": 'echo "pw is $AUTH_PASSWORD"'}, {"password": "pw-98765"}, {}, 1, secrets)
    assert outcome.data["stdout"] == "pw is pw-98765\n"  # the tool sees it; the worker masks what it writes
    body = secret_registry.mask(outcome.to_dict())
    assert "pw-98765" not in str(body) and body["data"]["stdout"] == "pw is ***\n"


# ------------------------------------------------------------------ the process group's lifetime


def test_a_background_child_does_not_outlive_a_program_that_exited() -> None:
    outcome = run({"cmd": "echo $$; sleep 600 & echo started"})
    assert outcome.status == "ok", outcome.error
    assert wait_gone(leader_of(outcome)) == []


def test_a_timeout_kills_the_whole_group() -> None:
    started = time.monotonic()
    outcome = run({"cmd": "echo $$; sleep 600 & sleep 500", "timeout_seconds": 1})
    assert time.monotonic() - started < 1 + 2 * shell.KILL_GRACE
    assert outcome.error is not None and outcome.error["kind"] == "timeout" and outcome.error["retryable"] is True
    assert outcome.error["message"].startswith("shell: command timed out after 1 s (its process group was killed)")
    assert group_members(leader_of(outcome)) == []


def test_a_program_that_ignores_sigterm_is_killed() -> None:
    outcome = run({"cmd": "trap '' TERM; echo $$; sleep 600 & while :; do sleep 1; done", "timeout": 1})
    assert outcome.error["kind"] == "timeout"  # type: ignore[index]
    assert wait_gone(leader_of(outcome)) == []


def test_a_cancelled_execution_stops_the_program_and_its_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shell, "CANCEL_POLL", 0.1)
    asked = []

    def cancelled() -> bool:
        asked.append(time.monotonic())
        return len(asked) >= 3

    outcome = run({"cmd": "echo $$; sleep 600 & sleep 500"}, cancelled=cancelled)
    assert outcome.error is not None and outcome.error["kind"] == "cancelled"
    assert outcome.error["retryable"] is False
    assert group_members(leader_of(outcome)) == []


def test_an_interrupted_attempt_kills_the_group_before_it_unwinds(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Celery's soft time limit (or the pool ending the process) raises inside the tool: the group
    is killed on the way out, and the limit is reported as the attempt's timeout."""
    monkeypatch.setattr(shell, "CANCEL_POLL", 0.1)
    pid_file = tmp_path / "pid"

    def interrupted() -> bool:
        if pid_file.exists() and pid_file.read_text().strip():
            raise SoftTimeLimitExceeded()
        return False

    outcome = run({"cmd": f"echo $$ > {pid_file}; sleep 600 & sleep 500"}, cancelled=interrupted, timeout=3)
    assert outcome.error is not None and outcome.error["kind"] == "timeout"
    assert group_members(int(pid_file.read_text())) == []


def test_the_worker_dying_kills_the_group(tmp_path: Path) -> None:
    """A process that runs a shell step and is SIGKILLed: the guard sees its pipe close and kills
    the program's group."""
    import subprocess
    import sys

    pid_file = tmp_path / "pid"
    code = (
        "from noetl_celery.tools.base import ToolCall, run_tool\n"
        f"run_tool(ToolCall('shell', {{'cmd': 'echo $$ > {pid_file}; sleep 600 & sleep 500'}}))\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": os.getcwd()})
    deadline = time.monotonic() + 20
    while not (pid_file.exists() and pid_file.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.05)
    pgid = int(pid_file.read_text())
    assert len(group_members(pgid)) >= 3  # the program, its background child, the guard
    proc.kill()
    proc.wait()
    assert wait_gone(pgid) == []
    assert not process_alive(pgid)


# ------------------------------------------------------------------ NOETL_DISABLED_TOOLS


def test_a_disabled_kind_is_refused_by_name_at_validate_and_in_the_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOETL_DISABLED_TOOLS", "shell, python")
    for kind, body in (("shell", "kind: shell\ncmd: 'true'\n"), ("python", "kind: python\ncode: 'result = 1'\n")):
        found = problems(one_step(body))
        assert [p.message for p in found] == [
            f"tool kind '{kind}' is turned off on this deployment (NOETL_DISABLED_TOOLS)"
        ]
        assert found[0].path == "workflow[0](start).tool.kind"
    outcome = call("shell", {"cmd": "touch /tmp/should-not-exist-disabled"})
    assert outcome.error == {
        "kind": "disabled",
        "message": "tool kind 'shell' is turned off on this deployment (NOETL_DISABLED_TOOLS)",
        "retryable": False,
    }
    assert not os.path.exists("/tmp/should-not-exist-disabled")
    assert call("noop", {}).status == "ok"  # the other kinds run
    monkeypatch.delenv("NOETL_DISABLED_TOOLS")
    compile_text(one_step("kind: shell\ncmd: 'true'\n"))  # turned on again: it validates


def test_disabled_tools_setting_is_shown_by_config() -> None:
    from noetl_celery.config import settings

    loaded = settings.load({"NOETL_DISABLED_TOOLS": "python,shell,"})
    assert loaded.disabled_tools == frozenset({"python", "shell"})
    assert loaded.masked()["NOETL_DISABLED_TOOLS"] == "python,shell"
    assert settings.load({}).masked()["NOETL_DISABLED_TOOLS"] == "(none)"


def test_playbook_error_is_raised_for_a_disabled_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOETL_DISABLED_TOOLS", "shell")
    with pytest.raises(PlaybookError):
        compile_text(one_step("kind: shell\ncmd: 'true'\n"))
