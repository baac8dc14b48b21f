"""Hostile and oversized input: bounded parsing, rendering and results; secrets masked in every form.

In-process checks of the compiler, the templates, the http and python tools and the secret
registry, plus the command line in a subprocess (one line and exit 2 for bad input and for an
unusable store or broker). The end-to-end canary with real workers is in
tests/distributed/test_secret_canary.py.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from urllib.parse import quote

import pytest

from noetl_celery.compiler import compile_playbook
from noetl_celery.config import credentials, limits, secret_registry
from noetl_celery.core.errors import PlaybookError, TemplateError
from noetl_celery.engine.attempt.worker import bounded
from noetl_celery.templates.render import evaluate_condition, render_string, render_value
from noetl_celery.tools.base import Outcome, ToolCall, get_tool
from tests.support.hostile_http import hostile_server

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_http(call: ToolCall) -> Outcome:
    return get_tool("http").run(call)  # through the registry, which loads every built-in tool


def run_python(call: ToolCall) -> Outcome:
    return get_tool("python").run(call)


CANARY = "Tok/rel+0042==#@%canary"
BOMB = """apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: bomb}
a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]
workflow: [{step: start, next: [{step: end}]}, {step: end}]
"""
POWER_BOMB = "{{ (9 ** (9 ** 9)) > 1 }}"
REPEAT_BOMB = "{{ ('x' * (10 ** 10)) | length }}"
BOMB_REFUSED_WITHIN = 1.0  # seconds: the limit is a guard against a denial of service, not a speed figure


def cli(args: list[str], env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("NOETL_")}
    clean.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "noetl_celery.cli", *args],
        env=clean,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO_ROOT,
    )


@pytest.fixture
def canary_env(monkeypatch, tmp_path):
    """A bearer-token credential and a DSN credential holding characters that need quoting."""
    monkeypatch.setenv("NOETL_AUTH_CANARY", json.dumps({"type": "bearer", "token": CANARY}))
    monkeypatch.setenv("NOETL_AUTH_CANARY_DSN", "postgresql://app:Pw#rel-777/x@%25y@127.0.0.1:5432/db")
    yield
    for name in ("NOETL_AUTH_CANARY", "NOETL_AUTH_CANARY_DSN"):
        secret_registry._sealed.pop(name, None)


# ------------------------------------------------------------------ bounded parsing


def test_alias_bomb_is_refused_at_once_with_its_line(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB)
    assert len(BOMB.encode()) < 500
    started = time.monotonic()
    with pytest.raises(PlaybookError) as info:
        compile_playbook(path)
    elapsed = time.monotonic() - started
    (problem,) = info.value.problems
    assert problem.line == 9  # `f:` (9 ** 6 nodes), the first node whose expansion passes the limit
    assert "NOETL_MAX_YAML_NODES" in problem.message
    assert str(problem).startswith(f"{path}:9: ")
    assert elapsed < BOMB_REFUSED_WITHIN, f"refusing the bomb took {elapsed:.2f} s"


def test_alias_bomb_from_the_command_line(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB)
    proc = cli(["validate", str(path)])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"{path}:9: YAML expands to more than {limits.DEFAULT_MAX_YAML_NODES} nodes here (aliases of "
        "aliases?); refused (NOETL_MAX_YAML_NODES)"
    ]


def test_a_playbook_past_the_size_limit_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("NOETL_MAX_PLAYBOOK_BYTES", "100")
    path = tmp_path / "big.yaml"
    path.write_text("metadata: {name: big}\n" + "# padding\n" * 20)
    with pytest.raises(PlaybookError) as info:
        compile_playbook(path)
    assert "more than the limit of 100 bytes (NOETL_MAX_PLAYBOOK_BYTES)" in str(info.value)


def test_non_utf8_playbook_gets_one_line_and_exit_2(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"apiVersion: noetl.io/v2\nkind: Playbook\nmetadata: {name: caf\xe9}\n")
    proc = cli(["validate", str(path)])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"{path}:3: the playbook is not UTF-8 text: byte 0xe9 at column 21; save it as UTF-8"
    ]
    assert "Traceback" not in proc.stderr + proc.stdout


@pytest.mark.parametrize("name", ["workload", "ctx", "vars", "iter", "result", "execution_id"])
def test_step_names_that_shadow_template_names_are_refused(tmp_path, name):
    text = f"""apiVersion: noetl.io/v2
