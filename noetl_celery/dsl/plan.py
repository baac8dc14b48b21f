"""The one plan model every dialect normalises into.

The compiler and the engine only ever see these classes; they never look at a dialect's surface
syntax. Templates stay as unrendered strings here: the engine renders them at run time.
A plan is JSON-serialisable (`Plan.model_dump(mode="json")`) and is stored with the execution.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# A condition is a template string ("{{ ... }}"), a literal boolean, or None for "always/else".
Condition = str | bool | None

# retry: run the same task again (with next_call: the next page); continue: next task / done;
# jump: to another task of the pipeline; break: leave the pipeline, the step (or iteration) is
# done; fail: the step fails; stop: stop trying (an ok outcome continues, an error fails).
ActionKind = Literal["retry", "continue", "jump", "break", "fail", "stop"]
OutcomeGate = Literal["any", "ok", "error"]
BackoffKind = Literal["none", "fixed", "linear", "exponential"]
CollectStrategy = Literal["append", "extend", "replace", "merge", "collect"]
LoopMode = Literal["sequential", "parallel", "chunked", "cursor"]
RouteMode = Literal["exclusive", "inclusive"]

DEFAULT_RETRY_ATTEMPTS = 3  # `retry: true` and a retry action without `attempts`
DEFAULT_RETRY_DELAY = 1.0  # seconds before the second attempt
DEFAULT_MAX_DELAY = 300.0  # seconds; no backoff waits longer than this
DEFAULT_PAGINATION_MAX = 100  # pages when `on_success` names no max_attempts
DEFAULT_MAX_IN_FLIGHT = 8  # iterations in flight for async/parallel loops without a max_in_flight


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


class Collect(_Model):
    """How the pages of a paginated task are gathered into the step's result."""

    strategy: CollectStrategy = "append"
    path: str | None = None  # dotted path into each page's response body
    into: str | None = None  # also published as vars.<into>


class Action(_Model):
    """What to do once a rule matched an attempt's outcome."""

    do: ActionKind = "continue"
    attempts: int | None = None  # retry: total attempts allowed; pagination: max pages
    backoff: BackoffKind = "none"
    delay: float = 0.0  # seconds; the first retry's wait
    multiplier: float | None = None  # legacy: delay * multiplier ** (attempt - 1)
    max_delay: float = DEFAULT_MAX_DELAY
    jitter: bool = False
    to: str | None = None  # jump target (task label in the same pipeline)
    next_call: dict[str, Any] | None = None  # pagination: params/body/headers/url/args overrides
    collect: Collect | None = None
    set_ctx: dict[str, Any] = Field(default_factory=dict)
    set_iter: dict[str, Any] = Field(default_factory=dict)
    set_vars: dict[str, Any] = Field(default_factory=dict)
    # v2 case `then.result`: the attempt's data becomes this value (rendered with the outcome in scope)
    result: Any = None
    sets_result: bool = False


class Rule(_Model):
    """`when` -> action. `when` None means an `else` rule (always matches).

    `on` gates the rule on the outcome's status before `when` is evaluated (legacy
    `on_error`/`on_success` blocks compile to gated rules).
    """

    on: OutcomeGate = "any"
    when: Condition = None
    then: Action = Field(default_factory=Action)
    source: str = ""  # playbook path of the rule, for explanations in events


class Policy(_Model):
    """Ordered rules evaluated against every attempt's outcome; the first match wins.

    No policy: ok continues, error fails. Policy present and nothing matched: continue.
    """

    rules: list[Rule] = Field(default_factory=list)


class Sink(_Model):
    """A write that runs in the same job as its task, after the tool, with `result` in scope."""

    kind: str
    config: dict[str, Any] = Field(default_factory=dict)
    auth: Any = None
    line: int | None = None


class Task(_Model):
    """One tool call: the unit a worker runs in one Celery task."""

    label: str
    kind: str
    config: dict[str, Any] = Field(default_factory=dict)  # tool fields, templates unrendered
    auth: Any = None  # credential name, template, or {type, credential}
    policy: Policy | None = None
    sink: Sink | None = None
    line: int | None = None
    # task-level `output:` / `output_select` / `result:` as written: NoETL reads them to shape a
    # result it externalises; advisory here (results live in event rows, none is trimmed)
    hints: dict[str, Any] = Field(default_factory=dict)


