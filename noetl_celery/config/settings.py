"""The one place that reads the environment (NOETL_*), with the embedded defaults.

Unset broker and database mean the embedded default: a SQLite file under NOETL_HOME and, for
`noetl-celery run`, an in-process worker on the in-memory broker. A separate worker process
needs a real broker and says so (see `require_broker`).

Credentials are read here too (NOETL_AUTH_<NAME>, NOETL_CREDENTIALS_FILE, NOETL_POSTGRES_DSN) but
never shown: the Settings repr leaves them out and `masked()` (what `noetl-celery config`
prints) hides every password and credential value.

A plain dataclass rather than pydantic-settings: every value has one reader with a message that
names the variable, the module imports nothing heavy (the DSL and `validate` use it), and the
credential variables are a prefix family that a model of fixed fields does not describe.

The limits on hostile or oversized input and output (NOETL_MAX_*_BYTES, NOETL_MAX_YAML_NODES,
NOETL_MAX_INPUT_DEPTH, NOETL_TEMPLATE_*) are read here too, by `limit()`: `noetl_celery.config.limits`
asks for each one when it is used (so a running worker and the CLI agree), and `load()` reads
them with the rest so that a bad value is refused up front and `noetl-celery config` shows them.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from noetl_celery.config import secret_registry
from noetl_celery.core.errors import ConfigurationError

DEFAULT_HOME = "~/.noetl"  # where the embedded SQLite event store lives
DEFAULT_TASK_QUEUE = "noetl.tasks"  # tool calls
DEFAULT_EVENT_QUEUE = "noetl.events"  # on_event
DEFAULT_VISIBILITY_TIMEOUT = 3600  # seconds; Redis redelivers an unacked message after this
DEFAULT_MAX_COUNTDOWN = 600  # seconds a countdown is held by the broker; longer waits are re-checked
DEFAULT_CONSUMER_TIMEOUT = 1800  # seconds; RabbitMQ's default consumer_timeout (closes the channel of
# a consumer that holds an unacknowledged message longer, an ETA message held by a worker included)
AMQP_SCHEMES = ("amqp", "amqps", "pyamqp", "librabbitmq")  # broker URL schemes of RabbitMQ
DEFAULT_RESTORE_INTERVAL = 10  # seconds between sweeps that hand out messages of dead consumers
DEFAULT_SWEEP_INTERVAL = 5.0  # seconds between sweeps for overdue attempts (0: no sweeper)
DEFAULT_SWEEP_TIMEOUT = 10.0  # seconds: PostgreSQL ends a sweep transaction stuck longer (a frozen sweeper)
DEFAULT_CLOCK_SKEW_WARN = 2.0  # seconds a process's clock may differ from the store's before it warns (once)
DEFAULT_MAX_REPUBLISHES = 3  # times an overdue attempt is published again before it is `lost`
DEFAULT_MAX_DELIVERIES = 3  # deliveries of a task that kill its worker process before `worker_lost`
DEFAULT_SCHEDULE_GRACE = 10.0  # seconds a fire time may be late and still run (older: missed; schedules.py)
EMBEDDED_BROKER = "memory://localhost/"
AUTH_PREFIX = "NOETL_AUTH_"  # NOETL_AUTH_<NAME>: the credential <name> (JSON object or string)
CREDENTIALS_FILE_ENV = "NOETL_CREDENTIALS_FILE"  # JSON/YAML file: credential name -> credential
POSTGRES_DSN_ENV = "NOETL_POSTGRES_DSN"  # the postgres tool's connection when a task names no auth
DUCKDB_DIR_ENV = "NOETL_DUCKDB_DIR"  # where the duckdb tool keeps its database files
DEFAULT_DUCKDB_DIR = Path(tempfile.gettempdir()) / "noetl-duckdb"
MCP_URL_ENV = "NOETL_MCP_URL"  # the mcp tool's server when a step names none (tools/mcp.py)
MCP_SERVER_PREFIX = "NOETL_MCP_"  # NOETL_MCP_<SERVER>_URL / _ENDPOINT: the URL of the mcp server <server>
MCP_TIMEOUT_ENV = "NOETL_MCP_REQUEST_TIMEOUT_SECONDS"  # seconds per MCP request (default 60, as NoETL's)
DEFAULT_MCP_TIMEOUT = 60.0
ARTIFACT_DIR_ENV = "NOETL_ARTIFACT_DIR"  # the folder a relative artifact location is under (tools/artifact.py)
PLAYBOOK_PATH_ENV = "NOETL_PLAYBOOK_PATH"  # folders (os.pathsep-separated) searched for sub-playbooks
CORPUS_DIR_ENV = "NOETL_CORPUS_DIR"  # NoETL playbooks the conformance tests compile and run
DEFAULT_CORPUS_DIR = "../shared/noetl-corpus"  # relative to the source tree's root
MAX_RESULT_BYTES_ENV = "NOETL_MAX_RESULT_BYTES"  # a result, error or body stored in an event row or sent
DEFAULT_MAX_RESULT_BYTES = 1_000_000  # bytes of JSON per stored result / error / body
MAX_PLAYBOOK_BYTES_ENV = "NOETL_MAX_PLAYBOOK_BYTES"  # a playbook file
DEFAULT_MAX_PLAYBOOK_BYTES = 4_000_000  # bytes of playbook text
API_MAX_BODY_ENV = "NOETL_API_MAX_BODY_BYTES"  # a request body the REST API reads; larger ones get 413
DEFAULT_API_MAX_BODY_BYTES = 8_000_000  # a playbook's text at its limit, base64-encoded (4/3), with room
MAX_YAML_NODES_ENV = "NOETL_MAX_YAML_NODES"  # YAML nodes built, aliases counted each time they are used
DEFAULT_MAX_YAML_NODES = 500_000
MAX_INPUT_DEPTH_ENV = "NOETL_MAX_INPUT_DEPTH"  # nesting levels of a playbook's YAML, a JSON body or a workload
DEFAULT_MAX_INPUT_DEPTH = 100
TEMPLATE_TIMEOUT_ENV = "NOETL_TEMPLATE_TIMEOUT"  # one template evaluation
DEFAULT_TEMPLATE_TIMEOUT = 5.0  # seconds
TEMPLATE_MAX_BYTES_ENV = "NOETL_TEMPLATE_MAX_BYTES"  # a string, list or number one template operation builds
DEFAULT_TEMPLATE_MAX_BYTES = 1_000_000  # bytes
MAX_LOOP_ITEMS_ENV = "NOETL_MAX_LOOP_ITEMS"  # elements of a loop's rendered collection
DEFAULT_MAX_LOOP_ITEMS = 1_000_000  # a collection above NOETL_MAX_RESULT_BYTES is stored once, by reference
MAX_STORED_BYTES_ENV = "NOETL_MAX_STORED_BYTES"  # a result stored by reference (outside its event row)
DEFAULT_MAX_STORED_BYTES = 256_000_000  # bytes of JSON; above it a result is truncated (a marker)
STORED_CACHE_BYTES_ENV = "NOETL_STORED_CACHE_BYTES"  # values stored by reference one process keeps decoded
DEFAULT_STORED_CACHE_BYTES = 64_000_000  # bytes of their JSON (least recently used dropped first)
LOOP_PAGE_BYTES_ENV = "NOETL_LOOP_PAGE_BYTES"  # a page of a loop collection above NOETL_MAX_RESULT_BYTES
DEFAULT_LOOP_PAGE_BYTES = 256_000  # bytes of JSON, about (store/blobs.py collection_form)
STORE_PIECE_BYTES_ENV = "NOETL_STORE_PIECE_BYTES"  # a value stored by reference, sent and read in pieces
DEFAULT_STORE_PIECE_BYTES = 262_144  # stored bytes (store/blobs.py: COPY above it, reads by it)
MAX_RESULT_DEPTH_ENV = "NOETL_MAX_RESULT_DEPTH"  # nesting levels of a stored result
DEFAULT_MAX_RESULT_DEPTH = 200
STRICT_TEMPLATES_ENV = "NOETL_STRICT_TEMPLATES"  # 1: undefined names fail wherever they are rendered
MAX_STEPS_ENV = "NOETL_MAX_STEPS"  # step runs one execution may start (an arc cycle without an end)
DEFAULT_MAX_STEPS = 100_000
# the newest message format this deployment writes (engine/messages.py): during a rolling upgrade,
# the newest the release being replaced reads, so that its workers refuse nothing
MESSAGE_FORMAT_ENV = "NOETL_MESSAGE_FORMAT"
DISABLED_TOOLS_ENV = "NOETL_DISABLED_TOOLS"  # tool kinds an operator turns off (comma-separated: shell,python)
NEWEST_MESSAGE_FORMAT = 3  # engine/messages.py READ_VERSION (a test holds them equal)
LIMIT_DEFAULTS: dict[str, float] = {  # limit variable -> its default (see `limit`)
    MAX_RESULT_BYTES_ENV: DEFAULT_MAX_RESULT_BYTES,
    MAX_PLAYBOOK_BYTES_ENV: DEFAULT_MAX_PLAYBOOK_BYTES,
    MAX_YAML_NODES_ENV: DEFAULT_MAX_YAML_NODES,
    MAX_INPUT_DEPTH_ENV: DEFAULT_MAX_INPUT_DEPTH,
    TEMPLATE_TIMEOUT_ENV: DEFAULT_TEMPLATE_TIMEOUT,
    TEMPLATE_MAX_BYTES_ENV: DEFAULT_TEMPLATE_MAX_BYTES,
    MAX_LOOP_ITEMS_ENV: DEFAULT_MAX_LOOP_ITEMS,
    MAX_RESULT_DEPTH_ENV: DEFAULT_MAX_RESULT_DEPTH,
    MAX_STEPS_ENV: DEFAULT_MAX_STEPS,
    MAX_STORED_BYTES_ENV: DEFAULT_MAX_STORED_BYTES,
    STORED_CACHE_BYTES_ENV: DEFAULT_STORED_CACHE_BYTES,
    LOOP_PAGE_BYTES_ENV: DEFAULT_LOOP_PAGE_BYTES,
    STORE_PIECE_BYTES_ENV: DEFAULT_STORE_PIECE_BYTES,
    MESSAGE_FORMAT_ENV: NEWEST_MESSAGE_FORMAT,
}
WHOLE_LIMITS = frozenset(LIMIT_DEFAULTS) - {TEMPLATE_TIMEOUT_ENV}  # counts of bytes or nodes
SOURCE_ROOT = Path(__file__).resolve().parents[2]  # the checkout (or site-packages) holding the package
MASK = "***"
# seconds; an attempt's time limits grow by the window, which its lease's margin absorbs
# (engine/deadlines.py, OUTCOME_MARGIN)
DEFAULT_EAGER_WINDOW = 2.0  # seconds: the fast path is the default (docs/benchmarks.md says what it costs)
MAX_EAGER_WINDOW = 5.0
PG_PREPARE_ENV = "NOETL_PG_PREPARE"  # auto | on | off: statements prepared on the store's connections
DEFAULT_METRICS_HOST = "0.0.0.0"  # a worker's metrics port: reachable by the Prometheus server
LOG_FORMATS = ("text", "json")
PG_PREPARE_MODES = ("auto", "on", "off")
DEFAULT_PG_PREPARE = "auto"


@dataclass(frozen=True, repr=False)
class Settings:
    broker_url: str | None
    database_url: str
    result_backend: str | None
    home: Path
    task_queue: str
    event_queue: str
    visibility_timeout: int
    restore_interval: int
    max_countdown: int
    prefetch_multiplier: int
    task_events: bool
    event_dispatch: str  # inline: run_task calls on_event in its own job; queue: via the on_event queue
    sweep_interval: float = DEFAULT_SWEEP_INTERVAL
    sweep_timeout: float = DEFAULT_SWEEP_TIMEOUT
    clock_skew_warn: float = DEFAULT_CLOCK_SKEW_WARN
    max_republishes: int = DEFAULT_MAX_REPUBLISHES
    max_deliveries: int = DEFAULT_MAX_DELIVERIES
    eager_task_events: bool = False  # a task event per eager attempt, for Flower (engine/transport/task_events.py)
    eager_window: float = DEFAULT_EAGER_WINDOW  # seconds a message may go on running the attempts it decides (0: off)
    consumer_timeout: int = DEFAULT_CONSUMER_TIMEOUT  # RabbitMQ only: the server's consumer_timeout
    corpus_dir: Path = Path(DEFAULT_CORPUS_DIR)
    duckdb_dir: Path = DEFAULT_DUCKDB_DIR
    artifact_dir: Path | None = None  # None: the worker's current folder
    mcp_url: str | None = None
    mcp_servers: Mapping[str, str] = field(default_factory=dict)  # NOETL_MCP_<SERVER>_URL/_ENDPOINT -> URL
    mcp_request_timeout: float = DEFAULT_MCP_TIMEOUT
    playbook_path: tuple[Path, ...] = ()
    credentials_file: Path | None = None
    postgres_dsn: str | None = field(default=None, repr=False)
    auth: Mapping[str, str] = field(default_factory=dict, repr=False)  # NOETL_AUTH_* variable -> raw value
    flower_url: str | None = None  # Flower's base URL: the dashboard links each attempt to its task page
    dashboard_url: str | None = None  # the dashboard's base URL: Flower's args line links each task to its execution
    dashboard_token: str | None = field(default=None, repr=False)  # enables the dashboard's cancel/resume
    api_max_body_bytes: int = DEFAULT_API_MAX_BODY_BYTES  # NOETL_API_MAX_BODY_BYTES (dashboard/rest.py)
    schedule_grace: float = DEFAULT_SCHEDULE_GRACE  # NOETL_SCHEDULE_GRACE (noetl_celery/schedules/__init__.py)
    webhook_url: str | None = field(default=None, repr=False)  # NOETL_WEBHOOK_URL (noetl_celery/observe/webhooks.py)
    webhook_secret: str | None = (
        None  # NOETL_WEBHOOK_SECRET: the credential whose value signs NOETL_WEBHOOK_URL's POSTs
    )
    metrics_port: int | None = None  # NOETL_METRICS_PORT: a worker's own /metrics (noetl_celery/observe/metrics.py)
    metrics_host: str = DEFAULT_METRICS_HOST  # NOETL_METRICS_HOST: the address it listens on
    log_format: str = "text"  # NOETL_LOG_FORMAT: text | json (noetl_celery/observe/log_format.py)
    # the limits as load() saw them; noetl_celery.config.limits reads each again (`limit`) when it is used
    max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES
    max_playbook_bytes: int = DEFAULT_MAX_PLAYBOOK_BYTES
    max_yaml_nodes: int = DEFAULT_MAX_YAML_NODES
    max_input_depth: int = DEFAULT_MAX_INPUT_DEPTH
    template_timeout: float = DEFAULT_TEMPLATE_TIMEOUT
    template_max_bytes: int = DEFAULT_TEMPLATE_MAX_BYTES
    max_loop_items: int = DEFAULT_MAX_LOOP_ITEMS
    max_result_depth: int = DEFAULT_MAX_RESULT_DEPTH
    max_steps: int = DEFAULT_MAX_STEPS
    message_format: int = NEWEST_MESSAGE_FORMAT  # the newest message format written (NOETL_MESSAGE_FORMAT)
    max_stored_bytes: int = DEFAULT_MAX_STORED_BYTES
    stored_cache_bytes: int = DEFAULT_STORED_CACHE_BYTES
    loop_page_bytes: int = DEFAULT_LOOP_PAGE_BYTES
    store_piece_bytes: int = DEFAULT_STORE_PIECE_BYTES
    strict_templates: bool = False  # as load() saw it; templates/render.py reads it again at each use
    pg_prepare: str = DEFAULT_PG_PREPARE  # NOETL_PG_PREPARE (store/prepared.py), read when an engine is made
    # the sweeper deletes the history of finished executions older than this (None: never; `prune`)
    prune_older_than: timedelta | None = None
    disabled_tools: frozenset[str] = frozenset()  # NOETL_DISABLED_TOOLS, read again at each use

    @property
    def amqp_broker(self) -> bool:
        """The broker is RabbitMQ (an amqp:// URL): no visibility timeout, a consumer timeout."""
        return is_amqp(self.broker_url)

    @property
    def embedded_database(self) -> bool:
        return self.database_url.startswith("sqlite")

    def __repr__(self) -> str:
        return "Settings(" + ", ".join(f"{k}={v!r}" for k, v in self.masked().items()) + ")"

    def masked(self) -> dict[str, str]:
        """Every setting by its variable name, as `noetl-celery config` shows it: passwords in
        URLs and every credential value replaced by ***."""
        shown = {
            "NOETL_HOME": str(self.home),
            "NOETL_BROKER_URL": mask_url(self.broker_url) if self.broker_url else f"(embedded: {EMBEDDED_BROKER})",
            "NOETL_DATABASE_URL": mask_url(self.database_url),
            "NOETL_RESULT_BACKEND": mask_url(self.result_backend) if self.result_backend else "(none)",
            "NOETL_TASK_QUEUE": self.task_queue,
            "NOETL_EVENT_QUEUE": self.event_queue,
            "NOETL_EVENT_DISPATCH": self.event_dispatch,
            "NOETL_VISIBILITY_TIMEOUT": f"{self.visibility_timeout} s",
            "NOETL_RESTORE_INTERVAL": f"{self.restore_interval} s",
            "NOETL_CONSUMER_TIMEOUT": f"{self.consumer_timeout} s",
            "NOETL_MAX_COUNTDOWN": f"{self.max_countdown} s",
            "NOETL_PREFETCH_MULTIPLIER": str(self.prefetch_multiplier),
            "NOETL_TASK_EVENTS": "on" if self.task_events else "off",
            "NOETL_EAGER_TASK_EVENTS": "on" if self.eager_task_events else "off",
            "NOETL_SWEEP_INTERVAL": f"{self.sweep_interval} s",
            "NOETL_SWEEP_TIMEOUT": f"{self.sweep_timeout:g} s",
            "NOETL_CLOCK_SKEW_WARN": f"{self.clock_skew_warn:g} s",
            "NOETL_MAX_REPUBLISHES": str(self.max_republishes),
            "NOETL_MAX_DELIVERIES": str(self.max_deliveries),
            "NOETL_EAGER_WINDOW": f"{self.eager_window:g} s" if self.eager_window else "off",
            "NOETL_PRUNE_OLDER_THAN": str(self.prune_older_than) if self.prune_older_than else "off",
            PG_PREPARE_ENV: self.pg_prepare,
            "NOETL_FLOWER_URL": mask_url(self.flower_url) if self.flower_url else "(none)",
            "NOETL_DASHBOARD_URL": mask_url(self.dashboard_url) if self.dashboard_url else "(none)",
            "NOETL_DASHBOARD_TOKEN": MASK if self.dashboard_token else "(none)",
            API_MAX_BODY_ENV: f"{self.api_max_body_bytes} bytes",
            "NOETL_SCHEDULE_GRACE": f"{self.schedule_grace:g} s",
            "NOETL_WEBHOOK_URL": webhook_shown(self.webhook_url),
            "NOETL_WEBHOOK_SECRET": f"credential {self.webhook_secret}" if self.webhook_secret else "(none: unsigned)",
            "NOETL_METRICS_PORT": str(self.metrics_port) if self.metrics_port is not None else "(off)",
            "NOETL_METRICS_HOST": self.metrics_host,
            "NOETL_LOG_FORMAT": self.log_format,
            MAX_RESULT_BYTES_ENV: f"{self.max_result_bytes} bytes",
            MAX_PLAYBOOK_BYTES_ENV: f"{self.max_playbook_bytes} bytes",
            MAX_YAML_NODES_ENV: str(self.max_yaml_nodes),
            MAX_INPUT_DEPTH_ENV: str(self.max_input_depth),
            TEMPLATE_TIMEOUT_ENV: f"{self.template_timeout:g} s",
            TEMPLATE_MAX_BYTES_ENV: f"{self.template_max_bytes} bytes",
            MAX_LOOP_ITEMS_ENV: str(self.max_loop_items),
            MAX_RESULT_DEPTH_ENV: f"{self.max_result_depth} levels",
            MAX_STEPS_ENV: str(self.max_steps),
            MESSAGE_FORMAT_ENV: str(self.message_format)
            + (" (the newest)" if self.message_format == NEWEST_MESSAGE_FORMAT else " (a rolling upgrade's)"),
            MAX_STORED_BYTES_ENV: f"{self.max_stored_bytes} bytes",
            STORED_CACHE_BYTES_ENV: f"{self.stored_cache_bytes} bytes",
            LOOP_PAGE_BYTES_ENV: f"{self.loop_page_bytes} bytes",
            STORE_PIECE_BYTES_ENV: f"{self.store_piece_bytes} bytes",
            STRICT_TEMPLATES_ENV: "on" if self.strict_templates else "off (NoETL's lenient rendering)",
            DUCKDB_DIR_ENV: str(self.duckdb_dir),
            ARTIFACT_DIR_ENV: str(self.artifact_dir) if self.artifact_dir else "(the current folder)",
            MCP_URL_ENV: mask_url(self.mcp_url) if self.mcp_url else "(none)",
            MCP_TIMEOUT_ENV: f"{self.mcp_request_timeout:g} s",
            **{name: mask_url(url) for name, url in sorted(self.mcp_servers.items())},
            PLAYBOOK_PATH_ENV: os.pathsep.join(str(p) for p in self.playbook_path) or "(none)",
            CORPUS_DIR_ENV: str(self.corpus_dir),
            CREDENTIALS_FILE_ENV: str(self.credentials_file) if self.credentials_file else "(none)",
            POSTGRES_DSN_ENV: MASK if self.postgres_dsn else "(none)",
            DISABLED_TOOLS_ENV: ",".join(sorted(self.disabled_tools)) or "(none)",
        }
        shown.update({name: MASK for name in sorted(self.auth)})
        return shown


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw in (None, ""):
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise ConfigurationError(f"{name} must be a whole number, got {raw!r}") from exc


def log_format(environ: Mapping[str, str] | None = None) -> str:
    """NOETL_LOG_FORMAT: `text` or `json` (read alone by the CLI before the other settings)."""
    return _choice(os.environ if environ is None else environ, "NOETL_LOG_FORMAT", LOG_FORMATS, "text")


def _port(env: Mapping[str, str], name: str) -> int | None:
    """A TCP port (1-65535), or None when unset."""
    if not env.get(name):
        return None
    port = _int(env, name, 0)
    if not 0 < port < 65536:
        raise ConfigurationError(f"{name} must be a TCP port (1-65535), got {env[name]!r}")
    return port


def defaults() -> Settings:
    """The settings of an empty environment."""
    return load({})


def load(environ: Mapping[str, str] | None = None) -> Settings:
    """The settings of `environ` (the process environment by default)."""
    env = secret_registry.environ() if environ is None else environ  # sealed credential vars too
    home = Path(env.get("NOETL_HOME", DEFAULT_HOME)).expanduser()
    visibility_timeout = _int(env, "NOETL_VISIBILITY_TIMEOUT", DEFAULT_VISIBILITY_TIMEOUT)
    consumer_timeout = _int(env, "NOETL_CONSUMER_TIMEOUT", DEFAULT_CONSUMER_TIMEOUT)
    broker_url = env.get("NOETL_BROKER_URL") or None
    # unset: at most half of what the broker lets a worker hold a message (Redis: the visibility
    # timeout; RabbitMQ: its consumer_timeout), so a held countdown is never handed out again
    holding_limit = consumer_timeout if is_amqp(broker_url) else visibility_timeout
    max_countdown_default = min(DEFAULT_MAX_COUNTDOWN, max(1, holding_limit // 2))
    database_url = with_driver(env.get("NOETL_DATABASE_URL") or f"sqlite:///{home / 'noetl.sqlite'}")
    return check(
        Settings(
            broker_url=broker_url,
            database_url=database_url,
            result_backend=env.get("NOETL_RESULT_BACKEND") or None,
            home=home,
            task_queue=env.get("NOETL_TASK_QUEUE", DEFAULT_TASK_QUEUE),
            event_queue=env.get("NOETL_EVENT_QUEUE", DEFAULT_EVENT_QUEUE),
            visibility_timeout=visibility_timeout,
            restore_interval=_int(env, "NOETL_RESTORE_INTERVAL", DEFAULT_RESTORE_INTERVAL),
            max_countdown=_int(env, "NOETL_MAX_COUNTDOWN", max_countdown_default),
            prefetch_multiplier=_int(env, "NOETL_PREFETCH_MULTIPLIER", 1),
            task_events=env.get("NOETL_TASK_EVENTS", "1") not in ("0", "false", "no"),
            event_dispatch=_choice(env, "NOETL_EVENT_DISPATCH", ("inline", "queue"), "inline"),
            sweep_interval=_float(env, "NOETL_SWEEP_INTERVAL", DEFAULT_SWEEP_INTERVAL),
            sweep_timeout=_positive(env, "NOETL_SWEEP_TIMEOUT", DEFAULT_SWEEP_TIMEOUT),
            clock_skew_warn=_positive(env, "NOETL_CLOCK_SKEW_WARN", DEFAULT_CLOCK_SKEW_WARN),
            max_republishes=_int(env, "NOETL_MAX_REPUBLISHES", DEFAULT_MAX_REPUBLISHES),
            max_deliveries=_int(env, "NOETL_MAX_DELIVERIES", DEFAULT_MAX_DELIVERIES),
            eager_window=_float(env, "NOETL_EAGER_WINDOW", DEFAULT_EAGER_WINDOW),
            eager_task_events=env.get("NOETL_EAGER_TASK_EVENTS", "0") not in ("0", "false", "no", ""),
            consumer_timeout=consumer_timeout,
            corpus_dir=_corpus_dir(env),
            duckdb_dir=Path(env.get(DUCKDB_DIR_ENV) or DEFAULT_DUCKDB_DIR),
            artifact_dir=Path(env[ARTIFACT_DIR_ENV]).expanduser() if env.get(ARTIFACT_DIR_ENV) else None,
            mcp_url=env.get(MCP_URL_ENV) or None,
            mcp_servers={
                k: v
                for k, v in env.items()
                if k.startswith(MCP_SERVER_PREFIX) and k.endswith(("_URL", "_ENDPOINT")) and k != MCP_URL_ENV and v
            },
            mcp_request_timeout=_positive(env, MCP_TIMEOUT_ENV, DEFAULT_MCP_TIMEOUT),
            playbook_path=tuple(Path(e.strip()) for e in env.get(PLAYBOOK_PATH_ENV, "").split(os.pathsep) if e.strip()),
            credentials_file=Path(env[CREDENTIALS_FILE_ENV]).expanduser() if env.get(CREDENTIALS_FILE_ENV) else None,
            postgres_dsn=env.get(POSTGRES_DSN_ENV) or None,
            auth={k: v for k, v in env.items() if k.startswith(AUTH_PREFIX) and v.strip()},
            flower_url=(env.get("NOETL_FLOWER_URL") or "").rstrip("/") or None,
            dashboard_url=(env.get("NOETL_DASHBOARD_URL") or "").rstrip("/") or None,
            dashboard_token=env.get("NOETL_DASHBOARD_TOKEN") or None,
            api_max_body_bytes=_int(env, API_MAX_BODY_ENV, DEFAULT_API_MAX_BODY_BYTES),
            schedule_grace=_float(env, "NOETL_SCHEDULE_GRACE", DEFAULT_SCHEDULE_GRACE),
            webhook_url=(env.get("NOETL_WEBHOOK_URL") or "").strip() or None,
            webhook_secret=(env.get("NOETL_WEBHOOK_SECRET") or "").strip() or None,
            metrics_port=_port(env, "NOETL_METRICS_PORT"),
            metrics_host=env.get("NOETL_METRICS_HOST") or DEFAULT_METRICS_HOST,
            log_format=log_format(env),
            max_result_bytes=int(limit(MAX_RESULT_BYTES_ENV, env)),
            max_playbook_bytes=int(limit(MAX_PLAYBOOK_BYTES_ENV, env)),
            max_yaml_nodes=int(limit(MAX_YAML_NODES_ENV, env)),
            max_input_depth=int(limit(MAX_INPUT_DEPTH_ENV, env)),
            template_timeout=limit(TEMPLATE_TIMEOUT_ENV, env),
            template_max_bytes=int(limit(TEMPLATE_MAX_BYTES_ENV, env)),
            max_loop_items=int(limit(MAX_LOOP_ITEMS_ENV, env)),
            max_result_depth=int(limit(MAX_RESULT_DEPTH_ENV, env)),
            max_steps=int(limit(MAX_STEPS_ENV, env)),
            message_format=int(limit(MESSAGE_FORMAT_ENV, env)),
            max_stored_bytes=int(limit(MAX_STORED_BYTES_ENV, env)),
            stored_cache_bytes=int(limit(STORED_CACHE_BYTES_ENV, env)),
            loop_page_bytes=int(limit(LOOP_PAGE_BYTES_ENV, env)),
            store_piece_bytes=int(limit(STORE_PIECE_BYTES_ENV, env)),
            strict_templates=strict_templates(env),
            pg_prepare=pg_prepare(env),
            disabled_tools=disabled_tools(env),
            prune_older_than=parse_age(env["NOETL_PRUNE_OLDER_THAN"], "NOETL_PRUNE_OLDER_THAN")
            if env.get("NOETL_PRUNE_OLDER_THAN")
            else None,
        )
    )


_AGE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_AGE_UNITS = {"": 86400.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


def parse_age(value: str, name: str = "an age") -> timedelta:
    """`30d`, `12h`, `90m`, `2w`, `45s` (a bare number is days) as a timedelta."""
    match = _AGE.match(value)
    if match is None or float(match.group(1)) <= 0:
        raise ConfigurationError(f"{name} is a positive number and a unit (s, m, h, d, w), as 30d: got {value!r}")
    return timedelta(seconds=float(match.group(1)) * _AGE_UNITS[match.group(2)])


def strict_templates(environ: Mapping[str, str] | None = None) -> bool:
    """NOETL_STRICT_TEMPLATES=1: every template renders strictly (an undefined name fails the
    step), where by default tool args, sinks, `set`/`vars` and arcs render leniently, as NoETL
    renders them. Read at each use, as the limits are."""
    env = os.environ if environ is None else environ
    return (env.get(STRICT_TEMPLATES_ENV) or "").strip().lower() in ("1", "true", "yes", "on")


def disabled_tools(environ: Mapping[str, str] | None = None) -> frozenset[str]:
    """NOETL_DISABLED_TOOLS: the tool kinds an operator turned off (`shell,python`). Read at each
    use, as the limits are: validate refuses a playbook naming one, a worker refuses its attempts."""
    env = os.environ if environ is None else environ
    return frozenset(kind.strip() for kind in (env.get(DISABLED_TOOLS_ENV) or "").split(",") if kind.strip())


def disabled_tool_message(kind: str) -> str:
    """The one sentence validate and a worker give for a task of a turned-off kind."""
    return f"tool kind '{kind}' is turned off on this deployment ({DISABLED_TOOLS_ENV})"


def pg_prepare(environ: Mapping[str, str] | None = None) -> str:
    """NOETL_PG_PREPARE: auto (the default), on or off (store/prepared.py). Read when a process
    makes its engine for a store."""
    env = os.environ if environ is None else environ
    value = (env.get(PG_PREPARE_ENV) or DEFAULT_PG_PREPARE).strip().lower()
    if value not in PG_PREPARE_MODES:
        raise ConfigurationError(
            f"{PG_PREPARE_ENV} must be one of {', '.join(PG_PREPARE_MODES)}, got {env.get(PG_PREPARE_ENV)!r}: "
            "off behind a transaction pooler such as PgBouncer, auto to tell by the connection"
        )
    return value


def limit(name: str, environ: Mapping[str, str] | None = None) -> float:
    """The limit `name` (a key of LIMIT_DEFAULTS) in `environ` (the process environment by
    default), its default when unset: a positive number, whole for the ones that count bytes or
    nodes. One variable is read per call: `noetl_celery.config.limits` asks on every check."""
    env = os.environ if environ is None else environ  # no limit is a credential, so none is sealed
    default = LIMIT_DEFAULTS[name]
    raw = env.get(name)
    if raw in (None, ""):
        return default
    whole = name in WHOLE_LIMITS
    kind = "a positive whole number" if whole else "a positive number of seconds"
    try:
        value = float(raw)
    except ValueError:
        raise ConfigurationError(f"{name} must be {kind}, got {raw!r}") from None
    if not value > 0 or (whole and not (math.isfinite(value) and value.is_integer())):  # `not >` refuses nan
        raise ConfigurationError(f"{name} must be {kind}, got {raw!r}")
    return value


# PostgreSQL URLs without a driver: SQLAlchemy 2.1 reads `postgresql://` as psycopg 3, which is
# not a dependency (and `postgres://` not at all); they name the installed psycopg2 here.
_DRIVERLESS_POSTGRES = ("postgresql://", "postgres://")
POSTGRES_DRIVER_SCHEME = "postgresql+psycopg2://"


def with_driver(url: str) -> str:
    """`url` with the psycopg2 driver named when it is a PostgreSQL URL that names none."""
    for scheme in _DRIVERLESS_POSTGRES:
        if url.startswith(scheme):
            return POSTGRES_DRIVER_SCHEME + url[len(scheme) :]
    return url


def urls_as_set(environ: Mapping[str, str] | None = None) -> tuple[str | None, str | None]:
    """NOETL_DATABASE_URL and NOETL_BROKER_URL as set (None when unset), read without checking any
    other setting: what a failure to use the store or the broker is described with even when the
    settings as a whole are refused."""
    env = secret_registry.environ() if environ is None else environ
    return env.get("NOETL_DATABASE_URL") or None, env.get("NOETL_BROKER_URL") or None


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw in (None, ""):
        return default
    try:
        return float(raw)
    except ValueError as exc:
        raise ConfigurationError(f"{name} must be a number of seconds, got {raw!r}") from exc


def _positive(env: Mapping[str, str], name: str, default: float) -> float:
    value = _float(env, name, default)
    if value <= 0:
        raise ConfigurationError(f"{name} must be a positive number of seconds, got {env.get(name)!r}")
    return value


def _corpus_dir(env: Mapping[str, str]) -> Path:
    raw = env.get(CORPUS_DIR_ENV)
    if raw:
        return Path(raw).expanduser().resolve()
    return (SOURCE_ROOT / DEFAULT_CORPUS_DIR).resolve()


def mask_url(url: str) -> str:
    """`url` with its password (if any) replaced by ***; a DSN that is not a URL is masked whole
    when it carries a password."""
    if "://" not in url:
        return MASK if "password" in url.lower() else url
    if unencoded_at(url):  # where the password ends is a guess: none of the user-info part is shown
        scheme, _, rest = url.partition("://")
        return f"{scheme}://{MASK}@{rest.split('/', 1)[0].rsplit('@', 1)[1]}{_path_of(rest)}"
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit(parts._replace(netloc=f"{user}:{MASK}@{host}"))


def unencoded_at(url: str) -> bool:
    """True when the user-info part of `url` holds an '@' that is not percent-encoded (its
    password cannot be told from its host)."""
    _, sep, rest = url.partition("://")
    return bool(sep) and rest.split("/", 1)[0].count("@") > 1


def _path_of(rest: str) -> str:
    _, slash, path = rest.partition("/")
    return slash + path


def _choice(env: Mapping[str, str], name: str, allowed: tuple[str, ...], default: str) -> str:
    value = env.get(name) or default
    if value not in allowed:
        raise ConfigurationError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
    return value


def is_amqp(broker_url: str | None) -> bool:
    """True for a RabbitMQ broker URL (amqp://, amqps://, pyamqp://, librabbitmq://)."""
    return bool(broker_url) and urlsplit(str(broker_url)).scheme.lower() in AMQP_SCHEMES


def check(settings: Settings) -> Settings:
    """Settings that contradict each other are refused with what to change."""
    for name, url in (("NOETL_DATABASE_URL", settings.database_url), ("NOETL_RESULT_BACKEND", settings.result_backend)):
        if url and unencoded_at(url):
            raise ConfigurationError(
                f"{name} {mask_url(url)} has an '@' in its user or password: percent-encode @ in "
                "passwords (@ -> %40), and / and # likewise (%2F, %23)"
            )
    if not 1 <= settings.message_format <= NEWEST_MESSAGE_FORMAT:
        raise ConfigurationError(
            f"{MESSAGE_FORMAT_ENV} must be a message format from 1 to {NEWEST_MESSAGE_FORMAT}, got "
            f"{settings.message_format}: during a rolling upgrade, the newest format the release being "
            "replaced reads (docs/operations.md, Upgrading)"
        )
    if not 0 <= settings.eager_window <= MAX_EAGER_WINDOW:
        raise ConfigurationError(
            f"NOETL_EAGER_WINDOW must be between 0 (off) and {MAX_EAGER_WINDOW:g} seconds, got "
            f"{settings.eager_window:g}: it is how long one message may go on running the attempts it "
            "decides, and the broker holds the message unacknowledged meanwhile"
        )
    if settings.amqp_broker:
        if settings.consumer_timeout <= 0:
            raise ConfigurationError(
                f"NOETL_CONSUMER_TIMEOUT must be a positive number of seconds, got {settings.consumer_timeout}"
            )
        if settings.max_countdown >= settings.consumer_timeout:
            raise ConfigurationError(
                f"NOETL_MAX_COUNTDOWN ({settings.max_countdown} s) must be shorter than NOETL_CONSUMER_TIMEOUT "
                f"({settings.consumer_timeout} s, RabbitMQ's consumer_timeout): a worker holds a countdown "
                "message unacknowledged until it is due, and RabbitMQ closes the channel of a consumer that "
                "holds one longer, handing every message it held to another worker (set "
                "NOETL_CONSUMER_TIMEOUT to the server's consumer_timeout if it is not the default 1800 s)"
            )
        return settings
    if settings.max_countdown >= settings.visibility_timeout:
        raise ConfigurationError(
            f"NOETL_MAX_COUNTDOWN ({settings.max_countdown} s) must be shorter than NOETL_VISIBILITY_TIMEOUT "
            f"({settings.visibility_timeout} s): Redis hands a message held longer than the visibility timeout "
            "to another worker, and the retry would run more than once"
        )
    return settings


def require_broker(settings: Settings) -> str:
    """The broker URL for a separate worker or `submit`; a clear error when none is set."""
    if not settings.broker_url:
        raise ConfigurationError(
            "no broker configured: set NOETL_BROKER_URL (e.g. redis://127.0.0.1:6379/0) for "
            "separate worker processes and `noetl-celery submit`; `noetl-celery run` needs none"
        )
    return settings.broker_url


def webhook_shown(url: str | None) -> str:
    """A webhook URL as `config` shows it: scheme and host only (the path of many webhook URLs,
    Slack's among them, is their secret)."""
    if not url:
        return "(none)"
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname or ''}{':' + str(parts.port) if parts.port else ''}/{MASK}"
