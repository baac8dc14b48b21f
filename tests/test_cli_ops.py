"""Operators' commands through the CLI, as a user runs them (a subprocess with a clean
environment): `executions` with sub-playbooks, Ctrl-C and --timeout on `run`, `resume` on the
embedded default, `cancel` and `status` of a cancelled execution, `migrate`'s messages, a
password with an unencoded '@', cursor and batched loops in the progress lines."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from noetl_celery.compiler import compile_playbook
from noetl_celery.runner import create_execution
from noetl_celery.store import repo, views
from noetl_celery.store.db import current_revision, downgrade, head_revision, transaction
from tests.support.engines import REPO_ROOT, _clean_env, cli

HEAD = head_revision()  # the revision `migrate` brings a store to

PLAYBOOKS = REPO_ROOT / "playbooks"
HELLO = PLAYBOOKS / "hello_world.yaml"
SLOW_LOOP = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: slow_loop}
workload: {n: 200}
workflow:
  - step: start
    loop:
      in: "{{ range(n) | list }}"
      iterator: i
      spec: {mode: parallel, max_in_flight: 2}
    tool: {kind: python, args: {i: "{{ iter.i }}"}, code: "import time\\ntime.sleep(0.1)\\nresult = i"}
"""


def home_env(tmp_path: Path) -> dict[str, str]:
    return {"NOETL_HOME": str(tmp_path / "home")}


