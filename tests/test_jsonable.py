"""core/jsonable.py on long lists: a tool's result of many elements is neither copied nor encoded
whole when nothing in it changes, and what the store refuses is still found wherever it is."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal

from noetl_celery.core import jsonable
from noetl_celery.core.jsonable import to_jsonable, unstorable


def test_a_list_whose_elements_do_not_change_is_not_copied():
    items = list(range(50_000))
    assert to_jsonable(items) is items
    nested = [[1, "a"], [2, None], [3.5, True]]
    assert to_jsonable(nested) is nested and to_jsonable(nested)[0] is nested[0]


def test_a_list_is_copied_from_the_first_element_that_changes_and_the_original_is_untouched():
    day = dt.date(2026, 1, 2)
    items = [1, 2, Decimal("3"), day, [Decimal("1.5")], "x"]
    converted = to_jsonable(items)
    assert converted == [1, 2, 3, "2026-01-02", [1.5], "x"]
    assert converted is not items and items == [1, 2, Decimal("3"), day, [Decimal("1.5")], "x"]
    assert to_jsonable((1, 2)) == [1, 2] and to_jsonable([{"a": Decimal("2")}]) == [{"a": 2}]


def test_the_screen_of_a_long_list_finds_what_the_store_refuses_in_any_slice():
    size = 3 * jsonable.STRICT_SLICE + 7
    assert unstorable(list(range(size)), 10) is None
    for index, bad in ((0, float("nan")), (jsonable.STRICT_SLICE, "a\x00b"), (size - 1, "\ud800")):
        items: list = list(range(size))
        items[index] = bad
        problem = unstorable(items, 10)
        assert problem is not None and problem.endswith(f"at result[{index}]"), problem
    deep: list = list(range(size))
    deep[size - 2] = [[[[1]]]]
    assert "nesting deeper than 3" in (unstorable(deep, 3) or "")
