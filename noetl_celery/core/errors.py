"""Errors a user of noetl_celery can see and catch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a playbook: where it is and what is wrong."""

    file: str
    line: int | None
    path: str
    message: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line else self.file
        return f"{where}: {self.path}: {self.message}" if self.path else f"{where}: {self.message}"


class NoetlError(Exception):
    """Base class of every error noetl_celery raises on purpose."""


class PlaybookError(NoetlError):
    """A playbook is invalid. Carries every problem found, each with file, line and key path."""

    def __init__(self, problems: list[Problem]):
        self.problems = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


class ConfigurationError(NoetlError):
    """The environment (broker, database, credentials) is not usable as configured."""


class CredentialError(NoetlError):
    """A credential named by `auth:` cannot be resolved."""


class TemplateError(NoetlError):
    """A template failed to render; names the template and the reason."""


class ExecutionNotFound(NoetlError):
    """No execution with that id in the event store."""


class AttemptFailed(NoetlError):
    """One attempt of a task failed; raised by the worker only after on_event has recorded the
    outcome and published its decision, so that Celery (and Flower) mark the task FAILURE while
    the message is still acknowledged (task_acks_on_failure_or_timeout).

    `user_traceback`: the traceback of the playbook's code (a python task), shown by Flower in
    place of the engine's (engine/worker_loss.AttemptRequest.on_failure)."""

    def __init__(self, text: str, user_traceback: str | None = None):
        super().__init__(text)
        self.user_traceback = user_traceback


class BrokerUnavailable(NoetlError):
    """The broker could not be reached to enqueue work."""


class Interrupted(NoetlError):
    """Ctrl-C on a command that runs an execution in its own process (`run`, embedded `resume`):
    the execution was cancelled (`execution_id` None when it had not started)."""

    def __init__(self, execution_id: int | None):
        super().__init__(f"interrupted; execution {execution_id} cancelled" if execution_id else "interrupted")
        self.execution_id = execution_id


class WebhookNotDelivered(NoetlError):
    """A webhook delivery attempt failed (it is tried again, or was the last): the `noetl.notify`
    task ends as a failure, so Flower shows it as one."""
