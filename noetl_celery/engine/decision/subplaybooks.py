"""Sub-playbooks: on_event starts a child execution for a `playbook` task and finishes the task
when the child ends. No worker waits or polls for a child.

- Start (in the parent's decision): render the task's `path`/`input` (alias `args`)/`return_step`,
  resolve the path (catalog, then files), compile the child with the input over its workload,
  create its execution row (parent_execution_id, parent_event_id, the parent's task message to
  resume, depth) and send its start event. All in the parent's transaction: a redelivered
  parent event rolls back with its duplicate row and starts nothing twice.
- End (in the child's last decision): the child sends the parent an ordinary `outcome` event for
  the parent's task message (or, when that task has a sink, the task message itself with the
  child's outcome attached: a worker runs only the sink and reports as usual): ok with the
  `return_step` result (all results without one), or an
  error naming the child's id and error. The parent decides it like any attempt's outcome, so
  its policy may retry, which starts a new child.
- A child nested deeper than MAX_NESTING fails the parent's task (a playbook calling itself
  without end stops there).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from noetl_celery.compiler import compile_playbook, resolve
from noetl_celery.core import vocabulary as ev
from noetl_celery.core.errors import PlaybookError, TemplateError
from noetl_celery.core.vocabulary import DispatchKind, ErrorKind, PayloadKind
from noetl_celery.dsl.plan import Step, Task
from noetl_celery.engine.context import render_context
from noetl_celery.engine.decision.entries import CreateChildExecution
from noetl_celery.engine.ids import new_execution_id
from noetl_celery.engine.messages import Dispatch, OutcomeEvent, TaskMessage, sanitize
from noetl_celery.templates.render import plain, render_value
from noetl_celery.tools import playbook as playbook_tool

if TYPE_CHECKING:
    from noetl_celery.engine.decision.port import DecisionPort
    from noetl_celery.engine.decision.reads import Reads

PLAYBOOK_KIND = "playbook"
MAX_NESTING = 16  # sub-playbook levels below a top-level execution
EVENT_DISPATCH = DispatchKind.EVENT  # Dispatch.kind of an event for on_event (a child's start, its end)


def catalog_for(reads: Reads) -> resolve.Catalog:
    def lookup(path: str) -> resolve.Found | None:
        entry = reads.playbook(path)
        if entry is None:
            return None
        return resolve.Found(path=path, source=entry["source_file"] or f"catalog:{path}", text=entry["content"])

    return lookup


def _fail(decider: DecisionPort, message: TaskMessage, kind: str, text: str) -> None:
    """The task fails without a child: decided as the attempt's outcome (its policy applies)."""
    decider.on_outcome(message, {"status": "error", "error": {"kind": kind, "message": text}}, {})


