"""templates: the one sandboxed Jinja2 environment that renders playbook values (render) and the
budget of time and size a rendering may spend (budget).

It stands on config and core: it imports no engine, store, tool, playbook model (dsl, compiler),
app or command line (`.importlinter`, contract templates).
"""
