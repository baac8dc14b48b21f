"""The `mcp` tool: one Model Context Protocol request to an MCP server, through the `mcp` SDK's
client, over streamable HTTP or stdio.

Config (rendered), NoETL's forms: the server by `endpoint` (aliases `url`, `server_url`,
`base_url`), else `mcp_servers[<server>]` of the workload, else the environment
(`NOETL_MCP_<SERVER>_URL`, `NOETL_MCP_<SERVER>_ENDPOINT`, then `NOETL_MCP_URL`), where `server`
(default "kubernetes", as in NoETL) names it; or, this engine's own, a local server started for
the call: `command` (a list, or a string split like a shell would) with `env` and `cwd`, spoken to
over its stdin/stdout and stopped when the call ends. `method` (alias `action`): `tools/call`
(default: `tool`/`tool_name` with `arguments`/`args`, a mapping or a JSON text), `tools/list`,
`resources/list`, `resources/read` (`params.uri`), `prompts/list`, `prompts/get`
(`params.name`, `params.arguments`), `ping`, or `health` (GET `<endpoint>/healthz`, no MCP
session). `headers` and `auth:` (a credential, applied as the http tool applies it) go with every
HTTP request; `timeout_seconds` bounds each request (default `NOETL_MCP_REQUEST_TIMEOUT_SECONDS`
or 60 s); `protocol_version`, `client_name`, `client_version`, `capabilities` and `request_id`
are accepted as NoETL's (the SDK negotiates the protocol itself).

Data, NoETL's shape: `{status: "ok", server, endpoint, method, tool, arguments, text, result,
initialize}`; `text` joins the text items of the result's `content`, `result` is the MCP result
as JSON (camelCase keys, as on the wire), `initialize` the server's name, version and protocol.
Errors (the attempt fails; NoETL's tool returned `status: "error"` as a success instead, which a
policy here reads as the step's error): kind "mcp" for a tool whose result has `isError` (its
result in the error's data) or an MCP error answer, "connection" for a server that cannot be
reached (retryable), "invalid_args" for a request the tool cannot make.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import tempfile
from collections.abc import Awaitable, Callable
from typing import IO, Any, TextIO, cast

import requests

from noetl_celery.config import settings as noetl_settings
from noetl_celery.core.vocabulary import ToolErrorKind
from noetl_celery.tools.base import Outcome, ToolCall, register
from noetl_celery.tools.http import CredentialShapeError, auth_headers
from noetl_celery.tools.settings import ToolSettings

DEFAULT_SERVER = "kubernetes"  # NoETL's default `server` name
MCP_ERROR = "mcp"
STDERR_TAIL = 2000  # characters of a stdio server's stderr quoted in an error
_ENDPOINT_KEYS = ("endpoint", "url", "server_url", "base_url")
# the environment a stdio server inherits besides its own `env` (never the worker's credentials)
_INHERITED_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "PYTHONPATH", "VIRTUAL_ENV", "SYSTEMROOT")


class McpSettings(ToolSettings):
    endpoint: str | None = None
    url: str | None = None
    server_url: str | None = None
    base_url: str | None = None
    server: str | None = None
    method: str | None = None
    action: str | None = None
    tool: str | None = None
    tool_name: str | None = None
    arguments: dict[str, Any] | str | None = None
    params: dict[str, Any] | str | None = None
    headers: dict[str, str] | None = None
    command: list[str] | str | None = None
    env: dict[str, str] | None = None
    cwd: str | None = None
    timeout_seconds: float | None = None
    request_id: int | None = None
    protocol_version: str | None = None
    client_name: str | None = None
    client_version: str | None = None
    capabilities: dict[str, Any] | None = None


class McpRequestError(Exception):
    """A request the tool cannot make as configured (kind invalid_args)."""


def server_name(cfg: dict[str, Any]) -> str:
    return str(cfg.get("server") or DEFAULT_SERVER)


def resolve_endpoint(cfg: dict[str, Any], context: dict[str, Any]) -> str | None:
    """The server's URL: the config, the workload's `mcp_servers`, then the environment."""
    endpoint = next((cfg[key] for key in _ENDPOINT_KEYS if cfg.get(key)), None)
    server = server_name(cfg)
    if not endpoint:
        servers = context.get("mcp_servers") or (context.get("workload") or {}).get("mcp_servers")
        entry = servers.get(server) if isinstance(servers, dict) else None
        endpoint = entry.get("endpoint") or entry.get("url") if isinstance(entry, dict) else entry
    if not endpoint:
        configured = noetl_settings.load()
        slug = "".join(ch if ch.isalnum() else "_" for ch in server.upper())
        named = configured.mcp_servers
        prefix = noetl_settings.MCP_SERVER_PREFIX
        endpoint = named.get(f"{prefix}{slug}_URL") or named.get(f"{prefix}{slug}_ENDPOINT") or configured.mcp_url
    return str(endpoint).rstrip("/") if endpoint else None


def request_timeout(cfg: dict[str, Any]) -> float:
    value = cfg.get("timeout_seconds") or noetl_settings.load().mcp_request_timeout
    try:
        return max(0.1, float(value))
    except (TypeError, ValueError):
        raise McpRequestError(f"timeout_seconds must be a number of seconds, not {value!r}") from None


def _object(value: Any, key: str) -> dict[str, Any]:
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise McpRequestError(f"{key} must be a mapping or a JSON object text: {exc}") from None
    if not isinstance(value, dict):
        raise McpRequestError(f"{key} must be a mapping, not {type(value).__name__}")
    return value


def _health_url(endpoint: str) -> str:
    base, _, path = endpoint.partition("://")
    host, _, rest = path.partition("/")
    rest = "/" + rest if rest else ""
    rest = "" if rest in ("/mcp", "/sse", "/message") else rest
    return f"{base}://{host}{rest}/healthz"


def _stdio_transport(cfg: dict[str, Any], errlog: IO[str]) -> Any:
    """The server `command` started for the call; its stderr goes to `errlog` (a worker's own
    stderr may be no file at all: Celery replaces it with a logging proxy)."""
    from mcp.client.stdio import StdioServerParameters, stdio_client

    command = cfg["command"]
    argv = shlex.split(command) if isinstance(command, str) else [str(part) for part in command]
    if not argv:
        raise McpRequestError("command is empty")
    env = {name: os.environ[name] for name in _INHERITED_ENV if name in os.environ}
    env.update({str(k): str(v) for k, v in (cfg.get("env") or {}).items()})
    parameters = StdioServerParameters(command=argv[0], args=argv[1:], env=env, cwd=cfg.get("cwd"))
    return stdio_client(parameters, errlog=cast(TextIO, errlog))


def _http_transport(endpoint: str, cfg: dict[str, Any], credential: Any, timeout: float) -> Any:
    from mcp.client.streamable_http import create_mcp_http_client, streamable_http_client

    headers = {str(k): str(v) for k, v in (cfg.get("headers") or {}).items()}
    try:
        headers.update(auth_headers(credential))
    except CredentialShapeError as exc:
        raise McpRequestError(str(exc)) from None
    http_client = create_mcp_http_client(headers=headers or None)
    http_client.timeout = timeout  # type: ignore[assignment]  # the SDK's client takes a float
    return streamable_http_client(endpoint, http_client=http_client)


def _dump(value: Any) -> Any:
    return value.model_dump(mode="json", by_alias=True, exclude_none=True) if hasattr(value, "model_dump") else value


def _text_of(result: dict[str, Any]) -> str:
    texts = [str(item["text"]) for item in result.get("content") or () if isinstance(item, dict) and "text" in item]
    return "\n".join(texts) if texts else json.dumps(result, default=str, separators=(",", ":"))


_METHODS = ("tools/call", "tools/list", "resources/list", "resources/read", "prompts/list", "prompts/get", "ping")


def _method_name_known(method: str) -> None:
    if method not in (*_METHODS, "health"):
        raise McpRequestError(f"method {method!r} is not one this tool sends (known: {', '.join(_METHODS)}, health)")


def _method_call(client: Any, method: str, cfg: dict[str, Any]) -> tuple[Callable[[], Awaitable[Any]], Any, Any]:
    """The client call for `method`, and the tool name and arguments it sends (None but for tools/call)."""
    params = _object(cfg.get("params"), "params")
    if method == "tools/call":
        name = cfg.get("tool") or cfg.get("tool_name")
        if not name:
            raise McpRequestError("tools/call needs `tool` (the MCP tool's name)")
        arguments = _object(cfg["arguments"] if cfg.get("arguments") is not None else cfg.get("args"), "arguments")
        return lambda: client.call_tool(str(name), arguments), str(name), arguments
    calls: dict[str, Callable[[], Awaitable[Any]]] = {
        "tools/list": client.list_tools,
        "resources/list": client.list_resources,
        "prompts/list": client.list_prompts,
        "ping": client.send_ping,
        "resources/read": lambda: client.read_resource(str(params.get("uri") or "")),
        "prompts/get": lambda: client.get_prompt(str(params.get("name") or ""), params.get("arguments")),
    }
    return calls[method], None, None


async def _session_request(server: Any, method: str, cfg: dict[str, Any], timeout: float) -> dict[str, Any]:
    from mcp.client.client import Client

    async with Client(server, read_timeout_seconds=timeout) as client:
        call, tool, arguments = _method_call(client, method, cfg)
        result = _dump(await asyncio.wait_for(call(), timeout))
        result = result if isinstance(result, dict) else {"value": result}
        info = client.server_info
        initialize = {"protocolVersion": client.protocol_version, "serverInfo": _dump(info) if info else None}
        return {"tool": tool, "arguments": arguments, "result": result, "initialize": initialize}


@register(
    "mcp",
    fields={*McpSettings.model_fields, "args"},
    settings=McpSettings,
    extra="mcp",
    modules=("mcp",),
)
def run_mcp(call: ToolCall) -> Outcome:
    """Send the one request the config names and return NoETL's result shape."""
    cfg = call.config
    method = str(cfg.get("method") or cfg.get("action") or "tools/call")
    server = server_name(cfg)
    with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as errlog:
        try:
            timeout = request_timeout(cfg)
            _method_name_known(method)
            target, endpoint = _target(call, server, timeout, errlog, http=method != "health")
            head = {"status": "ok", "server": server, "endpoint": endpoint, "method": method}
            if method == "health":
                return _health(head, endpoint, timeout)
            answer = asyncio.run(_session_request(target, method, cfg, timeout))
        except McpRequestError as exc:
            return Outcome.fail(ToolErrorKind.INVALID_ARGS, f"mcp: {exc}")
        except Exception as exc:  # the SDK's own errors, the transport's, a timeout
            return _failure(exc, server, method, _tail(errlog))
    data = {**head, **answer, "text": _text_of(answer["result"])}
    if answer["result"].get("isError"):
        return Outcome.fail(MCP_ERROR, f"mcp: {method} {answer['tool'] or ''}: {data['text']}".strip(), data=data)
    return Outcome.ok(data)


