"""Tool kinds as NoETL playbooks write them: the registry, typed settings, refused kinds, python
libs:/script:, http verify_ssl, tags:. Settings are checked twice with the same words: literal
values at validate (with path and line), rendered values in the worker."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from noetl_celery.core.errors import PlaybookError, Problem
from noetl_celery.dsl import load_plan
from noetl_celery.engine.attempt import worker
from noetl_celery.tools.base import Outcome, ToolCall, get_tool, known_kinds, register, run_tool
from noetl_celery.tools.unavailable import UNAVAILABLE_KINDS
from tests.support.engines import REPO_ROOT

V2 = "apiVersion: noetl.io/v2\nkind: Playbook\nmetadata:\n  name: t\n"


def compile_text(body: str, file: str = "pb.yaml"):  # type: ignore[no-untyped-def]
    return load_plan(file, text=V2 + textwrap.dedent(body))


def problems(body: str) -> list[Problem]:
    with pytest.raises(PlaybookError) as raised:
        compile_text(body)
    return raised.value.problems


def one_step(tool: str) -> str:
    """A playbook whose only step has the given (canonical) tool mapping, indented under tool:."""
    return "workflow:\n  - step: start\n    tool:\n" + textwrap.indent(textwrap.dedent(tool), "      ")


def call(kind: str, config: dict, context: dict | None = None, auth=None, source_file=None) -> Outcome:  # type: ignore[no-untyped-def]
    """One call through the worker's own path (render, credential, settings check, tool)."""
    return worker._call(kind, config, auth, context or {}, 1, set(), task="t", source_file=source_file)


# ------------------------------------------------------------------ registry


def test_registering_a_kind_keeps_the_built_in_kinds() -> None:
    @register("conformance_echo", fields={"say"})
    def echo(call: ToolCall) -> Outcome:
        return Outcome.ok(call.config.get("say"))

    assert get_tool("conformance_echo") is not None
    for builtin in ("python", "http", "postgres", "duckdb", "secrets", "noop"):
        assert get_tool(builtin) is not None, builtin
    assert {"conformance_echo", "python"} <= set(known_kinds())
    assert run_tool(ToolCall(kind="conformance_echo", config={"say": "hi"})).data == "hi"


def test_a_registered_kind_cannot_replace_a_built_in_one() -> None:
    with pytest.raises(ValueError, match="tool kind 'python' is already registered"):

        @register("python", fields={"code"})
        def impostor(call: ToolCall) -> Outcome:
            return Outcome.ok(None)

    assert get_tool("python").run.__module__ == "noetl_celery.tools.python"  # type: ignore[union-attr]


def test_a_kind_without_a_settings_model_is_free_form() -> None:
    @register("conformance_free", fields={"anything"})
    def free(call: ToolCall) -> Outcome:
        return Outcome.ok(call.config["anything"])

    plan = compile_text(one_step("kind: conformance_free\nanything: [1, {a: 2}]\n"))
    assert plan.steps["start"].tasks[0].config["anything"] == [1, {"a": 2}]


PLUGIN = """
from noetl_celery.tools.base import Outcome, register

@register("shout", fields={"text"})
def shout(call):
    return Outcome.ok(str(call.config.get("text", "")).upper())
"""


def _plugin_dir(tmp_path: Path, entry_points: str) -> Path:
    site = tmp_path / "site"
    (site / "noetl_shout-0.1.dist-info").mkdir(parents=True)
    (site / "noetl_shout.py").write_text(PLUGIN)
    metadata = "Metadata-Version: 2.1\nName: noetl-shout\nVersion: 0.1\n"
    (site / "noetl_shout-0.1.dist-info" / "METADATA").write_text(metadata)
    (site / "noetl_shout-0.1.dist-info" / "entry_points.txt").write_text(entry_points)
    return site


def _python(code: str, site: Path) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": f"{site}:{REPO_ROOT}", "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd=REPO_ROOT
    )


