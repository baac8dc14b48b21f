"""The in-process harness for the project's tests: `noetl_celery.testing`'s machinery (the same
public module a playbook author's tests use), and `run_playbook` in the (exit code, status) form
the engine fixtures compare with `noetl-celery run --json`."""

from noetl_celery.testing.harness import (
    MAX_DISPATCHES,
    NODE,
    Harness,
    Runaway,
    cli_sets,
    environment,
    exit_code,
    run_playbook,
)

__all__ = ["MAX_DISPATCHES", "NODE", "Harness", "Runaway", "cli_sets", "environment", "exit_code", "run_playbook"]