class Loop(_Model):
    """Iterate the step's tasks over a collection (or a cursor), fanned out by on_event."""

    collection: Any = None  # template or literal list
    cursor: dict[str, Any] | None = None
    iterator: str = "item"
    mode: LoopMode = "sequential"
    # iterations (a cursor loop: slots) in flight at most; written max_in_flight (loop or spec), or
    # concurrency (dsl/canonical.py)
    max_in_flight: int = 1
    chunk_size: int | None = None
    # iterations sent together in one Celery message (engine/decision/batching.py): a count, or "auto"
    batch: int | Literal["auto"] = 1
    enumerate: bool = False
    where: Condition = None
    limit: int | None = None
    line: int | None = None
    # cursor: the claim frame as written (max_rows, lease_seconds, ...); the claim SQL may read
    # `__frame_max_rows` etc. from it
    frame: dict[str, Any] | None = None
    # cursor: the loop's result also lists every row's result (`results`, in completion order)
    aggregate: bool = False
    # cursor: how a claim that errors is tried again (None: CLAIM_RETRY of engine/decision/cursor_loop.py)
    claim_retry: Action | None = None


class Arc(_Model):
    """One outgoing edge: to `step` when `when` holds (negated for legacy `else` branches)."""

    step: str
    when: Condition = None
    negate: bool = False
    args: dict[str, Any] = Field(default_factory=dict)
    # v2 case `then: {next, set}`: assigned (rendered at the step's end) when this arc fires
    set_ctx: dict[str, Any] = Field(default_factory=dict)
    set_vars: dict[str, Any] = Field(default_factory=dict)
    line: int | None = None
    # v2 `case:` beside a structural `next:`: the `next:` arcs are tried only when no case arc
    # fired, in `Routing.fallback_mode`
    fallback: bool = False


class Routing(_Model):
    mode: RouteMode = "inclusive"
    arcs: list[Arc] = Field(default_factory=list)
    fallback_mode: RouteMode = "inclusive"
    # `next.spec.on_no_match`: when arcs exist but none matched, "quiet" ends the branch,
    # "error" fails the execution; None: `Plan.no_next_is_error` decides
    on_no_match: Literal["quiet", "error"] | None = None


class Step(_Model):
    """A node of the workflow. Its tasks run in order (a pipeline); a legacy step has one task.

    Step-level surface forms are normalised onto the tasks: legacy `retry:`/`case:` become the
    task's policy, a step `sink:` becomes the last task's sink, step `args:` merge into each
    task's `args`.
    """

    name: str
    desc: str | None = None
    admit: list[Rule] | None = None  # first match wins; do == "continue" admits, anything else skips
    tasks: list[Task] = Field(default_factory=list)  # empty: a routing-only step, run inside on_event
    loop: Loop | None = None
    vars: dict[str, Any] = Field(default_factory=dict)  # rendered after the step, into vars.*
    set_ctx: dict[str, Any] = Field(default_factory=dict)  # rendered after the step, into ctx.*
    # step-level `result: {output_select: ...}` / `output: {select: ...}`: the part of the result
    # the step keeps (a dotted path, or a template with `result` in scope); None keeps it whole
    result_select: str | None = None
    result_hints: dict[str, Any] = Field(default_factory=dict)  # the other hints, advisory, as written
    next: Routing = Field(default_factory=Routing)
    join: str | None = None  # set by the compiler: where the branches this step forks meet again
    line: int | None = None
    tags: list[str] = Field(default_factory=list)  # metadata only: shown by compile, never routed on


class Plan(_Model):
    """A playbook, normalised. The only input the engine reads."""

    name: str
    path: str | None = None
    api_version: str
    dialect: Literal["legacy", "v2case", "canonical"]
    description: str | None = None
    workload: dict[str, Any] = Field(default_factory=dict)
    ctx: dict[str, Any] = Field(default_factory=dict)
    entry_step: str
    final_step: str | None = None
    no_next_is_error: bool = False
    # `executor.spec.strict_templates`: an undefined name fails wherever it is rendered (by default
    # tool args, sinks, set/vars and arcs render leniently, as NoETL renders them)
    strict_templates: bool = False
    # `executor.spec.webhook`: called once when an execution of this playbook ends with one of its
    # events (noetl_celery/observe/webhooks.py), instead of NOETL_WEBHOOK_URL
    webhook: str | None = None
    # its `events` (None: failed and cancelled) and `secret` (a credential name: the HMAC key of
    # the X-Noetl-Signature header), when the webhook is given as a mapping
    webhook_events: list[str] | None = None
    webhook_secret: str | None = None
    steps: dict[str, Step]
    source_file: str | None = None
    timeout: float | None = None  # seconds the whole execution may take (None: no limit)
    tags: list[str] = Field(default_factory=list)  # metadata.tags: shown by compile, never acted on

    def step(self, name: str) -> Step:
        return self.steps[name]