def test_a_third_party_tool_registers_through_the_entry_point_group(tmp_path: Path) -> None:
    site = _plugin_dir(tmp_path, "[noetl_celery.tools]\nshout = noetl_shout\n")
    playbook = tmp_path / "pb.yaml"
    playbook.write_text(V2 + one_step("kind: shout\ntext: '{{ workload.word }}'\n") + "workload:\n  word: hey\n")
    code = textwrap.dedent(f"""
        from noetl_celery.dsl import load_plan
        from noetl_celery.tools.base import ToolCall, run_tool, get_tool, plugin_errors
        plan = load_plan({str(playbook)!r})
        print(plan.steps["start"].tasks[0].kind)
        print(run_tool(ToolCall(kind="shout", config={{"text": "hey"}})).data)
        print(get_tool("python") is not None, plugin_errors())
    """)
    proc = _python(code, site)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:3] == ["shout", "HEY", "True {}"]


def test_a_broken_plugin_is_reported_and_the_built_in_kinds_still_work(tmp_path: Path) -> None:
    site = _plugin_dir(tmp_path, "[noetl_celery.tools]\nmissing = no_such_module_here\n")
    proc = _python(
        "from noetl_celery.tools.base import get_tool, plugin_errors\n"
        "print(get_tool('python') is not None, plugin_errors())",
        site,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("True {'missing': \"ModuleNotFoundError: No module named 'no_such_module_here'\"}")


def test_threads_that_ask_for_a_tool_while_the_tools_load_all_find_it(tmp_path: Path) -> None:
    """A thread pool's first attempts ask for their tool at once: each waits for the load under
    way (made slow here, 50 ms a module) instead of finding the registry half filled."""
    site = _plugin_dir(tmp_path, "[noetl_celery.tools]\nshout = noetl_shout\n")
    code = textwrap.dedent("""
        import importlib, threading, time
        from noetl_celery.tools import base
        real = importlib.import_module
        def slow(name, *args):
            if name.startswith("noetl_celery.tools."):
                time.sleep(0.05)
            return real(name, *args)
        base.importlib = type("slow", (), {"import_module": staticmethod(slow)})
        start = threading.Barrier(8)
        found = []
        def ask(kind):
            start.wait()
            found.append(base.get_tool(kind) is not None)
        threads = [threading.Thread(target=ask, args=(k,)) for k in ["python", "http", "postgres", "shout"] * 2]
        for t in threads: t.start()
        for t in threads: t.join()
        print(found.count(True), len(found))
    """)
    proc = _python(code, site)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["8", "8"]


# ------------------------------------------------------------------ typed settings


def test_http_headers_as_a_list_are_refused_at_validate_with_path_and_line() -> None:
    found = problems(one_step("kind: http\nurl: http://x\nheaders:\n  - Accept: json\n"))
    assert [str(p) for p in found] == ["pb.yaml:10: workflow[0](start).tool.headers: must be a mapping, not a list"]


def test_settings_under_spec_are_reported_where_they_are_written() -> None:
    found = problems(one_step("kind: http\nurl: http://x\nspec:\n  timeout: -2\n"))
    assert [(p.line, p.path, p.message) for p in found] == [
        (11, "workflow[0](start).tool.spec.timeout", "must be a number greater than or equal to 0, not -2")
    ]


def test_rendered_settings_are_checked_in_the_worker_with_the_same_words() -> None:
    plan = compile_text(one_step("kind: http\nurl: http://127.0.0.1:9/x\nheaders: '{{ workload.h }}'\n"))
    task = plan.steps["start"].tasks[0]  # the template passes validate: its value is not known yet
    outcome = call("http", task.config, {"workload": {"h": ["Accept: json"]}})
    assert outcome.status == "error" and outcome.error is not None
    assert outcome.error["kind"] == "invalid_args"
    assert outcome.error["message"] == "http: headers: must be a mapping, not a list"


def test_a_union_setting_names_every_accepted_shape() -> None:
    found = problems(one_step("kind: python\ncode: 'result = 1'\nlibs: 5\n"))
    assert [p.message for p in found] == ["must be a mapping or a list, not a number"]


@pytest.mark.parametrize("kind", sorted(UNAVAILABLE_KINDS))
def test_kinds_that_cannot_run_here_are_refused_in_one_line(kind: str) -> None:
    found = problems(one_step(f"kind: {kind}\nanything: 1\n"))
    assert len(found) == 1
    assert found[0].path == "workflow[0](start).tool.kind" and found[0].line == 8
    assert found[0].message == f"tool kind '{kind}' cannot run here: {UNAVAILABLE_KINDS[kind]}"


# ------------------------------------------------------------------ python libs: and script:


def test_python_libs_bind_modules_by_alias_and_by_name() -> None:
    plan = compile_text(
        one_step(
            "kind: python\nlibs: {b64: base64, json: json}\n"
            "code: 'result = b64.b64encode(json.dumps([1]).encode()).decode()'\n"
        )
    )
    task = plan.steps["start"].tasks[0]
    assert call("python", task.config).data == "WzFd"
    listed = call("python", {"code": "result = os.path.basename('/a/b')", "libs": ["os.path"]})
    assert listed.data == "b"


def test_python_libs_name_the_module_that_cannot_be_imported() -> None:
    outcome = call("python", {"code": "result = 1", "libs": {"x": "no_such_module_xyz"}})
    assert outcome.status == "error" and outcome.error is not None
    assert outcome.error["message"] == (
        "python: libs: cannot import no_such_module_xyz: No module named 'no_such_module_xyz'"
    )


def test_python_script_inline_source() -> None:
    plan = compile_text(
        one_step("kind: python\nscript:\n  uri: inline\n  source: {type: inline, code: '{{ workload.c }}'}\n")
    )
    outcome = call("python", plan.steps["start"].tasks[0].config, {"workload": {"c": "result = 6 * 7"}})
    assert outcome.data == 42


def test_python_script_file_relative_to_the_playbook_and_absolute(tmp_path: Path) -> None:
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "job.py").write_text("return {'from': 'file', 'n': n}\n")
    playbook = tmp_path / "pb.yaml"
    step = "kind: python\nargs: {n: 3}\nscript: {uri: scripts/job.py, source: {type: file}}\n"
    playbook.write_text(V2 + one_step(step))
    task = load_plan(playbook).steps["start"].tasks[0]
    assert call("python", task.config, source_file=str(playbook)).data == {"from": "file", "n": 3}
    absolute = {"script": {"uri": str(tmp_path / "scripts" / "job.py"), "source": {"type": "file"}}, "args": {"n": 4}}
    assert call("python", absolute, source_file="/elsewhere/pb.yaml").data == {"from": "file", "n": 4}
    missing = call("python", {"script": {"uri": "nope.py", "source": {"type": "file"}}}, source_file=str(playbook))
    assert missing.error is not None and missing.error["kind"] == "script"
    assert missing.error["message"].startswith(f"python: script file {tmp_path / 'nope.py'} cannot be read")


