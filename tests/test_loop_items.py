"""How a loop's collection becomes its iterations (rendered once, shaped once)."""

from __future__ import annotations

import pytest

from noetl_celery.core.errors import TemplateError
from noetl_celery.dsl.plan import Loop, Step
from noetl_celery.engine.decision.loops import build_items


def items(**loop) -> list:
    step = Step(name="s", loop=Loop(**loop))
    return build_items(step, {"numbers": [5, 6, 7, 8, 9], "mapping": {"a": 1, "b": 2}, "text": "abc"})


def test_where_limit_enumerate_and_chunks():
    assert items(collection="{{ numbers }}", iterator="n", where="{{ n % 2 == 1 }}") == [5, 7, 9]
    assert items(collection="{{ numbers }}", limit=2) == [5, 6]
    assert items(collection="{{ numbers }}", enumerate=True, limit=2) == [
        {"index": 0, "value": 5},
        {"index": 1, "value": 6},
    ]
    assert items(collection="{{ numbers }}", mode="chunked", chunk_size=2) == [[5, 6], [7, 8], [9]]
    assert items(collection=[1, 2]) == [1, 2]  # a literal list needs no template


def test_a_mapping_iterates_its_items():
    assert items(collection="{{ mapping }}") == [{"key": "a", "value": 1}, {"key": "b", "value": 2}]


def test_a_collection_that_is_not_a_list_is_an_error_naming_the_step():
    with pytest.raises(TemplateError, match="loop collection of step 's' rendered to str, not a list"):
        items(collection="{{ text }}")


def test_a_truncated_collection_is_an_error_naming_the_step_and_the_setting():
    from noetl_celery.config import limits
    from noetl_celery.templates.render import as_step_result

    big = limits.cap([0] * 5_000_000)
    assert limits.is_truncated(big)
    step = Step(name="fanout", loop=Loop(collection="{{ start }}"))
    with pytest.raises(TemplateError) as info:
        build_items(step, {"start": as_step_result(big)})
    message = str(info.value)
    assert "loop collection of step 'fanout'" in message and "truncated when stored" in message
    assert "NOETL_MAX_RESULT_BYTES" in message and "cursor loop" in message
    with pytest.raises(TemplateError, match="truncated when stored"):  # the marker's keys are not the data
        build_items(Step(name="fanout", loop=Loop(collection="{{ start.data }}")), {"start": {"data": big}})


def test_a_collection_past_the_item_limit_is_refused_pointing_to_cursor_loops(monkeypatch):
    monkeypatch.setenv("NOETL_MAX_LOOP_ITEMS", "1000")
    assert len(items(collection="{{ range(1000) | list }}")) == 1000
    with pytest.raises(TemplateError) as info:
        items(collection="{{ range(1001) | list }}")
    message = str(info.value)
    assert "loop collection of step 's' has 1001 elements, more than NOETL_MAX_LOOP_ITEMS (1000)" in message
    assert "cursor loop" in message


def test_the_default_item_limit_refuses_five_million_elements_from_a_template():
    from noetl_celery.config import settings

    assert settings.DEFAULT_MAX_LOOP_ITEMS == 1_000_000
    with pytest.raises(TemplateError, match="has 5000000 elements, more than NOETL_MAX_LOOP_ITEMS \\(1000000\\)"):
        build_items(Step(name="s", loop=Loop(collection="{{ big }}")), {"big": list(range(5_000_000))})
