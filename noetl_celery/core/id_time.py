"""How an execution id encodes the time it was made: the milliseconds since EPOCH_MS in the bits
above RANDOM_BITS random ones. The engine makes ids (engine/ids.py); the store reads their time
(a partitioned event table's bounds, store/partitions.py)."""

from __future__ import annotations

from datetime import UTC, datetime

EPOCH_MS = 1_704_067_200_000  # 2024-01-01T00:00:00Z; execution ids count milliseconds from here
RANDOM_BITS = 22


def first_id_at(when: datetime) -> int:
    """The smallest execution id made at `when` (or later): a range bound for ids made from `when` on."""
    millis = int(when.timestamp() * 1000) - EPOCH_MS
    return millis << RANDOM_BITS


def time_of(execution_id: int) -> datetime:
    """When the execution id was made (to the millisecond, UTC)."""
    return datetime.fromtimestamp(((execution_id >> RANDOM_BITS) + EPOCH_MS) / 1000, tz=UTC)