kind: Playbook
metadata: {{name: shadow}}
workflow:
  - step: start
    tool: {{kind: python, code: "result = 1"}}
    next: [{{step: {name}}}]
  - step: {name}
    tool: {{kind: python, code: "result = 2"}}
"""
    with pytest.raises(PlaybookError) as info:
        compile_playbook(tmp_path / "shadow.yaml", text=text)
    messages = [str(p) for p in info.value.problems]
    assert any(
        f":8: workflow[1]({name}).step: step name '{name}' is a built-in template name" in m
        and f"rename the step, e.g. '{name}_step'" in m
        for m in messages
    ), messages


# ------------------------------------------------------------------ bounded rendering


@pytest.mark.parametrize(
    "template",
    [
        POWER_BOMB,
        REPEAT_BOMB,
        "{{ ['x'] * (10 ** 9) }}",
        "{{ 'x' | center(10 ** 9) }}",
        "{{ 'x'.rjust(10 ** 9) }}",
        "{{ '%999999999d' % 1 }}",
        "{{ '{:>999999999}'.format(1) }}",
        "{{ lipsum(10 ** 7) }}",
        "{{ [1] | batch(10 ** 9, 0) | list }}",
    ],
)
def test_size_bombs_fail_as_template_errors(template):
    with pytest.raises(TemplateError) as info:
        render_value({"args": {"n": template}}, {})
    assert "more than the template limit of" in str(info.value)


@pytest.mark.parametrize(
    ("template", "named"),
    [
        ("{{ '{0:>{1}}'.format('x', 50000000) | length }}", "NOETL_TEMPLATE_MAX_BYTES"),
        ("{{ '{0:{w}}'.format('x', w=2 ** 34) | length }}", "NOETL_TEMPLATE_MAX_BYTES"),
        ("{{ '{0:.{1}f}'.format(1.5, 50000000) | length }}", "NOETL_TEMPLATE_MAX_BYTES"),
        ("{{ '{x:>{w}}'.format_map({'x': 'y', 'w': 50000000}) | length }}", "NOETL_TEMPLATE_MAX_BYTES"),
        ("{{ ('%*s' % (50000000, 'x')) | length }}", "NOETL_TEMPLATE_MAX_BYTES"),
        ("{{ ('%.*f' % (50000000, 1.0)) | length }}", "NOETL_TEMPLATE_MAX_BYTES"),
        ("{{ '%*s' | format(50000000, 'x') | length }}", "NOETL_TEMPLATE_MAX_BYTES"),
        ("{{ (range(100000) | list + range(100000) | list) | length }}", "NOETL_TEMPLATE_MAX_BYTES"),
        ("{{ ('x' * 600000 + 'y' * 600000) | length }}", "NOETL_TEMPLATE_MAX_BYTES"),
        ("{{ ((['x' * 900000] * 50) | join) | length }}", "NOETL_TEMPLATE_MAX_BYTES"),
        ("{{ (([{'a': 'x' * 900000}] * 50) | join(',', attribute='a')) | length }}", "NOETL_TEMPLATE_MAX_BYTES"),
        ("{{ (([range(100000) | list] * 50) | sum(start=[])) | length }}", "NOETL_TEMPLATE_MAX_BYTES"),
        ("{{ (('x' * 900000) ~ ('y' * 900000)) | length }}", "NOETL_TEMPLATE_MAX_BYTES"),
        ("{{ ((7 ** 2000000) // (5 ** 1000000)) > 0 }}", "100000 bits"),
        ("{{ ((7 ** 30000) * (7 ** 30000)) > 0 }}", "100000 bits"),
    ],
)
def test_bounds_templates_used_to_bypass_fail_at_once(template, named):
    started = time.monotonic()
    with pytest.raises(TemplateError) as info:
        render_string(template, {})
    assert named in str(info.value) and "more than the template limit" in str(info.value)
    assert time.monotonic() - started < BOMB_REFUSED_WITHIN


def test_a_loop_of_doubling_text_stops_at_the_size_limit():
    grow = "{% set ns = namespace(s='x' * 1000) %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}"
    with pytest.raises(TemplateError, match="concatenating with ~ would build about 1.02e\\+06 bytes"):
        render_string(grow, {})


def test_a_loop_of_concatenations_stops_at_the_size_limit():
    grow = "{% set ns = namespace(xs=[]) %}{% for i in range(50) %}{% set ns.xs = ns.xs + range(100000) | list %}{% endfor %}{{ ns.xs | length }}"
    with pytest.raises(TemplateError, match="concatenating would build about 1.6e\\+06 bytes"):
        render_string(grow, {})


@pytest.mark.parametrize("template", [POWER_BOMB, REPEAT_BOMB])
def test_size_bombs_in_when_fail_as_template_errors(template):
    with pytest.raises(TemplateError):
        evaluate_condition(template, {})


def test_a_looping_template_stops_at_its_time_budget(monkeypatch):
    monkeypatch.setenv("NOETL_TEMPLATE_TIMEOUT", "0.5")
    loops = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}done"
    with pytest.raises(TemplateError) as info:
        render_string(loops, {})
    assert "longer than 0.5 s (NOETL_TEMPLATE_TIMEOUT)" in str(info.value)


def test_ordinary_templates_are_unchanged():
    assert render_string("{{ 2 ** 10 }}", {}) == 1024
    assert render_string("{{ 'ab' * 3 }}", {}) == "ababab"
    assert render_string("{{ '%05d' % 42 }}", {}) == "00042"
    assert render_string("{{ '{:>4}'.format('x') }}", {}) == "   x"
    assert render_string("{{ [1, 2, 3] | batch(2) | list }}", {}) == [[1, 2], [3]]
    assert render_string("{% for i in range(3) %}{{ i }}{% endfor %}", {}) == "012"
    assert render_string("order 123456789012 {{ '%s' % n }}", {"n": 7}) == "order 123456789012 7"
    assert render_string("{{ '{0:>{1}}'.format('x', 4) }}", {}) == "   x"
    assert render_string("{{ '%*s|%.*f' % (3, 'x', 2, 1.5) }}", {}) == "  x|1.50"
    assert render_string("{{ '%*d' | format(4, 7) }}", {}) == "   7"
    assert render_string("{{ [1, 2] + [3] }}", {}) == [1, 2, 3]
    assert render_string("{{ 'ab' + 'c' }}", {}) == "abc"
    assert render_string("{{ 1 + 2.5 }}", {}) == 3.5
    assert render_string("{{ (2 ** 64) // 3 }}", {}) == 2**64 // 3
    assert render_string("{{ 7 / 2 }}", {}) == 3.5
    assert render_string("{{ 'a' ~ 1 ~ [2] }}", {}) == "a1[2]"
    assert render_string("x{{ 'a' ~ 'b' }}y", {}) == "xaby"
    assert render_string("{{ [{'v': 'a'}, {'v': 'b'}] | join('-', attribute='v') }}", {}) == "a-b"
    assert render_string("{{ [[1], [2]] | sum(start=[]) }}", {}) == [1, 2]
    assert render_string("{{ [{'v': 1}, {'v': 2}] | sum(attribute='v') }}", {}) == 3


@pytest.mark.parametrize(
    "escape",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ cycler.__init__.__globals__ }}",
        "{{ lipsum.__globals__ }}",
        "{{ ''|attr('__class__') }}",
        "{{ range(10 ** 8) | length }}",
        "{{ joiner.__init__.__globals__ }}",
    ],
)
def test_sandbox_escapes_stay_blocked(escape):
    with pytest.raises(TemplateError):
        render_string(escape, {})


# ------------------------------------------------------------------ bounded results


def test_a_100mb_response_is_streamed_capped_and_hashed():
    with hostile_server() as base:
        tracemalloc.start()
        try:
            outcome = run_http(ToolCall(kind="http", config={"url": f"{base}/big?mb=100"}))
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert outcome.status == "ok"
    body = outcome.data["data"]
    assert limits.is_truncated(body)
    assert body["size"] >= 100 * 1024 * 1024 - 1024
    assert len(body["sha256"]) == 64 and len(body["preview"]) <= limits.PREVIEW_CHARS
    assert peak < 16 * 1024 * 1024, f"peak memory {peak / 1e6:.1f} MB while reading a 100 MB body"
    stored = bounded(outcome.to_dict())
    assert len(json.dumps(stored)) < limits.DEFAULT_MAX_RESULT_BYTES


BIG_BODY = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: big_body}
workload: {url: ""}
workflow:
  - step: start
    tool: {kind: http, url: "{{ url }}"}
    next: {arcs: [{step: after}]}
  - step: after
    tool:
      kind: python
      args: {body: "{{ start.data }}"}
      code: "result = {'truncated': body.get('__truncated__'), 'size': body.get('size')}"
"""


