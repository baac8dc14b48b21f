"""The execution dashboard (`noetl-celery dashboard`): server.py serves it, layout.py draws it."""
