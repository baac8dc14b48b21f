"""Playbooks the tests build with a parameter the DSL does not template (a retry's delay)."""

from __future__ import annotations


def retry_once(name: str, *, delay: float = 0, then: str | None = None) -> str:
    """One python step whose first attempt raises and whose policy retries it once after `delay`
    seconds (the second attempt returns its number); with `then`, a step of that name follows,
    returning its own name."""
    text = f"""
apiVersion: noetl.io/v10
kind: Playbook
metadata: {{name: {name}}}
workflow:
  - step: start
    tool:
      kind: python
      args: {{attempt: "{{{{ _attempt }}}}"}}
      code: |
        if int(attempt) < 2:
            raise ValueError("first attempt fails")
        result = int(attempt)
      spec:
        policy:
          rules:
            - when: "{{{{ outcome.status == 'error' }}}}"
              then: {{do: retry, attempts: 2, backoff: fixed, delay: {delay}}}
"""
    if then:
        text += f"""    next: {{arcs: [{{step: {then}}}]}}
  - step: {then}
    tool: {{kind: python, code: "result = '{then}'"}}
"""
    return text