def test_a_big_response_run_by_the_engine_is_stored_as_a_marker_and_the_store_stays_small(tmp_path):
    from tests.support.engines import cli

    playbook = tmp_path / "big_body.yaml"
    playbook.write_text(BIG_BODY)
    home = tmp_path / "home"
    with hostile_server() as base:
        proc = cli(["run", str(playbook), "--json", "--set", f"url={base}/big?mb=30"], {"NOETL_HOME": str(home)})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    # the next step sees the marker: the full size, not the body
    assert out["results"]["after"]["truncated"] is True
    assert out["results"]["after"]["size"] >= 30 * 1024 * 1024 - 1024
    store = home / "noetl.sqlite"
    sizes = sum(p.stat().st_size for p in home.iterdir() if p.name.startswith("noetl.sqlite"))
    assert store.exists() and sizes < 5 * 1024 * 1024, f"store of {sizes / 1e6:.1f} MB after a 30 MB body"


def test_a_loop_over_a_truncated_result_fails_its_step_instead_of_iterating_the_marker(tmp_path):
    from tests.support.engines import cli

    playbook = REPO_ROOT / "tests" / "playbooks" / "loop_many.yaml"
    # list(range(300000)) is 2.3 MB of JSON: above the row cap it is stored by reference, unless it
    # is above NOETL_MAX_STORED_BYTES too: then it is truncated, and cannot be looped over
    env = {"NOETL_HOME": str(tmp_path / "home"), "NOETL_MAX_STORED_BYTES": "2000000"}
    proc = cli(["run", str(playbook), "--json", "--set", "n=300000"], env)
    assert proc.returncode == 1, proc.stderr
    out = json.loads(proc.stdout)
    assert out["status"] == "failed" and out["failed_step"] == "work"
    assert limits.is_truncated(out["results"]["start"])
    assert out["error"]["kind"] == "loop"
    assert "loop collection of step 'work' is a value that was truncated when stored" in out["error"]["message"]
    assert "NOETL_MAX_RESULT_BYTES" in out["error"]["message"]
    assert "NOETL_MAX_STORED_BYTES" in out["error"]["message"]
    assert "work" not in out["results"]  # no iteration ran over the marker's keys


