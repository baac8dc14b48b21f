"""Keys NoETL defines are read, keys it ignores are accepted, unknown keys are warnings (issue 39).

Each form is compiled and run on the in-process harness (SQLite, the mock API over loopback).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from noetl_celery.core.errors import PlaybookError, Problem
from noetl_celery.dsl import load_plan
from noetl_celery.store import db
from tests.support.harness import run_playbook
from tests.support.mockapi import start_mock_api

HEAD = "apiVersion: noetl.io/v2\nkind: Playbook\n"


def write(tmp_path: Path, body: str, name: str = "pb.yaml") -> Path:
    path = tmp_path / name
    path.write_text(HEAD + textwrap.dedent(body))
    return path


def store(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'events.sqlite'}"
    db.migrate(url)
    return url


def warnings_of(path: Path) -> list[str]:
    found: list[Problem] = []
    load_plan(path, warnings=found)
    return [f"{p.line}: {p.path}: {p.message}" for p in found]


NOETL_KEYS = """\
    metadata:
      name: noetl_keys
      agent: true
      exposed_in_ui: true
      exposes_as_mcp: false
      capabilities: [http]
      terminal: {{}}
    auth: {{api: {{type: bearer, credential: api_token}}}}
    executor:
      kind: distributed
      spec: {{pool: workers-a}}
    workload: {{api_url: "{url}"}}
    workflow:
      - step: start
        tool:
          kind: http
          url: "{{{{ workload.api_url }}}}/api/v1/errors"
          params: {{error_type: timeout, delay: {delay}}}
          timeout_seconds: {seconds}
          sink: true
        next: [{{step: end}}]
      - step: end
"""


def test_noetl_defined_keys_validate_without_a_warning(tmp_path) -> None:
    path = write(tmp_path, NOETL_KEYS.format(url="http://127.0.0.1:1", delay=0, seconds=5))
    assert warnings_of(path) == []
    plan = load_plan(path)
    task = plan.steps["start"].tasks[0]
    assert task.config["timeout"] == 5 and "timeout_seconds" not in task.config
    assert task.hints == {"sink": True}


def test_http_timeout_seconds_bounds_the_request(tmp_path) -> None:
    url = store(tmp_path)
    with start_mock_api() as api:
        slow = write(tmp_path, NOETL_KEYS.format(url=api.url, delay=3, seconds=1), "slow.yaml")
        code, status = run_playbook(url, slow)
        assert code != 0 and "timed out after 1s" in str(status["error"]), status
        quick = write(tmp_path, NOETL_KEYS.format(url=api.url, delay=0.1, seconds=5), "quick.yaml")
        code, status = run_playbook(url, quick)
        assert code == 0, status


SPEC_TIMEOUT = """\
    metadata: {{name: spec_timeout}}
    workload: {{api_url: "{url}"}}
    workflow:
      - step: start
        tool:
          kind: http
          url: "{{{{ workload.api_url }}}}/api/v1/errors"
          params: {{error_type: timeout, delay: {delay}}}
          spec:
            timeout: {{connect: 1, read: {read}}}
"""


def test_task_spec_timeout_mapping_is_connect_and_read(tmp_path) -> None:
    plan = load_plan(write(tmp_path, SPEC_TIMEOUT.format(url="http://x", delay=0, read=2)))
    config = plan.steps["start"].tasks[0].config
    assert (config["timeout"], config["connect_timeout"]) == (3.0, 1.0)
    url = store(tmp_path)
    with start_mock_api() as api:
        code, status = run_playbook(url, write(tmp_path, SPEC_TIMEOUT.format(url=api.url, delay=4, read=1), "s.yaml"))
        assert code != 0 and "timed out after 2s" in str(status["error"]), status
        code, status = run_playbook(url, write(tmp_path, SPEC_TIMEOUT.format(url=api.url, delay=0.1, read=5), "q.yaml"))
        assert code == 0, status


@pytest.mark.parametrize(
    "timeout, message",
    [
        ("{connect: 1, wait: 2}", "a timeout mapping has connect and read (seconds), not wait"),
        ("{connect: -1}", "must be a positive number of seconds, not -1"),
        ("{}", "a timeout mapping needs connect or read (seconds)"),
    ],
)
def test_a_wrong_timeout_mapping_is_refused(tmp_path, timeout, message) -> None:
    body = f"""\
        metadata: {{name: t}}
        workflow:
          - step: start
            tool: {{kind: http, url: "http://x", spec: {{timeout: {timeout}}}}}
        """
    with pytest.raises(PlaybookError) as raised:
        load_plan(write(tmp_path, body))
    assert any(message in p.message for p in raised.value.problems), raised.value.problems


def test_timeout_and_timeout_seconds_together_are_refused(tmp_path) -> None:
    body = """\
        metadata: {name: t}
        workflow:
          - step: start
            tool: {kind: http, url: "http://x", timeout: 3, timeout_seconds: 4}
        """
    with pytest.raises(PlaybookError, match="give the timeout once"):
        load_plan(write(tmp_path, body))


UNKNOWN = """\
    metadata: {name: unknown_keys, owner: data-team}
    workflow:
      - step: start
        tool: {kind: python, code: "def main():\\n    return {'n': 1}", retries_hint: 3}
        colour: blue
        next: [{step: end, weight: 2}]
      - step: end
