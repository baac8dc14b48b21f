"""The store's queries by their former single home: a facade over the table modules.

The queries live by table over one SQL kernel: store/kernel.py (the tables, the store's time,
statements as SQL text on the DBAPI cursor), executions.py, events.py, decisions.py (a
decision's one-statement write), variables.py, joins.py, loops.py and catalog.py. This module
hands their public names on for the code that still imports them from here; new code imports
the table module itself.

The kernel's statement entry keeps its former name here (`_run`, with `_sql`, `_bound`, `_read`,
`_insert`), and replacing `_run` on this module (a test counting the statements a
path sends) replaces the kernel's `run`, which every table module calls.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from noetl_celery.store import kernel
from noetl_celery.store.catalog import (
    find_playbook as find_playbook,
)
from noetl_celery.store.catalog import (
    list_playbooks as list_playbooks,
)
from noetl_celery.store.catalog import (
    register_playbook as register_playbook,
)
from noetl_celery.store.decisions import (
    Bump as Bump,
)
from noetl_celery.store.decisions import (
    Conflict as Conflict,
)
from noetl_celery.store.decisions import (
    IterationCount as IterationCount,
)
from noetl_celery.store.decisions import (
    Recorded as Recorded,
)
from noetl_celery.store.decisions import (
    record_decision as record_decision,
)
from noetl_celery.store.events import (
    EVENT_COLUMNS as EVENT_COLUMNS,
)
from noetl_celery.store.events import (
    EVENT_KEY as EVENT_KEY,
)
from noetl_celery.store.events import (
    INSERT_ROWS_PER_STATEMENT as INSERT_ROWS_PER_STATEMENT,
)
from noetl_celery.store.events import (
    LEASE_KEY as LEASE_KEY,
)
from noetl_celery.store.events import (
    _masked as _masked,
)
from noetl_celery.store.events import (
    all_new as all_new,
)
from noetl_celery.store.events import (
    event_chunks as event_chunks,
)
from noetl_celery.store.events import (
    event_exists as event_exists,
)
from noetl_celery.store.events import (
    event_meta as event_meta,
)
from noetl_celery.store.events import (
    event_processors as event_processors,
)
from noetl_celery.store.events import (
    events_after as events_after,
)
from noetl_celery.store.events import (
    events_insert_sql as events_insert_sql,
)
from noetl_celery.store.events import (
    find_event as find_event,
)
from noetl_celery.store.events import (
    insert_events as insert_events,
)
from noetl_celery.store.events import (
    is_event_key as is_event_key,
)
from noetl_celery.store.events import (
    iteration_ends as iteration_ends,
)
from noetl_celery.store.events import (
    last_event_id as last_event_id,
)
from noetl_celery.store.events import (
    lease_statements as lease_statements,
)
from noetl_celery.store.events import (
    list_events as list_events,
)
from noetl_celery.store.events import (
    run_events as run_events,
)
from noetl_celery.store.events import (
    with_leases as with_leases,
)
from noetl_celery.store.executions import (
    HEAD_SQL as HEAD_SQL,
)
from noetl_celery.store.executions import (
    bump_execution as bump_execution,
)
from noetl_celery.store.executions import (
    child_executions as child_executions,
)
from noetl_celery.store.executions import (
    count_events as count_events,
)
from noetl_celery.store.executions import (
    create_execution as create_execution,
)
from noetl_celery.store.executions import (
    delete_unpublished_execution as delete_unpublished_execution,
)
from noetl_celery.store.executions import (
    execution_head as execution_head,
)
from noetl_celery.store.executions import (
    execution_link as execution_link,
)
from noetl_celery.store.executions import (
    finish_execution as finish_execution,
)
from noetl_celery.store.executions import (
    get_execution as get_execution,
)
from noetl_celery.store.executions import (
    list_executions as list_executions,
)
from noetl_celery.store.executions import (
    lock_execution as lock_execution,
)
from noetl_celery.store.executions import (
    running_at as running_at,
)
from noetl_celery.store.executions import (
    running_since as running_since,
)
from noetl_celery.store.joins import (
    open_join as open_join,
)
from noetl_celery.store.joins import (
    settle_join as settle_join,
)
from noetl_celery.store.kernel import (
    BLOBS as BLOBS,
)
from noetl_celery.store.kernel import (
    CATALOG as CATALOG,
)
from noetl_celery.store.kernel import (
    EVENTS as EVENTS,
)
from noetl_celery.store.kernel import (
    EXECUTIONS as EXECUTIONS,
)
from noetl_celery.store.kernel import (
    HOLDS as HOLDS,
)
from noetl_celery.store.kernel import (
    JOINS as JOINS,
)
from noetl_celery.store.kernel import (
    LEASES as LEASES,
)
from noetl_celery.store.kernel import (
    LOOPS as LOOPS,
)
from noetl_celery.store.kernel import (
    PROCESSORS as PROCESSORS,
)
from noetl_celery.store.kernel import (
    VARIABLES as VARIABLES,
)
from noetl_celery.store.kernel import (
    utcnow as utcnow,
)
from noetl_celery.store.loops import (
    LOOP_DONE_SQL as LOOP_DONE_SQL,
)
from noetl_celery.store.loops import (
    claim_loop_indexes as claim_loop_indexes,
)
from noetl_celery.store.loops import (
    complete_loop as complete_loop,
)
from noetl_celery.store.loops import (
    create_loop as create_loop,
)
from noetl_celery.store.loops import (
    end_loop_slot as end_loop_slot,
)
from noetl_celery.store.loops import (
    execution_loops as execution_loops,
)
from noetl_celery.store.loops import (
    get_loop as get_loop,
)
from noetl_celery.store.loops import (
    held_claim as held_claim,
)
from noetl_celery.store.loops import (
    hold_claim as hold_claim,
)
from noetl_celery.store.loops import (
    loop_counters as loop_counters,
)
from noetl_celery.store.loops import (
    loop_done_params as loop_done_params,
)
from noetl_celery.store.loops import (
    loop_iteration_done as loop_iteration_done,
)
from noetl_celery.store.loops import (
    loop_iteration_done_checked as loop_iteration_done_checked,
)
from noetl_celery.store.loops import (
    reopen_loop as reopen_loop,
)
from noetl_celery.store.loops import (
    run_results as run_results,
)
from noetl_celery.store.variables import (
    PG_VARIABLES as PG_VARIABLES,
)
from noetl_celery.store.variables import (
    load_variables as load_variables,
)
from noetl_celery.store.variables import (
    put_variables as put_variables,
)
from noetl_celery.store.variables import (
    read_state as read_state,
)
from noetl_celery.store.variables import (
    variable_rows as variable_rows,
)
from noetl_celery.store.variables import (
    variables_upsert_sql as variables_upsert_sql,
)

_run = kernel.run
_sql = kernel.sql
_bound = kernel.bound
_read = kernel.read
_insert = kernel.insert


_KERNEL_NAMES = {"_run": "run"}  # a former name of the kernel's -> its name there


class _Facade(types.ModuleType):
    """A name replaced here is replaced in the module that defines it too (a test that counts
    or fakes a query through this module is heard by the code that calls the table module)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _KERNEL_NAMES:
            setattr(kernel, _KERNEL_NAMES[name], value)
        else:
            home = _HOMES.get(name)
            if home is not None:
                setattr(home, name, value)
        super().__setattr__(name, value)


_HOMES = {  # a function's or class's name here -> the table module that defines it
    name: sys.modules[value.__module__]
    for name, value in list(globals().items())
    if callable(value)
    and getattr(value, "__module__", "").startswith("noetl_celery.store.")
    and getattr(sys.modules[value.__module__], name, None) is value
    and value.__module__ != __name__
}
sys.modules[__name__].__class__ = _Facade