def test_results_and_errors_past_the_cap_are_stored_as_markers():
    big = {"rows": ["y" * 1000] * 2000}
    body = bounded(
        {
            "status": "error",
            "data": big,
            "meta": {"stdout": "z" * 2_000_000},
            "error": {"kind": "exception", "message": "m", "retryable": False, "detail": big},
        }
    )
    assert limits.is_truncated(body["data"]) and body["data"]["size"] > limits.DEFAULT_MAX_RESULT_BYTES
    assert limits.is_truncated(body["meta"]["stdout"])
    assert body["error"]["kind"] == "exception" and limits.is_truncated(body["error"]["detail"])
    with pytest.raises(TemplateError) as info:
        render_string("{{ start.rows[0] }}", {"start": body["data"]})
    assert "truncated when stored" in str(info.value) and "sink" in str(info.value)


# ------------------------------------------------------------------ secrets


def test_every_form_of_a_secret_is_masked(canary_env):
    token_forms = [CANARY, quote(CANARY, safe=""), json.dumps(CANARY)[1:-1]]
    for text in token_forms:
        assert CANARY not in secret_registry.mask_text(f"before {text} after")
        assert secret_registry.mask_text(f"before {text} after") == "before *** after"
    for prefix in ("", "a", "ab", "abc"):
        encoded = base64.b64encode(f"{prefix}{CANARY}tail".encode()).decode()
        masked = secret_registry.mask_text(encoded)
        assert "***" in masked and base64.b64encode(CANARY.encode()).decode()[4:12] not in masked
    # the DSN's password holds '#', '/', '@' and '%'
    assert (
        secret_registry.mask_text('could not translate host name "Pw#rel-777/x@%25y@127.0.0.1"')
        == 'could not translate host name "***@127.0.0.1"'
    )
    assert secret_registry.mask_text("password Pw#rel-777/x@%y") == "password ***"


