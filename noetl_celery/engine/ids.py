"""Identifiers: execution ids, step-run ids and the deterministic keys of event rows.

Every key is derived from the event that caused it, so a redelivered event produces the same
keys and its writes hit the unique index instead of being applied twice.
"""

from __future__ import annotations

import hashlib
import secrets
import time

from noetl_celery.core.id_time import EPOCH_MS, RANDOM_BITS


def new_execution_id() -> int:
    """A 63-bit, time-ordered integer (usable unquoted in SQL, as NoETL playbooks do): its time
    is read back by noetl_celery.core.id_time."""
    millis = int(time.time() * 1000) - EPOCH_MS
    return (millis << RANDOM_BITS) | secrets.randbits(RANDOM_BITS)


def run_id_for(execution_id: int, parent_key: str, step: str) -> str:
    """The id of the step run that `parent_key` starts for `step` (unique across executions)."""
    digest = hashlib.blake2b(f"{execution_id}:{parent_key}>{step}".encode(), digest_size=8).hexdigest()
    return digest


def unit_key(run_id: str, iteration: int | None) -> str:
    """A step run, or one iteration of a loop step run."""
    return run_id if iteration is None else f"{run_id}.i{iteration}"


def attempt_key(run_id: str, iteration: int | None, seq: int, attempt: int) -> str:
    """One attempt of one task position (`seq` counts the pipeline hops and pages)."""
    return f"{unit_key(run_id, iteration)}.s{seq}.a{attempt}"


def claim_key(run_id: str, slot: int, claim: int, attempt: int) -> str:
    """One attempt of the `claim`-th claim of cursor slot `slot`."""
    return f"{run_id}.c{slot}.{claim}.a{attempt}"


def cursor_iteration(slot: int, index: int, max_in_flight: int) -> int:
    """The iteration of the `index`-th row of cursor slot `slot` of the loop's `max_in_flight`
    slots: unique in the run."""
    return index * max_in_flight + slot


def slot_id(run_id: str, slot: int) -> str:
    """The `__worker_slot_id` a claim binds: unique across loops and executions."""
    return f"{run_id}:{slot}"
