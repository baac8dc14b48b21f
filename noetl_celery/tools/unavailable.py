"""NoETL tool kinds a worker of this engine cannot run, and why (shown at validate, on one line).

Decides nothing at run time: a playbook naming one of these kinds never compiles. Each reason is
one sentence, `<why>; <what to use instead>`, which validate shows as `tool kind '<kind>' cannot
run here: <reason>`. A kind listed here that a third-party package registers (entry point group
`noetl_celery.tools`) is no longer refused: the registry wins.
"""

from __future__ import annotations

UNAVAILABLE_KINDS: dict[str, str] = {
    "container": (
        "it starts a container image as a Kubernetes job and a worker has no container runtime; "
        "run the program with the shell tool, or call it as a service with the http tool"
    ),
    "rhai": ("it runs Rhai scripts, for which a Python worker has no runtime; write the logic with the python tool"),
    "agent": (
        "it runs NoETL's AI agent framework executors, which this engine does not ship; "
        "call the model's API with the http tool, or the agent's library from the python tool"
    ),
    "ollama_bridge": (
        "it talks to NoETL's Ollama bridge service, which this engine does not ship; "
        "call Ollama's HTTP API with the http tool"
    ),
    "ibkr": (
        "it drives Interactive Brokers' gateway through NoETL's own client, which this engine does not ship; "
        "call the gateway's web API with the http tool"
    ),
    "gke": (
        "it manages Google Kubernetes Engine with a cloud identity a worker does not have; "
        "run gcloud or kubectl from the shell tool with the credential in its env"
    ),
    "script": (
        "it runs the script as a Kubernetes Job, which workers do not start; "
        "run it with the python tool and its script: source"
    ),
}