def test_dsn_passwords_are_parsed_whatever_they_hold():
    assert "Pw#rel-777" in credentials.secret_values("postgresql://u:Pw#rel-777@h:5432/db")
    assert "a/b@c" in credentials.secret_values("postgresql://u:a%2Fb%40c@h/db")
    assert "p@ss/w" in credentials.secret_values("postgresql://u:p@ss/w@h/db")
    assert "s3 cr#t" in credentials.secret_values("host=h user=u password='s3 cr#t' dbname=d")


def test_registered_values_are_masked_too():
    secret_registry.register("registered-value-4711")
    assert secret_registry.mask({"k": ["x registered-value-4711 y"]}) == {"k": ["x *** y"]}


def test_python_code_cannot_read_credential_variables(canary_env):
    outcome = run_python(ToolCall(kind="python", config={"code": "import os\nresult = dict(os.environ)"}))
    names = set(outcome.data)
    assert not {n for n in names if n.startswith("NOETL_AUTH_")}
    assert "NOETL_DATABASE_URL" not in names
    assert credentials.resolve("canary") == {"type": "bearer", "token": CANARY}  # the engine still can


def test_log_records_are_masked(canary_env, caplog):
    import logging

    handler = logging.StreamHandler()
    logger = logging.getLogger("noetl_celery.test_masking")
    logger.addHandler(handler)
    secret_registry.install_log_filter(logger)
    records: list[str] = []
    handler.emit = lambda record: records.append(handler.format(record))  # type: ignore[method-assign]
    try:
        logger.error("token %s leaked", quote(CANARY, safe=""))
    finally:
        logger.removeHandler(handler)
    assert records == ["token *** leaked"]


# ------------------------------------------------------------------ infrastructure errors


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_unreachable_database_is_one_line_exit_2(tmp_path):
    url = f"postgresql+psycopg2://noetl:Pw#rel-777@127.0.0.1:{_free_port()}/noetl"
    for args in (["executions"], ["status", "1"], ["migrate"]):
        proc = cli(args, {"NOETL_DATABASE_URL": url, "NOETL_HOME": str(tmp_path)})
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1, proc.stderr
        assert lines[0].startswith("error: event store at postgresql+psycopg2://noetl:***@127.0.0.1:")
        assert "Connection refused" in lines[0] and "Pw#rel" not in proc.stderr


