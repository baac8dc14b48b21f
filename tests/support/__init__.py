"""Test support: real Redis/PostgreSQL servers (`services`) and real Celery workers (`workers`)."""
