"""Tool kinds: each module registers one kind with `tools.base.register`.

Importing this package registers nothing by itself; `tools.base.get_tool` imports the built-in
tool modules on first use. Keep this file free of imports so tool modules can import `base`.
"""
