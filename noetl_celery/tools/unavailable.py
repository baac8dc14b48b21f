"""NoETL tool kinds this engine refuses, and why (the reason is shown at validate, on one line).

Decides nothing at run time: a playbook naming one of these kinds never compiles. A kind listed
here that a third-party package registers (entry point group `noetl_celery.tools`) is no longer
refused: the registry wins.
"""

from __future__ import annotations

UNAVAILABLE_KINDS: dict[str, str] = {
    "snowflake": "it needs a Snowflake account and its connector, which this engine does not ship",
    "gke": "it drives Google Kubernetes Engine, which this engine does not manage; call the GKE API with the http tool",
    "container": "running containers needs a container runtime, which workers do not control; "
    "ask the platform that runs them (a Kubernetes Job, Cloud Run) with the http tool",
    "shell": "running shell commands on workers is not allowed; use the python tool",
    "script": "it runs the script as a Kubernetes Job, which workers do not start; "
    "run it with the python tool and its script: source",
    "rhai": "workers have no Rhai runtime; write the script for the python tool",
    "agent": "it runs an agent framework hosted by NoETL's own runtime; "
    "call a NoETL agent playbook with kind: playbook, another agent's service with the http or mcp tool",
    "ollama_bridge": "it needs NoETL's in-cluster Ollama bridge; call Ollama's API with the http tool",
    "ibkr": "it drives an Interactive Brokers gateway session that workers do not host; "
    "call the gateway's REST API with the http tool",
}
