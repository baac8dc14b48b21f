"""How a loop's collection becomes its iterations (rendered once, shaped once)."""

from __future__ import annotations

import pytest

from noetl_celery.dsl.plan import Loop, Step
from noetl_celery.engine.loops import build_items
from noetl_celery.errors import TemplateError


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
