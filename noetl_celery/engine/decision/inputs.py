"""What a decision takes from outside its event and its reads: the clock, random draws, bounds.

A decision is a function of its event, the state and rows it reads (reads.py) and this
`DecisionInputs` value: `clock` (the store's time, for the deadlines of what it dispatches),
`draws` (the random delays of jittered backoffs) and `bounds` (the limits a decision enforces,
each with the setting that raises it). `DecisionInputs.load()` is the one place the decision
reads the settings, the store's clock and the random generator; replay and tests pass their own
(`RecordedDraws` draws again what a recorded decision drew).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from typing import Protocol

from noetl_celery.config import limits, settings
from noetl_celery.config.limits import is_paged, is_reference, is_truncated  # what a stored value's marker says
from noetl_celery.store import clock as store_clock

__all__ = [
    "Bound",
    "Bounds",
    "DecisionInputs",
    "Draws",
    "RandomDraws",
    "RecordedDraws",
    "is_paged",
    "is_reference",
    "is_truncated",
]

DRAW_TOLERANCE = 0.0005  # a recorded delay is rounded to milliseconds


class Draws(Protocol):
    """The source of a decision's random draws."""

    def uniform(self, low: float, high: float) -> float:
        """A random value in [low, high]."""


class RandomDraws:
    """New random draws (Python's generator)."""

    def uniform(self, low: float, high: float) -> float:
        return random.uniform(low, high)


@dataclass
class RecordedDraws:
    """The delays a recorded decision drew, offered again: a draw takes the first that lies in its
    range (so a decision made again draws what it drew then, unless its range changed), else a
    new random one."""

    offered: list[float]

    def uniform(self, low: float, high: float) -> float:
        for index, value in enumerate(self.offered):
            if low - DRAW_TOLERANCE <= value <= high + DRAW_TOLERANCE:
                return self.offered.pop(index)
        return random.uniform(low, high)


@dataclass(frozen=True)
class Bound:
    """A limit a decision enforces, and the setting (environment variable) that sets it."""

    value: int
    env: str


@dataclass(frozen=True)
class Bounds:
    """The limits a decision enforces; names of the settings its errors point to."""

    max_steps: Bound
    max_loop_items: Bound
    max_result_bytes_env: str = settings.MAX_RESULT_BYTES_ENV
    max_stored_bytes_env: str = settings.MAX_STORED_BYTES_ENV
    max_result_bytes: int = settings.DEFAULT_MAX_RESULT_BYTES  # the row cap: above it, by reference
    max_stored_bytes: int = settings.DEFAULT_MAX_STORED_BYTES  # above it, not stored: truncated

    @classmethod
    def load(cls) -> Bounds:
        """The bounds the settings give now."""
        return cls(
            max_steps=Bound(limits.max_steps(), settings.MAX_STEPS_ENV),
            max_loop_items=Bound(limits.max_loop_items(), settings.MAX_LOOP_ITEMS_ENV),
            max_result_bytes=limits.max_result_bytes(),
            max_stored_bytes=limits.max_stored_bytes(),
        )


@dataclass
class DecisionInputs:
    """The clock, the random draws and the bounds one decision uses (`given_bounds`, or the
    settings' when the decision first needs one)."""

    clock: Callable[[], datetime] = store_clock.now
    draws: Draws = field(default_factory=RandomDraws)
    given_bounds: Bounds | None = None

    @cached_property
    def bounds(self) -> Bounds:
        return self.given_bounds or Bounds.load()

    @classmethod
    def load(cls, draws: Draws | None = None) -> DecisionInputs:
        """This process's inputs: the store's clock, new random draws (or `draws`), the bounds
        the settings give now."""
        return cls(draws=draws or RandomDraws())
