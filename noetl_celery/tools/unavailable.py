"""NoETL tool kinds this engine refuses, and why (the reason is shown at validate, on one line).

Decides nothing at run time: a playbook naming one of these kinds never compiles. A kind listed
here that a third-party package registers (entry point group `noetl_celery.tools`) is no longer
refused: the registry wins.
"""

from __future__ import annotations

UNAVAILABLE_KINDS: dict[str, str] = {
    "snowflake": "it needs a Snowflake account and its connector, which this engine does not ship",
    "gke": "it drives Google Kubernetes Engine, which this engine does not manage",
    "container": "running containers needs a container runtime, which workers do not control",
    "shell": "running shell commands on workers is not allowed; use the python tool",
}
