"""The time and size budget of one template evaluation.

Decides when a template has worked long enough or is about to build too big a value, so that a
hostile or mistaken template (`9 ** (9 ** 9)`, `'x' * 10**10`, nested loops) fails its attempt
with a TemplateError instead of hanging a worker or a decision's transaction.

- Size: the sandbox's intercepted operators (`**`, `*`, `%`) and the filters and methods that
  take a width refuse to build a value larger than NOETL_TEMPLATE_MAX_BYTES (default 1 MB);
  Python's own limits already refuse giant int-to-text conversions.
- Time: while a template evaluates, a trace function on this thread checks the clock at every
  Python call and at every line of the template's code; past NOETL_TEMPLATE_TIMEOUT seconds
  (default 5) it raises. (The operators above are the only C-level work a template can start,
  and they are bounded by size.)
"""

from __future__ import annotations

import math
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

from noetl_celery import limits
from noetl_celery.errors import TemplateError

TEMPLATE_FILENAME = "<template>"  # the file name of compiled template code
MAX_LIPSUM_PARAGRAPHS = 100  # lipsum(n) beyond this is refused
_FORMAT_NUMBERS = re.compile(r"\d+")
_PERCENT_SPEC = re.compile(r"%[#0\- +]*\d*(?:\.\d*)?[a-zA-Z%]")
_BRACE_SPEC = re.compile(r"\{[^{}]*?:([^{}]*)\}")
WIDTH_METHODS = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs"})  # str methods

_local = threading.local()


class BudgetExceeded(TemplateError):
    """A template ran past its time budget or tried to build a value past its size budget."""


def _deadline() -> float | None:
    return getattr(_local, "deadline", None)


def _trace_lines(frame: FrameType, event: str, arg: Any) -> Any:
    deadline = _deadline()
    if deadline is not None and time.monotonic() > deadline:
        raise BudgetExceeded(
            f"template evaluation took longer than {limits.template_timeout():g} s (NOETL_TEMPLATE_TIMEOUT)"
        )
    return _trace_lines


def _trace_calls(frame: FrameType, event: str, arg: Any) -> Any:
    _trace_lines(frame, event, arg)
    filename = frame.f_code.co_filename
    if filename == TEMPLATE_FILENAME or "jinja2" in filename:
        return _trace_lines
    return None


@contextmanager
def budget() -> Iterator[None]:
    """Evaluate the block under the time budget (nested blocks share the outer deadline)."""
    if _deadline() is not None:
        yield
        return
    _local.deadline = time.monotonic() + limits.template_timeout()
    previous = sys.gettrace()
    sys.settrace(_trace_calls)
    try:
        yield
    finally:
        sys.settrace(previous)
        _local.deadline = None


def _too_big(what: str, size: float) -> BudgetExceeded:
    return BudgetExceeded(
        f"{what} would build about {size:.3g} bytes, more than the template limit of "
        f"{limits.template_max_bytes()} bytes (NOETL_TEMPLATE_MAX_BYTES)"
    )


def _int_bytes(value: int) -> float:
    return abs(value).bit_length() / 8


def check_binop(operator: str, left: Any, right: Any) -> None:
    """Raise BudgetExceeded when `left <operator> right` would build too big a value."""
    limit = limits.template_max_bytes()
    if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
        base = abs(left)
        if base > 1 and right * math.log2(base) / 8 > limit:
            raise _too_big(f"{left!r} ** {right!r}", right * math.log2(base) / 8)
    elif operator == "*":
        for seq, count in ((left, right), (right, left)):
            if isinstance(seq, (str, bytes, list, tuple)) and isinstance(count, int):
                size = len(seq) * count * (1 if isinstance(seq, (str, bytes)) else 8)
                if size > limit:
                    raise _too_big("repeating a sequence", size)
        if isinstance(left, int) and isinstance(right, int) and _int_bytes(left) + _int_bytes(right) > limit:
            raise _too_big("multiplying", _int_bytes(left) + _int_bytes(right))
    elif operator == "%" and isinstance(left, str):
        check_format_widths(left)


def check_format_widths(text: str) -> None:
    """Refuse a format string (`%` or str.format) whose widths or precisions pad past the limit."""
    limit = limits.template_max_bytes()
    specs = [m.group(0) for m in _PERCENT_SPEC.finditer(text)] + _BRACE_SPEC.findall(text)
    for spec in specs:
        for number in _FORMAT_NUMBERS.findall(spec):
            if len(number) > 9 or int(number) > limit:
                raise _too_big("a format width", float(number[:18]))


def check_width(what: str, width: Any) -> None:
    if isinstance(width, int) and width > limits.template_max_bytes():
        raise _too_big(what, width)


def bounded_filter(name: str, run: Callable[..., Any], *width_params: int) -> Callable[..., Any]:
    """`run` (a filter) with its width arguments (by position after the value) checked first."""

    def checked(*args: Any, **kwargs: Any) -> Any:
        for index in width_params:
            if index < len(args):
                check_width(f"the filter {name}", args[index])
        for value in kwargs.values():
            check_width(f"the filter {name}", value)
        return run(*args, **kwargs)

    checked.__name__ = getattr(run, "__name__", name)
    for attr in ("jinja_pass_arg",):
        if hasattr(run, attr):
            setattr(checked, attr, getattr(run, attr))
    return checked


def bounded_lipsum(run: Callable[..., Any]) -> Callable[..., Any]:
    def lipsum(n: int = 5, *args: Any, **kwargs: Any) -> Any:
        if isinstance(n, int) and n > MAX_LIPSUM_PARAGRAPHS:
            raise _too_big("lipsum", n * 1000)
        return run(n, *args, **kwargs)

    return lipsum


def check_output(size: int) -> None:
    """Refuse rendered text past the size limit (checked while it is produced)."""
    if size > limits.template_max_bytes():
        raise _too_big("the rendered text", size)
