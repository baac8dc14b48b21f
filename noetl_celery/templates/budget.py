"""The time and size budget of one template evaluation.

Decides when a template has worked long enough or is about to build too big a value, so that a
hostile or mistaken template (`9 ** (9 ** 9)`, `'x' * 10**10`, nested loops) fails its attempt
with a TemplateError instead of hanging a worker or a decision's transaction.

- Size: the sandbox's intercepted operators (`**`, `*`, `+`, `%`), `~` (compiled to the
  environment's bounded concatenation), the join and sum filters, and the filters and methods
  that take a width (`str.format` and `%` widths and precisions too, also when they come from
  the arguments: `'{0:>{1}}'`, `'%*s'`) refuse to build a value larger than
  NOETL_TEMPLATE_MAX_BYTES (default 1 MB); Python's own limits already refuse giant int-to-text
  conversions.
- Integers: `**` and `*` refuse to build an integer of more than MAX_INT_BITS bits, and `//`,
  `/`, `%` refuse operands that big: the cost of one such C call grows with the square of the
  size and no clock can interrupt it (`(7**2000000)//(5**1000000)` would take half a minute).
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

from noetl_celery.config import limits
from noetl_celery.core.errors import TemplateError

TEMPLATE_FILENAME = "<template>"  # the file name of compiled template code
MAX_LIPSUM_PARAGRAPHS = 100  # lipsum(n) beyond this is refused
_FORMAT_NUMBERS = re.compile(r"\d+")
_PERCENT_SPEC = re.compile(
    r"%(?P<key>\([^)]*\))?[#0\- +]*(?P<width>\*|\d*)(?:\.(?P<precision>\*|\d*))?[hlL]?(?P<type>[a-zA-Z%])"
)
_BRACE_SPEC = re.compile(r"\{[^{}]*?:([^{}]*)\}")
MAX_INT_BITS = 100_000  # bits of an integer a template operation may build (about 30,000 digits)
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


def _too_many_bits(what: str, bits: float) -> BudgetExceeded:
    return BudgetExceeded(
        f"{what} would build an integer of about {bits:.3g} bits, more than the template limit of {MAX_INT_BITS} bits"
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _sequence_bytes(value: Any) -> int | None:
    """About how many bytes a str/bytes (one a character) or list/tuple (8 an item) takes."""
    if isinstance(value, (str, bytes)):
        return len(value)
    if isinstance(value, (list, tuple)):
        return len(value) * 8
    return None


def check_binop(operator: str, left: Any, right: Any) -> None:
    """Raise BudgetExceeded when `left <operator> right` would build too big a value or start too
    long a big-integer computation."""
    limit = limits.template_max_bytes()
    if operator == "**" and _is_int(left) and _is_int(right) and right > 0:
        base = abs(left)
        if base > 1 and right * math.log2(base) > MAX_INT_BITS:
            raise _too_many_bits(f"{left!r} ** {right!r}", right * math.log2(base))
    elif operator == "*":
        for seq, count in ((left, right), (right, left)):
            if isinstance(seq, (str, bytes, list, tuple)) and _is_int(count):
                size = len(seq) * count * (1 if isinstance(seq, (str, bytes)) else 8)
                if size > limit:
                    raise _too_big("repeating a sequence", size)
        if _is_int(left) and _is_int(right) and left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise _too_many_bits("multiplying", left.bit_length() + right.bit_length())
    elif operator == "+":
        sizes = (_sequence_bytes(left), _sequence_bytes(right))
        if sizes[0] is not None and sizes[1] is not None and sizes[0] + sizes[1] > limit:
            raise _too_big("concatenating", sizes[0] + sizes[1])
    elif operator in ("//", "/", "%") and _is_int(left) and _is_int(right):
        bits = max(left.bit_length(), right.bit_length())
        if bits > MAX_INT_BITS:
            raise _too_many_bits(f"an operand of {operator!r}", bits)
    if operator == "%" and isinstance(left, str):
        check_percent_format(left, right)


def check_percent_format(text: str, values: Any) -> None:
    """Refuse a `%` format whose widths or precisions pad past the limit, also a `*` width or
    precision taken from `values` (the right operand of `%`)."""
    limit = limits.template_max_bytes()
    arguments = values if isinstance(values, tuple) else (values,)
    position = 0
    for spec in _PERCENT_SPEC.finditer(text):
        if spec.group("type") == "%":
            continue
        for part in ("width", "precision"):
            number = spec.group(part)
            if number == "*":
                taken: Any = arguments[position] if position < len(arguments) else 0
                position += 1
                if _is_int(taken) and abs(taken) > limit:
                    raise _too_big("a format width", abs(taken))
            elif number and (len(number) > 9 or int(number) > limit):
                raise _too_big("a format width", float(number[:18]))
        position += 1


def check_format_widths(text: str) -> None:
    """Refuse a format string (`%` or str.format) whose literal widths or precisions pad past
    the limit (nested `{}` fields are checked once filled in, by `check_format_spec`)."""
    limit = limits.template_max_bytes()
    specs = [m.group(0) for m in _PERCENT_SPEC.finditer(text)] + _BRACE_SPEC.findall(text)
    for spec in specs:
        for number in _FORMAT_NUMBERS.findall(spec):
            if len(number) > 9 or int(number) > limit:
                raise _too_big("a format width", float(number[:18]))


def check_format_spec(spec: str) -> None:
    """Refuse one filled-in `str.format` spec (`>50000000`, `.99999999f`) past the limit."""
    limit = limits.template_max_bytes()
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


def check_total(what: str, size: int) -> None:
    """Refuse joining pieces of `size` bytes in all (`~`, the join and sum filters)."""
    if size > limits.template_max_bytes():
        raise _too_big(what, size)


def sequence_bytes(value: Any) -> int:
    """About how many bytes concatenating `value` adds (0 for what is not a sequence)."""
    return _sequence_bytes(value) or 0


def check_output(size: int) -> None:
    """Refuse rendered text past the size limit (checked while it is produced)."""
    if size > limits.template_max_bytes():
        raise _too_big("the rendered text", size)