def _target(call: ToolCall, server: str, timeout: float, errlog: IO[str], http: bool) -> tuple[Any, str]:
    """What the SDK's client connects to (a stdio server's transport, or an HTTP one when `http`),
    and the endpoint as the result names it."""
    cfg = call.config
    if cfg.get("command"):
        return _stdio_transport(cfg, errlog), f"stdio:{cfg['command']}"
    endpoint = resolve_endpoint(cfg, call.context)
    if endpoint is None:
        raise McpRequestError(f"no endpoint for MCP server '{server}' (give endpoint, command or NOETL_MCP_URL)")
    return (_http_transport(endpoint, cfg, call.credential, timeout) if http else None), endpoint


def _health(head: dict[str, Any], endpoint: str, timeout: float) -> Outcome:
    if endpoint.startswith("stdio:"):
        return Outcome.fail(ToolErrorKind.INVALID_ARGS, "mcp: health is an HTTP probe; a stdio server has none")
    try:
        response = requests.get(_health_url(endpoint), timeout=timeout)
    except requests.RequestException as exc:
        return Outcome.fail(ToolErrorKind.CONNECTION, f"mcp: health of {endpoint}: {exc}", True)
    if response.status_code >= 400:
        return Outcome.fail(MCP_ERROR, f"mcp: health of {endpoint}: HTTP {response.status_code}", True)
    return Outcome.ok({**head, "healthy": True, "text": response.text[:4096]})


def _tail(errlog: IO[str], limit: int = STDERR_TAIL) -> str:
    errlog.seek(0)
    return errlog.read()[-limit:].strip()


def _failure(exc: BaseException, server: str, method: str, stderr: str) -> Outcome:
    """An exception of the SDK or its transport as the attempt's error (group errors unwrapped),
    with the end of a stdio server's stderr."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    if isinstance(exc, McpRequestError):
        return Outcome.fail(ToolErrorKind.INVALID_ARGS, f"mcp: {exc}")
    text = f"mcp: {method} on server '{server}': {type(exc).__name__}: {exc}"
    text += f"; the server's stderr ends: {stderr}" if stderr else ""
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return Outcome.fail(ToolErrorKind.TIMEOUT, text, True)
    if type(exc).__name__ == "MCPError":
        return Outcome.fail(MCP_ERROR, text)
    return Outcome.fail(ToolErrorKind.CONNECTION, text, True)