def test_unreachable_database_with_debug_shows_the_traceback(tmp_path):
    url = f"postgresql+psycopg2://noetl:x@127.0.0.1:{_free_port()}/noetl"
    proc = cli(["--debug", "executions"], {"NOETL_DATABASE_URL": url})
    assert proc.returncode == 1 and "Traceback" in proc.stderr


def test_unreachable_broker_is_one_line_exit_2(tmp_path):
    playbook = tmp_path / "ok.yaml"
    playbook.write_text(
        "apiVersion: noetl.io/v2\nkind: Playbook\nmetadata: {name: ok}\n"
        "workflow:\n  - step: start\n    tool: {kind: python, code: 'result = 1'}\n"
    )
    store = {"NOETL_DATABASE_URL": f"sqlite:///{tmp_path / 's.sqlite'}"}
    broker = f"redis://:Pw%23rel-777@127.0.0.1:{_free_port()}/0"
    proc = cli(["submit", str(playbook)], {"NOETL_BROKER_URL": broker, **store})
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "broker at redis://:***@127.0.0.1:" in lines[0], (
        proc.stderr
    )
    assert "Connection refused" in lines[0] and "Pw%23rel" not in proc.stderr and "Pw#rel" not in proc.stderr
    # the execution and the start recorded with it are removed again: no row of it is left
    from sqlalchemy import text

    from noetl_celery.store.db import transaction

    with transaction(store["NOETL_DATABASE_URL"]) as conn:
        left = {
            t: conn.execute(text(f"SELECT COUNT(*) FROM {t}")).scalar_one()
            for t in ("noetl_execution", "noetl_event", "noetl_variable")
        }
    assert left == {"noetl_execution": 0, "noetl_event": 0, "noetl_variable": 0}
    # the same password not percent-encoded: the URL itself is refused, before anything is created
    proc = cli(["submit", str(playbook)], {"NOETL_BROKER_URL": broker.replace("%23", "#"), **store})
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: NOETL_BROKER_URL ") and "is not a valid URL" in line and "%23" in line
    assert "Pw#rel" not in proc.stderr


def test_event_rows_mask_content_but_keep_the_engine_names(monkeypatch):
    from noetl_celery.store.repo import _masked

    monkeypatch.setenv("NOETL_AUTH_SHORT", "fetch")  # a credential that is also part of a step name
    row = _masked(
        {
            "event_id": "fetch.1.done",
            "step": "fetch",
            "run_id": "fetch.1",
            "task": "fetch",
            "result": {"said": "fetch this", "q": quote("fetch")},
            "error": None,
            "meta": {"m": "fetch"},
        }
    )
    assert (row["event_id"], row["step"], row["run_id"], row["task"]) == ("fetch.1.done", "fetch", "fetch.1", "fetch")
    assert row["result"] == {"said": "*** this", "q": "***"} and row["meta"] == {"m": "***"}
    secret_registry._sealed.pop("NOETL_AUTH_SHORT", None)


def test_a_store_at_an_unknown_schema_revision_is_one_line_exit_2(tmp_path):
    import sqlite3

    path = tmp_path / "store.sqlite"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE alembic_version (version_num VARCHAR(32))")
        conn.execute("INSERT INTO alembic_version VALUES ('zz99')")
    for args in (["executions"], ["migrate"]):
        proc = cli(args, {"NOETL_DATABASE_URL": f"sqlite:///{path}"})
        assert proc.returncode == 2, proc.stderr
        (line,) = proc.stderr.strip().splitlines()
        assert line.startswith(
            f"error: event store at sqlite:///{path} is at a schema revision this release "
            "does not know (Can't locate revision identified by 'zz99')"
        ), line