def test_python_script_over_http(script_server: str) -> None:
    outcome = call("python", {"script": {"uri": f"{script_server}/job.py", "source": {"type": "http"}}})
    assert outcome.data == {"from": "http"}
    missing = call("python", {"script": {"uri": f"{script_server}/nope.py", "source": {"type": "https"}}})
    assert missing.error is not None and missing.error["message"].endswith("cannot be fetched: HTTP 404")


@pytest.mark.parametrize("source, module, extra", [("gcs", "google.cloud.storage", "gcs"), ("s3", "boto3", "s3")])
@pytest.mark.parametrize("kind", ["python", "postgres"])
def test_object_store_script_sources_validate_and_name_their_extra_when_missing(
    kind: str, source: str, module: str, extra: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from noetl_celery.tools import base

    text = one_step(f"kind: {kind}\nscript:\n  uri: {source}://bucket/x\n  source:\n    type: {source}\n")
    assert compile_text(text).steps["start"].tasks[0].config["script"]["source"]["type"] == source
    by_bucket = one_step(f"kind: {kind}\nscript:\n  path: x.sql\n  source:\n    type: {source}\n    bucket: b\n")
    assert compile_text(by_bucket).steps["start"].tasks[0].config["script"]["path"] == "x.sql"
    monkeypatch.setattr(base, "module_installed", lambda name: name != module)
    found = problems(text)
    assert len(found) == 1
    assert (found[0].line, found[0].path) == (9, "workflow[0](start).tool.script.source.type")
    assert found[0].message.startswith(f"script source type '{source}': ")
    assert f"pip install 'noetl_celery[{extra}]'" in found[0].message


# ------------------------------------------------------------------ http verify_ssl, tags


def test_http_verify_ssl_is_accepted_and_checked() -> None:
    plan = compile_text(one_step("kind: http\nurl: http://x\nverify_ssl: false\n"))
    assert plan.steps["start"].tasks[0].config["verify_ssl"] is False
    found = problems(one_step("kind: http\nurl: http://x\nverify_ssl: 3\n"))
    assert [p.message for p in found] == ["must be true or false or a string, not a number"]


def test_http_verify_ssl_reaches_the_request(monkeypatch: pytest.MonkeyPatch) -> None:
    from noetl_celery.tools import http as http_tool

    seen: dict[str, object] = {}

    class Session:
        def request(self, method, url, **kwargs):  # type: ignore[no-untyped-def]
            seen.update(kwargs)
            raise http_tool.requests.ConnectionError("stop here")

    monkeypatch.setattr(http_tool, "_get_session", lambda: Session())
    call("http", {"url": "https://127.0.0.1:9/", "verify_ssl": False})
    assert seen["verify"] is False


def test_tags_are_kept_as_metadata_and_shown_by_compile(tmp_path: Path) -> None:
    playbook = tmp_path / "pb.yaml"
    playbook.write_text(
        "apiVersion: noetl.io/v2\nkind: Playbook\nmetadata:\n  name: t\n  tags: [auth0, gateway]\n"
        "workflow:\n  - step: start\n    tags: [entry]\n    tool: {kind: python, code: 'result = 1'}\n"
    )
    plan = load_plan(playbook)
    assert plan.tags == ["auth0", "gateway"] and plan.steps["start"].tags == ["entry"]
    proc = subprocess.run(
        [sys.executable, "-m", "noetl_celery.cli", "compile", str(playbook)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert "tags: auth0, gateway" in proc.stdout and "- step start  [tags: entry]" in proc.stdout
    bad = problems("workflow:\n  - step: start\n    tags: {a: 1}\n    tool: {kind: python, code: 'result = 1'}\n")
    assert [str(p) for p in bad] == ["pb.yaml:7: workflow[0](start).tags: must be a list of names, not a mapping"]


def test_sink_settings_are_checked_at_validate_too() -> None:
    found = problems(
        "workflow:\n  - step: start\n    tool: {kind: python, code: 'result = 1'}\n"
        "    sink: {tool: postgres, table: t, args: {a: 1}, pool: nope}\n"
    )
    assert [(p.path, p.message) for p in found] == [
        ("workflow[0](start).sink.pool", "must be a mapping or true or false, not a string")
    ]


def test_a_required_setting_written_as_a_template_is_present_and_a_missing_one_is_named() -> None:
    templated = "kind: ducklake\ncatalog_name: '{{ workload.catalog }}'\ncommand: SELECT 1\n"
    compile_text(one_step(templated))  # no PlaybookError
    found = problems(one_step("kind: ducklake\ncommand: SELECT 1\n"))
    assert [(p.path, p.message) for p in found] == [
        ("workflow[0](start).tool", "ducklake tool needs one of: catalog_name")
    ]
