"""The decision: on_event's side of the engine, what runs next and what is recorded.

No Celery here: the decider, its loop, cursor and sub-playbook strategies, routing, retry policy,
pagination and micro-batching run in-process (tests, replay) as on a worker.
"""
