"""Playbooks the tests build with a parameter the DSL does not template (a retry's delay, a
step's timeout)."""

from __future__ import annotations

import textwrap


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


def marked_chain(name: str, steps: list[str], *, last: str = "", timeout: float | None = None) -> str:
    """Python steps one after another, each appending its name to the file named by the workload's
    `marks` when it runs (one line per run). `last`: more code for the last step, which may read
    the workload's `die_once` too; `timeout`: the last step's timeout (its kind's default if None).
    """
    text = f"""
apiVersion: noetl.io/v10
kind: Playbook
metadata: {{name: {name}}}
workload: {{marks: "", die_once: ""}}
workflow:
"""
    for index, step in enumerate(steps):
        final = index == len(steps) - 1
        code = f'with open(marks, "a") as f:\n    f.write("{step}\\n")\n' + (last if final else "")
        text += f"""  - step: {step}
    tool:
      kind: python
      args: {{marks: "{{{{ marks }}}}", die_once: "{{{{ die_once }}}}"}}
      code: |
{textwrap.indent(code + f"result = {index + 1}", " " * 8)}
"""
        if final and timeout is not None:
            text += f"      timeout: {timeout:g}\n"
        if not final:
            text += f"    next: {{arcs: [{{step: {steps[index + 1]}}}]}}\n"
    return text


def range_loop(name: str, *, workload: str, max_in_flight: int, tool: str, path: str | None = None) -> str:
    """A `start` step that returns `list(range(n))` and a `work` step looping over it in parallel
    (iterator `x`, at most `max_in_flight` at once). `workload`: the workload's mapping in flow
    style (with `n`); `tool`: the YAML under the loop's `tool:`, each line indented 6 spaces;
    `path`: the playbook's catalog path."""
    metadata = f"{{name: {name}, path: {path}}}" if path else f"{{name: {name}}}"
    return f"""apiVersion: noetl.io/v10
kind: Playbook
metadata: {metadata}
workload: {workload}
workflow:
  - step: start
    tool: {{kind: python, args: {{n: "{{{{ n }}}}"}}, code: "result = list(range(n))"}}
    next:
      arcs: [{{step: work}}]
  - step: work
    loop: {{in: "{{{{ start }}}}", iterator: x, spec: {{mode: parallel, max_in_flight: {max_in_flight}}}}}
    tool:
{tool}"""
