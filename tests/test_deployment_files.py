"""The deployment files: docker/docker-compose.yml and docker/Dockerfile read as YAML and text
(what an operator relies on: Compose v2 said, healthchecks, ports, the playbooks' credential),
and the postgres init script run for real against this session's PostgreSQL server."""

from __future__ import annotations

import os
import secrets
import subprocess
from urllib.parse import urlsplit

import psycopg2
import pytest
import yaml

from tests.support.engines import REPO_ROOT

DOCKER = REPO_ROOT / "docker"
INIT_SCRIPT = DOCKER / "postgres-init" / "10-playbook-database.sh"


def compose() -> dict:
    return yaml.safe_load((DOCKER / "docker-compose.yml").read_text())


def test_compose_says_it_needs_compose_v2_and_the_readme_says_so_too():
    text = (DOCKER / "docker-compose.yml").read_text()
    assert "name" in compose() and "Docker Compose v2" in text
    assert "Compose v2" in (REPO_ROOT / "README.md").read_text()


def test_dashboard_server_and_flower_have_healthchecks_on_their_own_ports():
    services = compose()["services"]
    for service, port in (("dashboard", 8080), ("flower", 5555), ("server", 8082)):
        check = services[service]["healthcheck"]
        assert f"127.0.0.1:{port}/" in " ".join(check["test"]), service
        assert check["retries"] >= 1 and check["interval"]
    assert "EXPOSE 5555 8080 8082 8765" in (DOCKER / "Dockerfile").read_text()
    assert services["server"]["ports"] == ["127.0.0.1:8082:8082"]  # published on loopback only
    assert services["server"]["command"][:2] == ["noetl-celery", "server"]
    assert "server: noetl-celery server --host 127.0.0.1 --port 8082" in (REPO_ROOT / "Procfile").read_text()


def test_playbooks_get_a_role_and_database_of_their_own_not_the_event_stores():
    services = compose()["services"]
    store = urlsplit(services["worker"]["environment"]["NOETL_DATABASE_URL"])
    pg_local = services["worker"]["environment"]["NOETL_AUTH_PG_LOCAL"]
    default = urlsplit(pg_local.removeprefix("${NOETL_AUTH_PG_LOCAL:-").removesuffix("}"))
    assert (default.username, default.path) == ("playbook", "/playbook")
    assert default.username != store.username and default.path != store.path
    postgres = services["postgres"]
    assert postgres["environment"]["PLAYBOOK_PG_USER"] == default.username
    assert "./postgres-init:/docker-entrypoint-initdb.d:ro" in postgres["volumes"]


@pytest.mark.services
def test_the_init_script_creates_a_role_that_owns_its_database_and_cannot_reach_the_store(
    fresh_postgres, postgres_server_url
):
    server = urlsplit(postgres_server_url)
    role = f"playbook_{secrets.token_hex(4)}"
    env = {
        **os.environ,
        "PGHOST": server.hostname or "127.0.0.1",
        "PGPORT": str(server.port or 5432),
        "POSTGRES_USER": server.username or "postgres",
        "POSTGRES_DB": fresh_postgres.name,
        "PLAYBOOK_PG_USER": role,
        "PLAYBOOK_PG_PASSWORD": "pw-" + role,
    }
    admin = psycopg2.connect(postgres_server_url)
    admin.autocommit = True
    try:
        subprocess.run(["sh", str(INIT_SCRIPT)], env=env, check=True, capture_output=True, timeout=60)

        def connect(database: str):  # type: ignore[no-untyped-def]
            return psycopg2.connect(
                host=env["PGHOST"], port=env["PGPORT"], user=role, password=env["PLAYBOOK_PG_PASSWORD"], dbname=database
            )

        own = connect(role)
        with own, own.cursor() as cur:  # what postgres_example.yaml does, in its own database
            cur.execute("CREATE TABLE public.noetl_inventory_demo (sku TEXT PRIMARY KEY)")
            cur.execute("SELECT rolsuper, rolcreaterole FROM pg_roles WHERE rolname = current_user")
            assert cur.fetchone() == (False, False)
        own.close()
        with pytest.raises(psycopg2.OperationalError, match="permission denied for database"):
            connect(fresh_postgres.name)
    finally:
        with admin.cursor() as cur:
            cur.execute(f'DROP DATABASE IF EXISTS "{role}" WITH (FORCE)')
            cur.execute(f'DROP ROLE IF EXISTS "{role}"')
        admin.close()
