"""The Celery adapters: what a worker tells Celery about an attempt (verdicts), a lost pool
process, eager attempts and the fork hygiene of pool processes. Every Celery and billiard import
of the engine lives here, so the decision and the attempt run without Celery.
"""
