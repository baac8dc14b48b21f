#!/bin/sh
# Run once by the postgres image when its data volume is created (/docker-entrypoint-initdb.d):
# a role and a database of their own for what playbooks do (the credential `pg_local`), apart
# from the event store. The event store's role ($POSTGRES_USER) is a superuser: a playbook given
# it could rewrite the event log. This role owns its own database only, and no role but the
# store's own may connect to the store's database.
#
# On a volume created before this script existed, run it by hand once:
#   docker compose -f docker/docker-compose.yml exec postgres sh /docker-entrypoint-initdb.d/10-playbook-database.sh
set -eu
psql -v ON_ERROR_STOP=1 --no-psqlrc --username "$POSTGRES_USER" --dbname "$POSTGRES_DB" \
    -v role="${PLAYBOOK_PG_USER:-playbook}" \
    -v password="${PLAYBOOK_PG_PASSWORD:-playbook}" \
    -v store="$POSTGRES_DB" <<'SQL'
CREATE ROLE :"role" LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE PASSWORD :'password';
CREATE DATABASE :"role" OWNER :"role";
REVOKE ALL ON DATABASE :"store" FROM PUBLIC;
SQL
