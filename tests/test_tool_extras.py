"""A tool (or cursor driver) whose optional extra is not installed is refused at validate, naming
the extra to install, and an attempt that reaches a worker without it fails with the same line."""

from __future__ import annotations

import textwrap

import pytest

from noetl_celery.core.errors import PlaybookError
from noetl_celery.dsl import load_plan
from noetl_celery.tools import base
from noetl_celery.tools.base import Outcome, ToolCall, missing_extra, register, run_tool

MISSING_KIND = "extra_probe_missing"


def _run_probe(call: ToolCall) -> Outcome:  # never reached: its module is missing
    raise AssertionError("a tool whose extra is missing must not run")


@pytest.fixture(autouse=True)
def probe_tool():
    """A tool kind whose extra names a module that is not installed, registered for the test only."""
    base.known_kinds()  # the built-ins first, so the probe is not taken for the registry's first load
    register(MISSING_KIND, fields={"value"}, extra="probe", modules=("json", "noetl_celery_no_such_module.sub"))(
        _run_probe
    )
    yield
    base._REGISTRY.pop(MISSING_KIND, None)


PLAYBOOK = textwrap.dedent(
    f"""\
    apiVersion: noetl.io/v10
    kind: Playbook
    metadata: {{name: extras, path: tests/extras}}
    workflow:
      - step: start
        tool: {{kind: {MISSING_KIND}, value: 1}}
    """
)


def test_a_tool_whose_extra_is_missing_is_refused_at_validate_naming_the_extra() -> None:
    with pytest.raises(PlaybookError) as raised:
        load_plan("extras.yaml", text=PLAYBOOK)
    text = str(raised.value)
    assert f"tool kind '{MISSING_KIND}' needs noetl_celery_no_such_module.sub" in text
    assert "pip install 'noetl_celery[probe]'" in text
    assert "json" not in text.split("needs", 1)[1].split(",")[0]  # only the missing module is named


def test_an_attempt_of_a_tool_whose_extra_is_missing_fails_with_the_install_line() -> None:
    outcome = run_tool(ToolCall(kind=MISSING_KIND, config={"value": 1}))
    assert outcome.status == "error"
    assert outcome.error is not None and "pip install 'noetl_celery[probe]'" in outcome.error["message"]


def test_installed_extras_are_not_refused() -> None:
    assert missing_extra("tool kind 'duckdb'", "duckdb", ("duckdb",)) is None
    assert missing_extra("x", None, ("no_such_top_module_at_all",)) == (
        "x needs no_such_top_module_at_all, which is not installed: pip install no_such_top_module_at_all"
    )
