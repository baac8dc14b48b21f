"""The management command `noetl-celery`, run as a user runs it: a subprocess with a clean
environment (no NOETL_* variable but the ones a test gives), against real files and stores."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect, text

from tests.support.corpus import CORPUS, MISSING_REASON
from tests.support.engines import REPO_ROOT, _clean_env, cli

HELLO = REPO_ROOT / "playbooks" / "hello_world.yaml"
PROBLEM_LINE = re.compile(r"^(?P<file>.+?):(?P<line>\d+): (?P<path>\S+): (?P<message>.+)$")
WORKER_EXIT_TIMEOUT = 60  # seconds a worker without a broker may take to give up


def corpus_index() -> list[dict[str, str]]:
    """INDEX.tsv rows of the corpus (file, exercises, ...); empty when the corpus is absent."""
    index = CORPUS / "INDEX.tsv"
    if not index.exists():
        return []
    header, *lines = index.read_text(encoding="utf-8").splitlines()
    names = header.split("\t")
    return [dict(zip(names, line.split("\t"), strict=False)) for line in lines if line.strip()]


def broken_files(kind: str) -> list[str]:
    """Corpus `broken_*` files whose INDEX entry says the failure is a `kind` failure."""
    return [
        row["file"]
        for row in corpus_index()
        if Path(row["file"]).name.startswith("broken_") and row["exercises"].startswith(f"{kind} failure")
    ]


def home_env(tmp_path: Path) -> dict[str, str]:
    """An embedded deployment of this test's own: SQLite under a fresh NOETL_HOME."""
    return {"NOETL_HOME": str(tmp_path / "home")}


def store_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'home' / 'noetl.sqlite'}"


def last_key(path: str) -> str:
    """`workflow[1](insert_report).next.-step` -> `-step`: the key a problem is about."""
    return re.sub(r"\[\d+\]|\([^)]*\)", "", path).rsplit(".", 1)[-1]


# --------------------------------------------------------------------------- validate


@pytest.mark.skipif(not broken_files("validation"), reason=MISSING_REASON)
@pytest.mark.parametrize("name", broken_files("validation") or ["(none)"])
def test_validate_rejects_a_broken_corpus_playbook_naming_file_line_and_key(tmp_path, name):
    path = CORPUS / name
    proc = cli(["validate", str(path)], home_env(tmp_path))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == ""
    problems = [PROBLEM_LINE.match(line) for line in proc.stderr.splitlines()]
    assert problems and all(problems), proc.stderr
    lines = path.read_text(encoding="utf-8").splitlines()
    for problem in problems:
        assert problem["file"] == str(path)
        # the line named is the line of the offending key
        assert last_key(problem["path"]) in lines[int(problem["line"]) - 1], problem.group(0)


def test_validate_names_the_dash_step_typo_of_the_legacy_broken_playbook(tmp_path):
    path = CORPUS / "legacy-2025-12" / "broken_tool_is_required.yaml"
    if not path.exists():
        pytest.skip(f"corpus file {path} not present")
    proc = cli(["validate", str(path)], home_env(tmp_path))
    assert proc.returncode == 2
    assert (
        f"{path}:27: workflow[1](insert_report).next.-step: unknown key '-step'; did you mean 'step'?"
        in proc.stderr.splitlines()
    )


def test_validate_names_the_misplaced_command_of_the_v10_broken_playbook(tmp_path):
    path = CORPUS / "v10-2026-02" / "broken_tool_is_required.yaml"
    if not path.exists():
        pytest.skip(f"corpus file {path} not present")
    proc = cli(["validate", str(path)], home_env(tmp_path))
    assert proc.returncode == 2
    found = proc.stderr.splitlines()
    assert any(line.startswith(f"{path}:29: workflow[1](insert_report).command: ") for line in found), found
    assert any(
        line.startswith(f"{path}:26: workflow[1](insert_report).tool: postgres tool needs one of") for line in found
    ), found


@pytest.mark.skipif(not broken_files("runtime"), reason=MISSING_REASON)
@pytest.mark.parametrize("name", broken_files("runtime") or ["(none)"])
def test_a_playbook_that_only_fails_at_run_time_validates(tmp_path, name):
    proc = cli(["validate", str(CORPUS / name)], home_env(tmp_path))
    assert proc.returncode == 0, proc.stderr


