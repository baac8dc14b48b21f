"""The REST API's request and answer shapes as pydantic models: openapi.py builds the OpenAPI
document from them and from the routes, so the document says what the handlers accept.

Bodies allow fields they do not name (NoETL's clients send some this server ignores). Ids are
strings in answers (rest.ids_as_strings); where an id is asked for, digits are accepted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

ID_PATTERN = r"^[0-9]{1,19}$"
TIME_TEXT = "an ISO 8601 time (2026-01-31T12:00:00Z); UTC when it has no offset"
Status = Literal["running", "completed", "failed", "cancelled"]
Workload = dict[str, Any]


class Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class Answer(BaseModel):
    model_config = ConfigDict(extra="allow")


# --- bodies -----------------------------------------------------------------------------------


class RegisterBody(Body):
    content: str = Field(min_length=1, description="the playbook's YAML, as it is or base64-encoded")
    resource_type: str | None = Field(None, description="Playbook (Credential: 501)")


class CatalogListBody(Body):
    resource_type: str | None = Field(None, description="Playbook")


class ExecuteBody(Body):
    path: str | None = Field(None, description="the catalog path of a registered playbook")
    catalog_id: str | None = Field(None, description="NoETL's GUI's name of the path")
    workload: Workload | None = Field(None, description="deep-merged over the playbook's workload, as --set does")
    payload: Workload | None = Field(None, description="older clients' name of workload")
    resource_kind: str | None = Field(None, description="playbook")
    version: int | str | None = Field(None, description="latest or 1: the catalog keeps the latest registration")


class CancelBody(Body):
    cascade: bool | None = None
    reason: str | None = None


class RerunBody(Body):
    workload: Workload | None = Field(None, description="deep-merged over the old execution's workload")
    resource_kind: str | None = None
    from_step: str | None = Field(None, description="start at this step; the steps before it keep their results")
    latest: bool | None = Field(None, description="the playbook registered at its path now, not the stored plan")


class CleanupBody(Body):
    older_than_minutes: float | None = Field(None, ge=0, le=100 * 366 * 24 * 60)
    dry_run: bool | None = None


class ContentBody(Body):
    content: str = Field(min_length=1, description="the playbook's YAML, as it is or base64-encoded")
    workload: Workload | None = None


class ResourceBody(Body):
    path: str | None = None
    catalog_id: str | None = None
    version: int | str | None = None


class EmptyBody(Body):
    pass


class ScheduleBody(Body):
    name: str
    playbook: str = Field(description="a catalog path, or a playbook file on the server")
    cron: str | None = Field(None, description="5 fields, or 6 with seconds first")
    every: int | None = Field(None, ge=1, description="interval in seconds")
    timezone: str | None = Field(None, description="IANA name of the cron's time zone (default UTC)")
    workload: Workload | None = None
    missed: Literal["latest", "skip"] | None = None
    paused: bool | None = None
    replace: bool | None = None


# --- query parameters ---------------------------------------------------------------------------


class ExecutionsQuery(BaseModel):
    status: Status | None = None
    playbook: str | None = Field(None, description="a part of the playbook's name")
    path: str | None = Field(None, description="the catalog path")
    parent: str | None = Field(None, pattern=ID_PATTERN, description="the parent execution's id")
    since: str | None = Field(None, description=TIME_TEXT, json_schema_extra={"format": "date-time"})
    until: str | None = Field(None, description=TIME_TEXT, json_schema_extra={"format": "date-time"})
    cursor: str | None = Field(None, pattern=ID_PATTERN, description="X-Next-Cursor of the previous page")
    limit: int | None = Field(None, ge=1, le=1000)


class ExecutionPageQuery(BaseModel):
    page: int | None = Field(None, ge=1, le=2**40)
    page_size: int | None = Field(None, ge=1, le=1000)
    since_event_id: int | None = Field(None, ge=0, le=2**63 - 1)
    event_type: str | None = None


class EventsQuery(BaseModel):
    after: int | None = Field(None, ge=0, le=2**63 - 1, description="an event id: the rows after it")
    type: str | None = None
    step: str | None = None
    limit: int | None = Field(None, ge=1, le=10000)


class AttemptsQuery(BaseModel):
    first: int | None = Field(None, ge=1, le=2**31)
    limit: int | None = Field(None, ge=1, le=1000)


class ContentQuery(BaseModel):
    playbook_id: str = Field(min_length=1, description="the catalog id (its path)")


class ScheduleQuery(BaseModel):
    runs: int | None = Field(None, ge=1, le=1000)


# --- answers ----------------------------------------------------------------------------------


class Error(Answer):
    detail: str
    field: str | None = None


class Health(Answer):
    status: str
    message: str
    timestamp: str
    runs_executions: bool


class Ready(Answer):
    status: Literal["ready", "unready"]
    store: dict[str, Any]
    broker: dict[str, Any]


class Started(Answer):
    execution_id: str
    status: str


class Rerun(Started):
    rerun_of: str
    from_step: str | None
    latest: bool


class Registered(Answer):
    status: str
    path: str
    name: str


class CatalogEntry(Answer):
    catalog_id: str
    path: str
    name: str
    version: str
    status: str


class CatalogResource(CatalogEntry):
    content: str
    payload: dict[str, Any]


class CatalogList(Answer):
    entries: list[CatalogEntry]
    count: int


class ListedExecution(Answer):
    execution_id: str
    parent_execution_id: str | None
    playbook: str
    path: str
    status: str
    start_time: str | None
    end_time: str | None
    progress: int


class Event(Answer):
    id: str
    execution_id: str
    event_type: str


class ExecutionPage(Answer):
    execution_id: str
    parent_execution_id: str | None
    status: str
    children: list[str]
    events: list[Event]
    pagination: dict[str, Any]


class StatusAnswer(Answer):
    execution_id: str
    status: str
    completed: bool
    failed: bool


class Events(Answer):
    execution_id: str
    events: list[Event]
    next_after: str | None


class AttemptSummary(Answer):
    n: int
    event_id: str
    step: str | None
    status: str | None


class Attempts(Answer):
    execution_id: str
    attempts: list[AttemptSummary]


class AttemptLog(AttemptSummary):
    execution_id: str
    stdout: str
    stderr: str
    log: list[Any]


class Cancelled(Answer):
    execution_id: str
    status: str
    cancelled_executions: list[str]


class Cleanup(Answer):
    cancelled_count: int
    execution_ids: list[str]


class Resumed(Answer):
    execution_id: str
    epoch: int


class Validated(Answer):
    valid: bool


class ValidateText(Answer):
    valid: bool
    errors: list[str]


class Stats(Answer):
    total_playbooks: int
    total_executions: int
    active_executions: int
    success_rate: float
    recent_executions: list[ListedExecution]


class Credentials(Answer):
    items: list[Any]


class Schedules(Answer):
    schedules: list[dict[str, Any]]


class AnyObject(Answer):
    pass


@dataclass(frozen=True)
class Op:
    """One method of one route, as the OpenAPI document describes it; the handler class holds its
    operations in `doc` (method name -> Op)."""

    summary: str
    answer: Any = AnyObject  # a model, or list[model]
    body: type[BaseModel] | None = None
    body_required: bool = True
    query: type[BaseModel] | None = None
    errors: tuple[int, ...] = ()
    status: int = 200
    extra_answers: tuple[tuple[int, Any, str], ...] = ()  # (status, model, description)
