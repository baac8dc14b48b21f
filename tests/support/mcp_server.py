"""A real MCP server for the mcp tool's tests (the `mcp` SDK's MCPServer): `add`, `echo_env`
(reads an environment variable the client passed), `fail` (a tool error) and `sleep`.

    python -m tests.support.mcp_server stdio
    python -m tests.support.mcp_server http PORT     # streamable HTTP on 127.0.0.1:PORT/mcp
"""

from __future__ import annotations

import os
import sys
import time

from mcp.server.mcpserver import MCPServer

server = MCPServer("noetl-test-tools")


@server.tool()
def add(a: int, b: int) -> int:
    """The sum of a and b."""
    return a + b


@server.tool()
def echo_env(name: str) -> str:
    """The value of the server's environment variable `name` (empty when unset)."""
    return os.environ.get(name, "")


@server.tool()
def fail(reason: str) -> str:
    """Always raises, with `reason`."""
    raise ValueError(reason)


@server.tool()
def sleep(seconds: float) -> str:
    """Sleeps, then answers."""
    time.sleep(seconds)
    return "slept"


def main(argv: list[str]) -> None:
    if argv[:1] == ["http"]:
        server.run("streamable-http", host="127.0.0.1", port=int(argv[1]))
    else:
        server.run("stdio")


if __name__ == "__main__":
    main(sys.argv[1:])