def test_validate_accepts_a_good_playbook(tmp_path):
    proc = cli(["validate", str(HELLO)], home_env(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"{HELLO}: valid canonical playbook 'hello_world' with 4 steps"
    assert not (tmp_path / "home").exists()  # validating touches no store


def test_validate_of_a_missing_file_is_invalid(tmp_path):
    proc = cli(["validate", str(tmp_path / "nope.yaml")], home_env(tmp_path))
    assert proc.returncode == 2
    assert "nope.yaml" in proc.stderr


# --------------------------------------------------------------------------- compile


def test_compile_json_lists_steps_signatures_and_policies(tmp_path):
    path = CORPUS / "legacy-2025-12" / "retry_simple_config.yaml"
    if not path.exists():
        pytest.skip(f"corpus file {path} not present")
    proc = cli(["compile", "--json", str(path)], home_env(tmp_path))
    assert proc.returncode == 0, proc.stderr
    described = json.loads(proc.stdout)
    assert (described["dialect"], described["api_version"], described["entry_step"]) == (
        "legacy",
        "noetl.io/v1",
        "start",
    )
    assert described["on_event"] == {"task": "noetl.on_event", "queue": "noetl.events"}
    steps = {step["step"]: step for step in described["steps"]}
    assert list(steps) == ["start", "boolean_retry", "integer_retry", "full_config_retry", "end"]
    assert isinstance(steps["start"]["tasks"], str)  # routing only: decided inside on_event
    for name in ("boolean_retry", "integer_retry", "full_config_retry"):
        (task,) = steps[name]["tasks"]
        assert task["kind"] == "http"
        assert task["signature"]["task"] == "noetl.run_task"
        assert task["signature"]["queue"] == "noetl.tasks"
        assert task["policy"], name
    assert "'attempts': 3" in steps["boolean_retry"]["tasks"][0]["policy"][0]
    assert "'attempts': 5" in steps["integer_retry"]["tasks"][0]["policy"][0]
    full = steps["full_config_retry"]["tasks"][0]["policy"]
    assert full[0].startswith("when {{ status_code == 200 }}") and "'do': 'stop'" in full[0]
    assert "'multiplier': 2.0" in full[1] and "'jitter': True" in full[1]
    assert [arc["step"] for arc in steps["boolean_retry"]["next"]["arcs"]] == ["integer_retry"]
    (first_rule, *_) = described["plan"]["steps"]["integer_retry"]["tasks"][0]["policy"]["rules"]
    assert first_rule["then"]["attempts"] == 5


def test_compile_signatures_follow_the_configured_queues(tmp_path):
    env = {**home_env(tmp_path), "NOETL_TASK_QUEUE": "acme.tasks", "NOETL_EVENT_QUEUE": "acme.events"}
    proc = cli(["compile", "--json", str(HELLO)], env)
    assert proc.returncode == 0, proc.stderr
    described = json.loads(proc.stdout)
    assert described["on_event"]["queue"] == "acme.events"
    queues = {task["signature"]["queue"] for step in described["steps"] for task in step["tasks"]}
    assert queues == {"acme.tasks"}


def test_compile_text_shows_each_task_and_its_routing(tmp_path):
    proc = cli(["compile", str(REPO_ROOT / "playbooks" / "fan_out_join.yaml")], home_env(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("fan_out_join (canonical, noetl.io/v10), entry: start")
    assert "task total (python): noetl.run_task queue=noetl.tasks" in proc.stdout
    assert "next (inclusive) -> evens when {{ start.count > 0 }}" in proc.stdout
    assert "branches join at merge" in proc.stdout


# --------------------------------------------------------------------------- --set


SETS_PLAYBOOK = """\
apiVersion: noetl.io/v10
kind: Playbook
metadata: {name: sets}
workload:
  count: 1
  db: {host: db.local, port: 5432}
workflow:
  - step: start
"""


def test_set_values_are_yaml_scalars_and_dotted_keys_nest(tmp_path):
    playbook = tmp_path / "sets.yaml"
    playbook.write_text(SETS_PLAYBOOK)
    sets = [
        "count=3",
        "ratio=0.25",
        "flag=true",
        "name=hello world",
        "ids=[1, 2]",
        "empty=",
        "db.port=6543",
        "deep.a.b=x",
    ]
    args = ["compile", "--json", str(playbook)]
    for item in sets:
        args += ["--set", item]
    proc = cli(args, home_env(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["plan"]["workload"] == {
        "count": 3,
        "ratio": 0.25,
        "flag": True,
        "name": "hello world",
        "ids": [1, 2],
        "empty": "",
        "db": {"host": "db.local", "port": 6543},  # merged into the playbook's mapping
        "deep": {"a": {"b": "x"}},
    }


def test_a_set_without_equals_sign_is_an_argument_error(tmp_path):
    proc = cli(["compile", str(HELLO), "--set", "count"], home_env(tmp_path))
    assert proc.returncode == 2
    assert "--set" in proc.stderr and "key=value" in proc.stderr


# --------------------------------------------------------------------------- submit, status, events


def test_submit_without_a_broker_is_refused_and_writes_nothing(tmp_path):
    proc = cli(["submit", str(HELLO)], home_env(tmp_path))
    assert proc.returncode == 2
    assert "NOETL_BROKER_URL" in proc.stderr
    assert proc.stdout == ""
    database = tmp_path / "home" / "noetl.sqlite"
    if database.exists():  # nothing enqueued and no execution row
        engine = create_engine(store_url(tmp_path))
        try:
            if "noetl_execution" in inspect(engine).get_table_names():
                with engine.connect() as conn:
                    assert conn.execute(text("SELECT count(*) FROM noetl_execution")).scalar() == 0
        finally:
            engine.dispose()


@pytest.mark.parametrize("command", ["status", "events"])
def test_status_and_events_of_an_unknown_execution_are_invalid(tmp_path, command):
    proc = cli([command, "12345"], home_env(tmp_path))
    assert proc.returncode == 2
    assert "no execution 12345" in proc.stderr


@pytest.mark.parametrize("command", ["status", "events"])
def test_status_and_events_need_a_numeric_id(tmp_path, command):
    proc = cli([command, "abc"], home_env(tmp_path))
    assert proc.returncode == 2


@pytest.fixture(scope="module")
def hello_run(tmp_path_factory):
    """`noetl-celery run --json playbooks/hello_world.yaml` in a NOETL_HOME of this module."""
    tmp = tmp_path_factory.mktemp("cli-run")
    env = home_env(tmp)
    proc = cli(["run", "--json", "--timeout", "120", str(HELLO)], env)
    return tmp, env, proc


def test_run_json_completes_the_demo_in_the_embedded_store(hello_run):
    tmp, _, proc = hello_run
    assert proc.returncode == 0, proc.stderr
    outcome = json.loads(proc.stdout)
    assert {"execution_id", "status", "error", "results"} <= set(outcome)
    assert outcome["status"] == "completed" and outcome["error"] is None
    assert outcome["results"]["end"] == {"greeting": "HELLO WORLD FROM NOETL_CELERY", "branch": "long"}
    assert (tmp / "home" / "noetl.sqlite").exists()


def test_status_json_reads_the_same_store(hello_run):
    _, env, proc = hello_run
    outcome = json.loads(proc.stdout)
    status = cli(["status", "--json", str(outcome["execution_id"])], env)
    assert status.returncode == 0, status.stderr
    read_back = json.loads(status.stdout)
    for key in ("execution_id", "playbook", "status", "error", "results"):
        assert read_back[key] == outcome[key], key
    text_status = cli(["status", str(outcome["execution_id"])], env)
    assert text_status.returncode == 0
    assert text_status.stdout.startswith(f"execution {outcome['execution_id']} (hello_world): completed")


def test_events_json_is_the_execution_log_in_order(hello_run):
    _, env, proc = hello_run
    execution_id = json.loads(proc.stdout)["execution_id"]
    events = cli(["events", "--json", str(execution_id)], env)
    assert events.returncode == 0, events.stderr
    rows = json.loads(events.stdout)
    assert {row["execution_id"] for row in rows} == {execution_id}
    assert rows[0]["event_type"] == "execution.started" and rows[-1]["event_type"] == "execution.completed"
    assert [r["step"] for r in rows if r["event_type"] == "step.started"] == ["start", "long_greeting", "end"]
    ids = [row["id"] for row in rows]
    assert ids == sorted(ids) and len({row["event_id"] for row in rows}) == len(rows)
    table = cli(["events", str(execution_id)], env)
    assert table.returncode == 0
    header, *lines = table.stdout.splitlines()
    assert header.split()[:5] == ["#", "time", "event", "step", "task"]
    event_lines = [line for line in lines if line.split()[0].isdigit()]
    assert len(event_lines) == len(rows)
    # under its row, what the attempt printed
    assert [line for line in lines if line not in event_lines] == [
        "      stdout| HELLO_WORLD: Hello World from noetl_celery"
    ]
    listing = cli(["executions"], env)
    assert listing.returncode == 0 and listing.stdout.split()[:3] == [str(execution_id), "completed", "hello_world"]


def test_run_exits_1_when_the_execution_fails(tmp_path):
    playbook = tmp_path / "fails.yaml"
    playbook.write_text(
        "apiVersion: noetl.io/v10\nkind: Playbook\nmetadata: {name: fails}\nworkflow:\n"
        "  - step: start\n    tool: {kind: python, code: \"raise RuntimeError('no')\"}\n"
    )
    proc = cli(["run", "--json", "--timeout", "120", str(playbook)], home_env(tmp_path))
    assert proc.returncode == 1, proc.stderr
    outcome = json.loads(proc.stdout)
    assert (outcome["status"], outcome["failed_step"]) == ("failed", "start")
    assert "RuntimeError: no" in outcome["error"]["message"]


def test_run_of_an_invalid_playbook_exits_2_before_anything_runs(tmp_path):
    playbook = tmp_path / "bad.yaml"
    playbook.write_text(
        "apiVersion: noetl.io/v10\nkind: Playbook\nmetadata: {name: bad}\nworkflow:\n  - step: start\n    nxt: start\n"
    )
    proc = cli(["run", str(playbook)], {**home_env(tmp_path), "NOETL_STRICT_TEMPLATES": "1"})
    assert proc.returncode == 2
    assert f"{playbook}:6: workflow[0](start).nxt: unknown key 'nxt'; did you mean 'next'?" in proc.stderr
    assert not (tmp_path / "home" / "noetl.sqlite").exists()


def test_run_warns_of_an_unknown_key_and_runs_without_it(tmp_path):
    playbook = tmp_path / "extra.yaml"
    playbook.write_text(
        "apiVersion: noetl.io/v10\nkind: Playbook\nmetadata: {name: extra, owner: me}\nworkflow:\n"
        "  - step: start\n    nxt: start\n"
    )
    proc = cli(["run", str(playbook)], home_env(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert f"{playbook}:3: metadata.owner: warning: unknown key 'owner'" in proc.stderr
    assert f"{playbook}:6: workflow[0](start).nxt: warning: unknown key 'nxt'; did you mean 'next'?" in proc.stderr
    assert "execution" in proc.stdout and "completed" in proc.stdout


# --------------------------------------------------------------------------- worker


def test_a_worker_without_a_broker_exits_and_says_to_set_noetl_broker_url(tmp_path):
    env = _clean_env({"NOETL_HOME": str(tmp_path / "home"), "PYTHONUNBUFFERED": "1"})
    assert not any(k.startswith("NOETL_") and not k.startswith("NOETL_TEST_") and k != "NOETL_HOME" for k in env)
    started = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "noetl_celery",
            "worker",
            "-Q",
            "noetl.tasks,noetl.events",
            "-l",
            "INFO",
            "--pool",
            "solo",
        ],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=WORKER_EXIT_TIMEOUT,
        check=False,
    )
    assert proc.returncode != 0
    assert time.monotonic() - started < WORKER_EXIT_TIMEOUT
    assert "set NOETL_BROKER_URL" in proc.stdout + proc.stderr


SLOW_LOOP = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: slow_loop}
workload: {n: 24}
workflow:
  - step: start
    loop:
      in: "{{ range(n) | list }}"
      iterator: i
      spec: {mode: parallel, max_in_flight: 2}
    tool: {kind: python, args: {i: "{{ iter.i }}"}, code: "import time\\ntime.sleep(0.15)\\nresult = i"}
"""


def test_run_on_a_terminal_redraws_a_progress_block_with_a_bar_per_running_loop(tmp_path):
    import os
    import pty

    playbook = tmp_path / "slow_loop.yaml"
    playbook.write_text(SLOW_LOOP)
    parent, child = pty.openpty()  # stderr is a terminal; stdout stays a pipe
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "noetl_celery.cli", "run", str(playbook)],
            env=_clean_env(home_env(tmp_path)),
            stdout=subprocess.PIPE,
            stderr=child,
            cwd=REPO_ROOT,
        )
        os.close(child)
        chunks = []
        while True:
            try:
                data = os.read(parent, 65536)
            except OSError:  # the other end closed: the command has exited
                break
            if not data:
                break
            chunks.append(data)
        stdout, _ = proc.communicate(timeout=120)
    finally:
        os.close(parent)
    screen = b"".join(chunks).decode()
    assert proc.returncode == 0, screen
    assert "completed" in stdout.decode()
    assert "\x1b[" in screen and "F\x1b[J" in screen  # the block is redrawn in place
    bars = re.findall(r"start\s+\[([#.]{30})\] (\d+)/24", screen)
    assert bars, screen
    counts = [int(done) for _, done in bars]
    assert counts == sorted(counts) and counts[0] < 24  # seen while running, rising
    assert re.search(r"steps \d+/1 done, \d+/\d+ units", screen)