def start_child(
    decider: DecisionPort, step: Step, task: Task, message: TaskMessage, key: str, record_start: bool, countdown: float
) -> None:
    context = render_context(decider.state, decider.scope_of(message, step))
    try:
        config = plain(render_value(task.config, context))
    except TemplateError as exc:
        _fail(decider, message, ErrorKind.TEMPLATE, str(exc))
        return
    path = config.get("path")
    if not isinstance(path, str) or not path:
        _fail(decider, message, ErrorKind.PLAYBOOK, f"playbook task needs a path, got {path!r}")
        return
    link = decider.reads.execution_link() or {}
    depth = int(link.get("depth") or 0) + 1
    if depth > MAX_NESTING:
        _fail(
            decider,
            message,
            ErrorKind.PLAYBOOK,
            f"sub-playbook nesting limit ({MAX_NESTING}) reached starting "
            f"{path!r}: does a playbook call itself without end?",
        )
        return
    try:
        found = resolve.find(path, decider.plan.source_file, catalog_for(decider.reads))
    except PlaybookError as exc:
        _fail(decider, message, ErrorKind.PLAYBOOK, f"sub-playbook {path!r} cannot be read: {exc}")
        return
    if found is None:
        _fail(decider, message, ErrorKind.PLAYBOOK, resolve.not_found_message(path, decider.plan.source_file))
        return
    child_input = playbook_tool.child_input(config)  # input:, args: or payload:
    if child_input is not None and not isinstance(child_input, dict):
        _fail(
            decider, message, ErrorKind.PLAYBOOK, f"playbook input must be a mapping, not {type(child_input).__name__}"
        )
        return
    try:
        plan = compile_playbook(
            found.source,
            text=found.text,
            overrides=child_input or {},
            catalog=catalog_for(decider.reads),
            seen=frozenset({path}),
        )
    except PlaybookError as exc:
        _fail(
            decider,
            message,
            ErrorKind.PLAYBOOK,
            f"sub-playbook {path!r} is invalid: " + "; ".join(str(p) for p in exc.problems[:5]),
        )
        return
    try:
        timeout = _child_timeout(config.get("timeout"), plan.timeout)
    except ValueError as exc:
        _fail(decider, message, ErrorKind.PLAYBOOK, str(exc))
        return
    child_id = new_execution_id()
    start_key = key + ".start" if record_start else message.parent_event_id
    parent_task = {
        "message": message.to_dict(),
        "return_step": config.get("return_step"),
        "path": path,
        "sink": task.sink is not None,
    }
    decider.apply(
        CreateChildExecution(
            execution_id=child_id,
            plan=plan.model_dump(mode="json"),
            workload=plan.workload,
            parent_event_id=start_key,
            parent_task=parent_task,
            depth=depth,
            timeout=timeout,
        )
    )
    if record_start:
        first = message.iteration is not None and message.seq == 0 and message.attempt == 1
        decider.record(
            ev.ITERATION_STARTED if first else ev.ACTION_STARTED,
            key + ".start",
            status="started",
            parent_event_id=message.parent_event_id,
            **decider.attempt_fields(step, task, message),
            context=sanitize({"element": message.element, "input": child_input}),
            meta={"child_execution_id": child_id, "path": path},
        )
    start = {"kind": PayloadKind.START, "execution_id": child_id}
    decider.send(Dispatch(kind=EVENT_DISPATCH, message=start, countdown=countdown, label=f"{step.name}:playbook"))


def _child_timeout(task_timeout: Any, playbook_timeout: float | None) -> float | None:
    """Seconds the child may run: the task's `timeout`, or the child playbook's own, the shorter
    of the two when both are given. Past it the sweeper fails the child (kind `timeout`) and the
    parent's task with it."""
    limits = [float(playbook_timeout)] if playbook_timeout else []
    if task_timeout is not None:
        if isinstance(task_timeout, bool) or not isinstance(task_timeout, (int, float)) or task_timeout <= 0:
            raise ValueError(f"playbook task timeout must be a positive number of seconds, got {task_timeout!r}")
        limits.append(float(task_timeout))
    return min(limits) if limits else None


def child_end(
    link: dict[str, Any] | None, execution_id: int, status: str, results: dict[str, Any], error: Any
) -> Dispatch | None:
    """The outcome event a finished child sends its parent (None for a top-level execution);
    `link`: the child's execution link (`Reads.execution_link`)."""
    parent_task = (link or {}).get("parent_task")
    if not link or not parent_task or link.get("parent_execution_id") is None:
        return None
    return_step = parent_task.get("return_step")
    child = {"execution_id": execution_id, "path": parent_task.get("path"), "status": status}
    if status == "completed":
        data = results.get(return_step) if return_step else results
        outcome: dict[str, Any] = {"status": "ok", "data": data, "meta": {"child": child}}
    else:
        # a failure deep in a chain of children is reported once, from where it happened
        cause: dict[str, Any] = error if isinstance(error, dict) else {"message": str(error)}
        root: dict[str, Any] = cause.get("root") or {k: cause.get(k) for k in ("kind", "message") if cause.get(k)}
        outcome = {
            "status": "error",
            "meta": {"child": child},
            "error": {
                "kind": ErrorKind.PLAYBOOK,
                "child_execution_id": execution_id,
                "root": root,
                "message": f"sub-playbook {parent_task.get('path')!r} (execution {execution_id}) "
                f"{status}: {root.get('message')}",
            },
        }
    if parent_task.get("sink"):  # the parent's task writes the child's result: a worker runs its sink
        message = TaskMessage.from_dict(parent_task["message"]).evolve(child=outcome)
        return Dispatch.task(message, label="child.sink")
    payload = OutcomeEvent(
        link["parent_execution_id"], parent_task["message"], outcome, {"worker": f"execution:{execution_id}"}
    ).to_dict()
    return Dispatch(kind=EVENT_DISPATCH, message=payload, label="child.done")