def _default_sigint() -> None:
    """Ctrl-C as a terminal delivers it, whatever disposition the test runner inherited."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _listed_ids(stdout: str) -> list[tuple[int, int]]:
    """(depth, execution id) of each line of `executions`."""
    out = []
    for line in stdout.splitlines():
        match = re.match(r"^(\s*)(?:└ )?(\d+)\s", line)
        assert match, line
        out.append((len(match.group(1)) // 2, int(match.group(2))))
    return out


# --------------------------------------------------------------------------- executions


def test_executions_lists_children_under_their_parent(either_store):
    url = either_store
    plan = compile_playbook(str(HELLO))
    parent = create_execution(plan, url)
    child = create_execution(plan, url, parent_execution_id=parent)
    grandchild = create_execution(plan, url, parent_execution_id=child)
    with transaction(url) as conn:
        repo.finish_execution(conn, child, "failed", error={"message": "no"}, failed_step="start")
    proc = cli(["executions"], {"NOETL_DATABASE_URL": url})
    assert proc.returncode == 0, proc.stderr
    assert _listed_ids(proc.stdout) == [(0, parent), (1, child), (2, grandchild)], proc.stdout
    child_line = proc.stdout.splitlines()[1]
    assert " failed " in child_line and "failed at start" in child_line, child_line
    assert re.search(r"\d+\.\ds\s+0/0", child_line), child_line  # the duration of a finished child


# --------------------------------------------------------------------------- cancel / status


def test_cancel_exits_0_and_status_shows_the_cancellation(tmp_path):
    env = home_env(tmp_path)
    url = f"sqlite:///{tmp_path / 'home' / 'noetl.sqlite'}"
    execution_id = create_execution(compile_playbook(str(HELLO)), url)  # running, nothing dispatched
    running = cli(["status", str(execution_id)], env)
    assert running.returncode == 3, running.stdout  # still running
    cancelled = cli(["cancel", str(execution_id), "--reason", "operator says stop"], env)
    assert cancelled.returncode == 0, cancelled.stderr
    assert cancelled.stdout.strip() == f"execution {execution_id}: cancelled"
    again = cli(["cancel", str(execution_id)], env)
    assert again.returncode == 0 and "already cancelled, nothing to cancel" in again.stdout
    status = cli(["status", str(execution_id)], env)
    assert status.returncode == 4
    assert "cancelled: operator says stop" in status.stdout and "failed step" not in status.stdout, status.stdout
    assert cli(["cancel", "12345"], env).returncode == 2


def test_a_loop_of_a_cancelled_execution_shows_cancelled_with_nothing_in_flight(sqlite_url):
    execution_id = create_execution(compile_playbook(str(HELLO)), sqlite_url)
    with transaction(sqlite_url) as conn:
        for run_id, mode, total in (("r1", "parallel", 40), ("r2", "cursor", 0)):
            repo.create_loop(
                conn,
                {"run_id": run_id, "execution_id": execution_id, "step": run_id, "mode": mode, "total": total}
                | {"max_in_flight": 4, "collection": None, "context": {}},
            )
        running = {loop["step"]: loop for loop in views.loops(conn, execution_id)}
    assert (running["r1"]["status"], running["r1"]["in_flight"]) == ("running", 4)
    assert (running["r2"]["total"], running["r2"]["in_flight"]) == (None, 4)  # a cursor loop: no total
    assert views.loop_count(running["r2"]) == "0 rows so far"
    with transaction(sqlite_url) as conn:
        repo.finish_execution(conn, execution_id, "cancelled", error={"message": "stop"})
        ended = views.loops(conn, execution_id)
    assert [(loop["status"], loop["in_flight"]) for loop in ended] == [("cancelled", 0), ("cancelled", 0)]
    assert views.loop_count(ended[1]) == "0/0"


# --------------------------------------------------------------------------- Ctrl-C, --timeout, resume


def test_ctrl_c_while_an_embedded_run_waits_is_raised_between_two_reads_of_the_store():
    """Ctrl-C pressed inside a read of the store (here: between two statements of the test) is
    noted, not raised there; the next poll raises it, outside any transaction. Raised inside a
    SQLite transaction it could leave the write lock held, and the cancel that follows failed
    after the busy timeout ("database is locked"). After it, a Ctrl-C pressed again is noted
    only (the command is ending); without one, the handler from before is put back."""
    from noetl_celery import runner

    before = signal.getsignal(signal.SIGINT)
    polled = []
    with runner._ctrl_c_between_reads() as pressed:
        poll = runner._raising_when(pressed, polled.append)
        poll(1)
        os.kill(os.getpid(), signal.SIGINT)  # lands "inside a read": nothing is raised here
        read_finished = True
        with pytest.raises(KeyboardInterrupt):
            poll(1)  # the next poll, between two reads
    assert read_finished and polled == [1]  # the poll that raised did not call on_poll
    try:  # the command is ending: a Ctrl-C pressed again is noted, not raised
        os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is not before
    finally:
        signal.signal(signal.SIGINT, before)
    with runner._ctrl_c_between_reads() as pressed:  # no Ctrl-C: the handler is put back
        runner._raising_when(pressed, polled.append)(2)
    assert signal.getsignal(signal.SIGINT) is before and polled == [1, 2]


def test_after_a_ctrl_c_the_command_is_not_interrupted_again_on_its_way_out(monkeypatch):
    """A Ctrl-C pressed again after the run was interrupted (while it cancels, stops its worker
    or says so) is noted only. The handler from before used to be put back as the run unwound,
    and a Ctrl-C landing then was raised outside the run: the command said it had been
    interrupted before the execution started, and the execution went uncancelled."""
    import contextlib

    from noetl_celery import runner
    from noetl_celery.config import settings as noetl_settings
    from noetl_celery.core.errors import Interrupted

    cancelled: list[int] = []
    monkeypatch.setattr(runner, "embedded_worker", contextlib.nullcontext)
    monkeypatch.setattr(runner, "cancel", lambda url, execution_id, reason=None: cancelled.append(execution_id))

    def wait(url, execution_id, timeout, on_poll):
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the run waits
        on_poll(execution_id)  # raises it, between two reads

    monkeypatch.setattr(runner, "wait", wait)
    before = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(Interrupted) as interrupted:
            runner._run_here(noetl_settings.load({}), lambda: 7, None, None)
        try:
            os.kill(os.getpid(), signal.SIGINT)  # pressed again as the command says it was interrupted
        except KeyboardInterrupt:
            pytest.fail("a Ctrl-C after the run was interrupted was raised on the command's way out")
        assert interrupted.value.execution_id == 7 and cancelled == [7]
    finally:
        signal.signal(signal.SIGINT, before)


def test_ctrl_c_on_run_cancels_the_execution_and_an_embedded_resume_finishes_it(tmp_path):
    env = home_env(tmp_path)
    playbook = tmp_path / "slow_loop.yaml"
    playbook.write_text(SLOW_LOOP)
    proc = subprocess.Popen(
        [sys.executable, "-m", "noetl_celery.cli", "run", str(playbook)],
        env=_clean_env(env),
        cwd=REPO_ROOT,
        preexec_fn=_default_sigint,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    first = proc.stderr.readline()  # the loop has started: the execution is running
    assert first.startswith("loop      start: 200 iterations"), first
    proc.send_signal(signal.SIGINT)
    for _ in range(20):  # an impatient user presses it again while the command cancels and stops
        try:
            proc.wait(timeout=0.05)
            break
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (out, err)
    assert "Aborted" not in err and "Traceback" not in err, err
    execution_id = int(re.search(r"interrupted: execution (\d+) cancelled", err).group(1))  # type: ignore[union-attr]
    assert f"noetl-celery resume {execution_id}" in err
    status = cli(["status", "--json", str(execution_id)], env)
    assert status.returncode == 4
    record = json.loads(status.stdout)
    assert record["status"] == "cancelled" and record["error"]["message"].startswith("interrupted: Ctrl-C")
    assert record["loops"][0]["status"] == "cancelled" and record["loops"][0]["done"] < 200

    resumed = cli(["resume", "--json", "--quiet", str(execution_id)], env)  # no broker: runs here
    assert resumed.returncode == 0, resumed.stderr
    assert f"execution {execution_id}: resumed (epoch 1)" in resumed.stderr
    outcome = json.loads(resumed.stdout)
    assert outcome["status"] == "completed" and outcome["results"]["start"]["results"] == list(range(200))


def test_run_timeout_cancels_the_execution_and_exits_3(tmp_path):
    env = home_env(tmp_path)
    playbook = tmp_path / "slow_loop.yaml"
    playbook.write_text(SLOW_LOOP)
    proc = cli(["run", "--json", "--timeout", "1", str(playbook)], env)
    assert proc.returncode == 3, proc.stderr
    outcome = json.loads(proc.stdout)
    assert outcome["status"] == "cancelled" and outcome["timed_out"] is True
    assert outcome["error"]["message"] == "timed out: still running after --timeout 1 s"
    assert f"execution {outcome['execution_id']} cancelled" in proc.stderr
    assert cli(["status", str(outcome["execution_id"])], env).returncode == 4  # not left running


def test_resume_of_a_completed_execution_on_the_embedded_default_is_refused(tmp_path):
    env = home_env(tmp_path)
    run = cli(["run", "--json", "--quiet", str(HELLO)], env)
    execution_id = json.loads(run.stdout)["execution_id"]
    proc = cli(["resume", str(execution_id)], env)
    assert proc.returncode == 2
    assert "is completed: only a failed or cancelled execution resumes" in proc.stderr
    assert "no broker" not in proc.stderr


# --------------------------------------------------------------------------- migrate


def test_migrate_says_the_revision_it_reached_and_refuses_to_go_back(either_store, tmp_path):
    url = either_store
    env = {"NOETL_DATABASE_URL": url}
    if url.startswith("sqlite"):  # an empty file: migrate creates the schema
        first = cli(["migrate"], env)
        assert first.returncode == 0, first.stderr
        assert first.stdout.strip().endswith(f"is at revision {HEAD} (was empty)"), first.stdout
    same = cli(["migrate"], env)
    assert same.returncode == 0 and same.stdout.strip().endswith(f"is at revision {HEAD}: nothing to do"), same.stdout
    back = cli(["migrate", "--revision", "0002"], env)
    assert back.returncode == 2
    assert f"is at revision {HEAD}, past 0002: `noetl-celery migrate` only upgrades" in back.stderr, back.stderr
    assert current_revision(url) == HEAD
    downgrade(url, "0002")
    by_file = cli(["migrate", "--revision", "0003_cursor_subplaybooks.py"], env)
    assert by_file.returncode == 0, by_file.stderr
    assert by_file.stdout.strip().endswith("is at revision 0003 (was 0002)"), by_file.stdout
    unknown = cli(["migrate", "--revision", "0009"], env)
    assert unknown.returncode == 2 and "'0009' is not a schema revision of this release" in unknown.stderr


# --------------------------------------------------------------------------- DSN with '@'


@pytest.mark.parametrize("command", [["executions"], ["config"], ["status", "1"]])
def test_a_password_with_an_unencoded_at_is_refused_and_not_shown(tmp_path, command):
    env = {"NOETL_DATABASE_URL": "postgresql://noetl:s3cr@tpw@127.0.0.1:5432/noetl", **home_env(tmp_path)}
    proc = cli(command, env)
    assert proc.returncode == 2
    text = proc.stdout + proc.stderr
    assert "percent-encode @ in passwords" in text, text
    assert "postgresql+psycopg2://***@127.0.0.1:5432/noetl" in text, text
    for part in ("s3cr", "tpw", "noetl:"):
        assert part not in text.replace("/noetl", ""), text


# --------------------------------------------------------------------------- loops in progress lines


def test_a_cursor_loop_prints_its_slots_and_rows_not_a_total(tmp_path):
    env = home_env(tmp_path)
    proc = cli(["run", str(PLAYBOOKS / "cursor_queue.yaml"), "--set", "jobs=24"], env)
    assert proc.returncode == 0, proc.stderr
    assert "loop      drain: cursor, 4 slots pulling rows" in proc.stderr, proc.stderr
    assert "loop      drain: done, 24 rows, 24 ok, 0 failed" in proc.stderr, proc.stderr
    assert "None" not in proc.stderr
    execution_id = proc.stdout.split()[1]
    status = cli(["status", execution_id], env)
    assert "loop drain: completed 24/24 (24 ok, 0 failed, 0 in flight" in status.stdout, status.stdout


def test_a_batched_loop_off_a_terminal_prints_its_end_lines(tmp_path):
    proc = cli(["run", str(PLAYBOOKS / "loop_batched.yaml"), "--set", "n=1500"], home_env(tmp_path))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    tail = ["loop      square: done, 1500 ok, 0 failed", "completed square", "completed summary", "completed execution"]
    assert lines[-4:] == tail, lines


# --------------------------------------------------------------------------- examples


def test_examples_writes_the_shipped_playbooks_and_refuses_to_overwrite_changed_ones(tmp_path):
    shipped = sorted(p.name for p in PLAYBOOKS.glob("*.yaml"))
    proc = cli(["examples", str(tmp_path / "ex")], home_env(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (tmp_path / "ex").iterdir()) == shipped
    for name in shipped:
        assert (tmp_path / "ex" / name).read_text() == (PLAYBOOKS / name).read_text(), name
    (tmp_path / "ex" / "hello_world.yaml").write_text("# mine\n")
    again = cli(["examples", str(tmp_path / "ex")], home_env(tmp_path))
    assert again.returncode == 2 and "hello_world.yaml with other contents" in again.stderr
    assert (tmp_path / "ex" / "hello_world.yaml").read_text() == "# mine\n"
    forced = cli(["examples", "--force", str(tmp_path / "ex")], home_env(tmp_path))
    assert forced.returncode == 0 and (tmp_path / "ex" / "hello_world.yaml").read_text() == HELLO.read_text()


@pytest.mark.slow
def test_the_wheel_carries_the_example_playbooks(tmp_path):
    import shutil
    import zipfile

    source = tmp_path / "src"
    shutil.copytree(
        REPO_ROOT,
        source,
        symlinks=True,
        ignore=shutil.ignore_patterns(".git", "tests", "bench", "build", "*.egg-info", "__pycache__", ".*cache"),
    )
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), "."],
        cwd=source,
        check=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("noetl_celery-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for playbook in PLAYBOOKS.glob("*.yaml"):
        assert f"noetl_celery/examples/{playbook.name}" in names, playbook.name


def test_register_and_the_catalog_list(tmp_path):
    """`register FILE` stores a playbook under its metadata.path; `catalog` lists it (text and JSON)."""
    from tests.support.engines import cli as run_cli
    from tests.test_server import HELLO

    env = {"NOETL_HOME": str(tmp_path / "home")}
    empty = run_cli(["catalog"], env)
    assert empty.returncode == 0 and "no playbooks registered" in empty.stdout, empty.stderr
    source = tmp_path / "hello.yaml"
    source.write_text(HELLO)
    registered = run_cli(["register", str(source)], env)
    assert registered.returncode == 0 and "registered tests/api_hello (api_hello)" in registered.stdout, (
        registered.stderr
    )
    listed = run_cli(["catalog"], env)
    assert listed.stdout.split()[:2] == ["tests/api_hello", "api_hello"] and str(source) in listed.stdout
    entries = json.loads(run_cli(["catalog", "--json"], env).stdout)["entries"]
    assert [(e["path"], e["name"], e["source_file"]) for e in entries] == [
        ("tests/api_hello", "api_hello", str(source))
    ]
    assert entries[0]["registered_at"]