"""


def test_unknown_keys_are_warnings_with_line_and_the_run_ignores_them(tmp_path) -> None:
    path = write(tmp_path, UNKNOWN)
    assert warnings_of(path) == [
        "3: metadata.owner: unknown key 'owner'",
        "6: workflow[0](start).tool.retries_hint: unknown key 'retries_hint' for the python tool",
        "7: workflow[0](start).colour: unknown key 'colour'",
        "8: workflow[0](start).next[0].weight: unknown key 'weight'",
    ]
    code, status = run_playbook(store(tmp_path), path)
    assert code == 0, status
    assert status["results"]["start"] == {"n": 1}
    assert "retries_hint" not in load_plan(path).steps["start"].tasks[0].config


@pytest.mark.parametrize("strict", ["env", "playbook"])
def test_unknown_keys_are_problems_when_strict(tmp_path, monkeypatch, strict) -> None:
    body = UNKNOWN
    if strict == "env":
        monkeypatch.setenv("NOETL_STRICT_TEMPLATES", "1")
    else:
        body = UNKNOWN.replace("    workflow:", "    executor: {spec: {strict_templates: true}}\n    workflow:", 1)
    with pytest.raises(PlaybookError) as raised:
        load_plan(write(tmp_path, body))
    assert {p.path.rsplit(".", 1)[-1] for p in raised.value.problems} == {"owner", "retries_hint", "colour", "weight"}


def test_an_unknown_key_where_a_needed_key_is_missing_is_refused(tmp_path) -> None:
    body = """\
        metadata: {name: t}
        workflow:
          - step: start
            next: [{stp: end}]
          - step: end
        """
    with pytest.raises(PlaybookError) as raised:
        load_plan(write(tmp_path, body))
    assert [(p.line, p.path, p.message) for p in raised.value.problems] == [
        (6, "workflow[0](start).next[0].stp", "unknown key 'stp'; did you mean 'step'?")
    ]


CASE_ELSE = """\
    metadata: {name: case_else}
    workload: {n: 1}
    workflow:
      - step: start
        tool: {kind: python, code: "def main(n):\\n    return {'n': n}", args: {n: "{{ workload.n }}"}}
        case:
          - when: "{{ event.name == 'call.done' and result.n > 5 }}"
            then: {next: [{step: big}]}
          - else:
              then: {next: [{step: small}]}
      - step: big
        tool: {kind: python, code: "def main():\\n    return 'big'"}
      - step: small
        tool: {kind: python, code: "def main():\\n    return 'small'"}
"""


@pytest.mark.parametrize("n, taken, skipped", [(1, "small", "big"), (9, "big", "small")])
def test_case_else_routes_when_no_other_entry_does(tmp_path, n, taken, skipped) -> None:
    path = write(tmp_path, CASE_ELSE)
    assert warnings_of(path) == []
    code, status = run_playbook(store(tmp_path), path, {"n": n})
    assert code == 0, status
    assert status["results"][taken] == taken and skipped not in status["results"]


def test_case_else_must_be_the_last_entry(tmp_path) -> None:
    body = CASE_ELSE.replace("          - else:\n              then: {next: [{step: small}]}\n", "").replace(
        "        case:\n",
        "        case:\n          - else: {next: [{step: small}]}\n",
    )
    with pytest.raises(PlaybookError, match="a case else must be the last entry"):
        load_plan(write(tmp_path, body))


def test_step_level_sink_true_is_an_advisory_hint(tmp_path) -> None:
    body = """\
        metadata: {name: t}
        workflow:
          - step: start
            sink: true
            tool: {kind: python, code: "def main():\\n    return 1"}
        """
    path = write(tmp_path, body)
    assert warnings_of(path) == []
    step = load_plan(path).steps["start"]
    assert step.result_hints == {"sink": True} and step.tasks[0].sink is None


def test_validate_strict_refuses_an_unknown_key(tmp_path) -> None:
    from click.testing import CliRunner

    from noetl_celery.cli import cli

    path = write(tmp_path, UNKNOWN)
    default = CliRunner().invoke(cli, ["validate", str(path)])
    assert default.exit_code == 0 and "warning: unknown key 'owner'" in default.output
    strict = CliRunner().invoke(cli, ["validate", "--strict", str(path)])
    assert strict.exit_code == 2 and f"{path}:3: metadata.owner: unknown key 'owner'" in strict.output


NAMED_SET = """\
    metadata: {name: named_set}
    workflow:
      - step: start
        tool: {kind: python, code: "def main():\\n    return {'email': 'a@b.c'}"}
        case:
          - when: "{{ event.name == 'call.done' }}"
            then:
              set:
                - name: user_email
                  value: "{{ result.email }}"
              next: [{step: use}]
      - step: use
        tool: {kind: python, code: "def main(email):\\n    return email", args: {email: "{{ vars.user_email }}"}}
"""


def test_case_set_as_a_list_of_name_and_value_assigns_vars(tmp_path) -> None:
    path = write(tmp_path, NAMED_SET)
    assert warnings_of(path) == []
    code, status = run_playbook(store(tmp_path), path)
    assert code == 0, status
    assert status["results"]["use"] == "a@b.c"
