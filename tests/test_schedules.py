"""Schedules: fire times, the missed-fire policy, the claim of each fire time in the store, the
CLI, and real `celery -A noetl_celery beat` processes (two at once, one restarted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from noetl_celery import schedules
from noetl_celery.config import settings as noetl_settings
from noetl_celery.store import schedules as store
from noetl_celery.store.db import transaction
from noetl_celery.tools.base import known_kinds
from tests.support.engines import REPO_ROOT, _clean_env, cli
from tests.support.services import stop_process

HELLO = str(REPO_ROOT / "playbooks" / "hello_world.yaml")
T0 = datetime(2026, 11, 25, 12, 0, 0, tzinfo=UTC)


def interval_row(every: int, created: datetime = T0, missed: str = "latest", **extra) -> dict:
    return {
        "name": "s",
        "cron": None,
        "interval_s": every,
        "timezone": "UTC",
        "created_at": created,
        "anchor_at": created,
        "missed": missed,
        **extra,
    }


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


# --- fire times and the missed-fire policy ---------------------------------------------------


def test_an_interval_fires_every_n_seconds_after_its_creation():
    row = interval_row(5, created=T0 + timedelta(microseconds=400_000))
    assert schedules.next_fire(row, row["anchor_at"]) == at(5)
    assert schedules.next_fire(row, at(5)) == at(10)
    assert schedules.latest_fire(row, at(14.9)) == at(10)
    assert schedules.latest_fire(row, at(4)) is None


def test_each_fire_time_within_the_grace_runs_once():
    row = interval_row(1)
    fires = schedules.due_fires(row, None, at(3.5), grace=10)
    assert [(f.fire_time, f.action) for f in fires] == [(at(1), "start"), (at(2), "start"), (at(3), "start")]
    # after the latest claim (3 s): only what came since
    assert [f.fire_time for f in schedules.due_fires(row, at(3), at(4.2), grace=10)] == [at(4)]
    assert schedules.due_fires(row, at(4), at(4.9), grace=10) == []


@pytest.mark.parametrize(("policy", "action"), [("latest", "start"), ("skip", "skip")])
def test_missed_fire_times_run_once_for_the_latest_or_are_skipped(policy, action):
    row = interval_row(60, missed=policy)
    # the beat was down from 12:01 to 12:10:30: fire times 12:01..12:10 are more than 10 s late
    fires = schedules.due_fires(row, at(60), at(630), grace=10)
    assert [(f.fire_time, f.action) for f in fires] == [(at(600), action)]


def test_a_missed_fire_time_gives_way_to_one_within_the_grace():
    row = interval_row(60)
    fires = schedules.due_fires(row, at(60), at(605), grace=10)
    assert [(f.fire_time, f.action) for f in fires] == [(at(600), "start")]


def test_a_cron_expression_fires_in_its_time_zone():
    row = {**interval_row(1), "interval_s": None, "cron": "0 3 * * *", "timezone": "Europe/Berlin"}
    # 03:00 in Berlin is 02:00 UTC in November
    assert schedules.next_fire(row, T0) == datetime(2026, 11, 26, 2, 0, tzinfo=UTC)
    seconds = {**row, "cron": "*/15 * * * * *", "timezone": "UTC"}
    assert schedules.next_fire(seconds, at(1)) == at(15)
    assert schedules.latest_fire(seconds, at(44)) == at(30)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"cron": "61 * * * *"}, "cron"),
        ({"every": 0}, "every"),
        ({}, "cron"),
        ({"every": 5, "cron": "* * * * *"}, "cron"),
        ({"every": 5, "timezone": "Mars/Olympus"}, "timezone"),
        ({"every": 5, "missed": "all"}, "missed"),
    ],
)
def test_a_bad_schedule_is_refused_naming_its_field(kwargs, field):
    with pytest.raises(schedules.ScheduleError) as info:
        schedules.validate("s", HELLO, **kwargs)
    assert info.value.field == field


# --- the claim in the store --------------------------------------------------------------------


def _settings(url: str) -> noetl_settings.Settings:
    return noetl_settings.load({"NOETL_DATABASE_URL": url})


def test_two_beats_firing_at_once_start_each_fire_time_once(sqlite_url):
    settings = _settings(sqlite_url)
    schedules.add(sqlite_url, schedules.validate("every1", HELLO, every=1))
    now = datetime.now(UTC)
    with transaction(sqlite_url) as conn:  # as if created 5 s ago
        conn.execute(
            text("UPDATE noetl_schedule SET created_at = :t, anchor_at = :t"), {"t": now - timedelta(seconds=5)}
        )
        row = store.get_schedule(conn, "every1")
    due = schedules.due_fires(row, None, now, settings.schedule_grace)
    assert len(due) == 5
    known_kinds()  # the tool registry, loaded once before the threads (its first load is not thread-safe)
    results: list[list[dict]] = []
    barrier = threading.Barrier(2)

    def beat(name: str) -> None:
        barrier.wait()
        results.append(schedules.fire(settings, "every1", now, by=name))

    threads = [threading.Thread(target=beat, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    started = [r for result in results for r in result]
    with transaction(sqlite_url) as conn:
        runs = store.schedule_runs(conn, "every1")
        executions = conn.execute(text("SELECT execution_id FROM noetl_execution")).scalars().all()
    assert sorted(r["fire_time"] for r in runs) == [d.fire_time for d in due]
    assert sorted(r["execution_id"] for r in runs) == sorted(executions)  # one execution per fire time
    assert sorted(r["execution_id"] for r in started) == sorted(executions)  # each told to one caller
    # a third call at the same time finds everything claimed
    assert schedules.fire(settings, "every1", now, by="c") == []


def test_a_paused_schedule_starts_nothing_and_resume_does_not_catch_up(sqlite_url):
    settings = _settings(sqlite_url)
    schedules.add(sqlite_url, schedules.validate("p", HELLO, every=1, paused=True))
    with transaction(sqlite_url) as conn:
        conn.execute(
            text("UPDATE noetl_schedule SET created_at = :t, anchor_at = :t"),
            {"t": datetime.now(UTC) - timedelta(seconds=30)},
        )
    assert schedules.fire(settings, "p") == []
    resumed = schedules.set_paused(sqlite_url, "p", False)
    assert resumed["paused"] is False
    assert schedules.fire(settings, "p") == []  # the 30 s while paused are not missed fire times


def test_a_started_execution_shows_its_schedule_and_fire_time_in_status(sqlite_url):
    from noetl_celery import runner

    settings = _settings(sqlite_url)
    schedules.add(sqlite_url, schedules.validate("st", HELLO, every=1, workload={"greeting": "scheduled"}))
    fired = schedules.fire(settings, "st", datetime.now(UTC) + timedelta(seconds=1.5))
    assert fired and fired[0]["outcome"] == "started"
    status = runner.execution_status(sqlite_url, fired[0]["execution_id"])
    assert status["scheduled"] == {"schedule": "st", "fire_time": fired[0]["fire_time"]}
    with transaction(sqlite_url) as conn:
        workload = conn.execute(
            text("SELECT workload FROM noetl_execution WHERE execution_id = :i"), {"i": fired[0]["execution_id"]}
        ).scalar()
    assert json.loads(workload)["greeting"] == "scheduled"
    shown = cli(["status", str(fired[0]["execution_id"])], {"NOETL_DATABASE_URL": sqlite_url})
    assert f"started by schedule st (fire time {fired[0]['fire_time']})" in shown.stdout, shown.stdout + shown.stderr


def test_a_playbook_that_no_longer_compiles_refuses_its_fire_time_once(sqlite_url, tmp_path):
    settings = _settings(sqlite_url)
    playbook = tmp_path / "p.yaml"
    playbook.write_text(Path(HELLO).read_text())
    schedules.add(sqlite_url, schedules.validate("broken", str(playbook), every=1))
    playbook.write_text("apiVersion: noetl.io/v2\nkind: Playbook\n")
    now = datetime.now(UTC) + timedelta(seconds=1.5)
    fired = schedules.fire(settings, "broken", now)
    assert fired and {f["outcome"] for f in fired} == {"refused"}
    assert schedules.fire(settings, "broken", now) == []


def test_schedule_cli_add_list_pause_resume_remove(tmp_path):
    from click.testing import CliRunner

    from noetl_celery.cli import cli as command

    runner = CliRunner(env={"NOETL_HOME": str(tmp_path), "NOETL_DATABASE_URL": None, "NOETL_BROKER_URL": None})

    def run(*args: str):
        return runner.invoke(command, ["schedule", *args], catch_exceptions=False)

    added = run("add", "h", HELLO, "--every", "60", "--set", "greeting=hi", "--json")
    assert added.exit_code == 0, added.output
    assert json.loads(added.output)["workload"] == {"greeting": "hi"}
    again = run("add", "h", HELLO, "--every", "60")
    assert again.exit_code == 2 and "exists" in again.output
    assert run("pause", "h").exit_code == 0
    listed = json.loads(run("list", "--json").output)
    assert [(s["name"], s["paused"], s["next_fire"]) for s in listed] == [("h", True, None)]
    assert run("resume", "h").exit_code == 0
    assert json.loads(run("list", "--json").output)[0]["next_fire"] is not None
    assert run("remove", "h").exit_code == 0
    missing = run("remove", "h")
    assert missing.exit_code == 2 and "no schedule named 'h'" in missing.output


# --- real beat processes -------------------------------------------------------------------


def _beat(env: dict[str, str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "noetl_celery", "beat", "-l", "INFO", "--pidfile="],
        env=_clean_env(env),
        cwd=log.parent,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _runs(url: str, name: str) -> list[tuple[datetime, str, int | None, str]]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT fire_time, outcome, execution_id, claimed_by FROM noetl_schedule_run "
                    "WHERE schedule = :n ORDER BY fire_time"
                ),
                {"n": name},
            ).all()
        return [tuple(r) for r in rows]  # type: ignore[misc]
    finally:
        engine.dispose()


def _wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


@pytest.mark.slow
def test_two_beats_and_a_restart_start_each_fire_time_once(migrated_postgres, redis_url, tmp_path):
    url = migrated_postgres.url
    env = {
        "NOETL_DATABASE_URL": url,
        "NOETL_BROKER_URL": redis_url,
        "NOETL_SWEEP_INTERVAL": "0",
        # a fire time more than the grace late is passed over (policy `latest`, tested above):
        # a beat stalled that long by a loaded machine would leave a gap that is the policy, not
        # a missed claim. Here every fire time is to be started once, however slow the beats
        "NOETL_SCHEDULE_GRACE": "120",
        "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    schedules.add(url, schedules.validate("every-second", HELLO, every=1))
    schedules.add(url, schedules.validate("paused", HELLO, every=1, paused=True))
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    beats = [_beat(env, first / "beat.log"), _beat(env, second / "beat.log")]
    pids = [beats[0].pid, beats[1].pid]
    try:
        _wait_until(lambda: len(_runs(url, "every-second")) >= 1, 30, "the first fire time")
        window_start = time.monotonic()
        _wait_until(lambda: time.monotonic() - window_start > 3, 10, "3 s of two beats")
        # a restart: the first beat stopped and started again while the second one goes on
        stop_process(beats[0])
        beats[0] = _beat(env, first / "beat-restarted.log")
        pids.append(beats[0].pid)
        _wait_until(lambda: "beat: Starting" in (first / "beat-restarted.log").read_text(), 30, "the restart")
        _wait_until(lambda: time.monotonic() - window_start > 6, 10, "6 s")
        stop_process(beats[1])  # from here the restarted beat alone starts the fire times
        # "beat: Starting" comes before the beat's imports, its schema check and its first read of
        # the schedules: on a loaded machine the restarted beat may claim nothing for seconds
        # after it. So wait for it to start fire times alone: two claimed by it after the last
        # one claimed while the second beat ran, and ten fire times in all
        handed_over = max(r[0] for r in _runs(url, "every-second"))

        def restarted_alone() -> bool:
            runs = _runs(url, "every-second")
            alone = [r for r in runs if r[0] > handed_over and r[3].endswith(f":{pids[2]}")]
            return len(alone) >= 2 and len(runs) >= 10

        _wait_until(restarted_alone, 60, "two fire times started by the restarted beat alone")
    finally:
        for proc in beats:
            stop_process(proc)
    runs = _runs(url, "every-second")
    times = [r[0] for r in runs]
    assert len(runs) >= 10
    steps = {(b - a).total_seconds() for a, b in zip(times, times[1:], strict=False)}
    assert steps == {1.0}, f"fire times not one second apart (one missed or doubled): {times}"
    assert {r[1] for r in runs} == {"started"}
    claimers = {int(r[3].rsplit(":", 1)[1]) for r in runs}
    assert claimers <= set(pids), (claimers, pids)
    assert pids[2] in claimers and claimers & set(pids[:2])  # before and after the restart
    for log in (first / "beat.log", second / "beat.log", first / "beat-restarted.log"):
        assert "Traceback" not in log.read_text() and "ERROR" not in log.read_text(), log.read_text()[-2000:]
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            executions = conn.execute(text("SELECT execution_id FROM noetl_execution")).scalars().all()
    finally:
        engine.dispose()
    assert sorted(executions) == sorted(r[2] for r in runs)  # one execution per fire time, no other
    assert _runs(url, "paused") == []


@pytest.mark.parametrize(("policy", "outcome"), [("latest", "started"), ("skip", "skipped")])
def test_after_downtime_the_missed_policy_decides_in_the_store(sqlite_url, policy, outcome):
    settings = _settings(sqlite_url)
    schedules.add(sqlite_url, schedules.validate("m", HELLO, every=60, missed=policy))
    now = datetime.now(UTC)
    created = now - timedelta(minutes=30, seconds=30)  # no beat ran for the 30 fire times since
    with transaction(sqlite_url) as conn:
        conn.execute(text("UPDATE noetl_schedule SET created_at = :t, anchor_at = :t"), {"t": created})
    fired = schedules.fire(settings, "m", now, by="beat")
    assert [f["outcome"] for f in fired] == [outcome]  # once, for the latest missed fire time
    latest = created.replace(microsecond=0) + timedelta(minutes=30)
    assert fired[0]["fire_time"] == latest.isoformat()
    assert (fired[0]["execution_id"] is not None) == (policy == "latest")
    assert schedules.fire(settings, "m", now + timedelta(seconds=5), by="restarted") == []  # not again
    listed = schedules.list_all(sqlite_url)[0]
    assert listed["last_fire"] == latest.isoformat() and listed["last_run"]["outcome"] == outcome
