"""config: what the process is told: every NOETL_* variable (settings), the bounds of a run
(limits), the credentials a playbook names (credentials), and the secret values to mask
(secret_registry, secret_values).

It stands on core only: it imports no engine, store, tool, template, playbook model, app or
command line, and no SQLAlchemy (`.importlinter`, contracts config and configuration).
"""
