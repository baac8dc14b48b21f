"""core: the ground floor every room stands on: the errors (errors), the names of event types,
payload kinds and error kinds (vocabulary), JSON-safe values (jsonable), the time inside an id
(id_time), lazy imports of optional libraries (lazy) and the shapes of a SQL result (sql_result).

It imports nothing of the package outside itself, and no library beyond the standard one, so any
room may import it (`.importlinter`, contract core).
"""
