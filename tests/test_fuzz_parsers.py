"""No input crashes a parser entry (issue 39): any text given as a playbook is a plan or problems
with `file:line: path: message`, any JSON body is a value or a refusal naming the line.

The seed corpus (tests/fuzz_seeds) holds each input that once crashed validate or the server: a NUL
and a \\x01 character, YAML nested 650-700 levels, a list where a name is expected (loop mode,
routing mode, policy do, collect strategy), JSON bodies and workloads nested thousands of levels.
The fast tier checks each seed; the slow tier fuzzes from them with hypothesis within a fixed
time budget (FUZZ_BUDGET seconds), derandomized so that CI runs the same inputs every time.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from noetl_celery.cli import cli
from noetl_celery.compiler import compile_playbook
from noetl_celery.core.errors import PlaybookError
from noetl_celery.dsl import load_plan
from noetl_celery.dsl.bounded import InputError, parse_json
from noetl_celery.dsl.set_values import parse_assignments
from tests.support.corpus import CORPUS

SEEDS = Path(__file__).parent / "fuzz_seeds"
EXAMPLES = Path(__file__).resolve().parents[1] / "playbooks"
YAML_SEEDS = sorted(SEEDS.glob("*.yaml"))
JSON_SEEDS = sorted(SEEDS.glob("*.json"))
FUZZ_BUDGET = 8.0  # seconds each fuzz test runs batches for (the last batch may end a little after)
BATCH = 20  # examples per batch; batch N draws with seed N, so a run is the same inputs every time


def in_batches(body: Any, *strategies: Any, budget: float = FUZZ_BUDGET) -> int:
    """Run `body` on examples drawn from `strategies`, in batches of BATCH examples with seeds 0,
    1, 2, ..., until `budget` seconds have passed; returns the number of examples run."""
    from hypothesis import HealthCheck, Phase, given, seed, settings

    deadline = time.monotonic() + budget
    batches = 0
    while time.monotonic() < deadline:
        configured = settings(
            max_examples=BATCH,
            deadline=None,
            database=None,
            phases=[Phase.generate, Phase.shrink],
            suppress_health_check=list(HealthCheck),
        )
        seed(batches)(configured(given(*strategies)(body)))()
        batches += 1
    return batches * BATCH


def assert_plan_or_problems(text: str, name: str = "fuzz.yaml") -> None:
    """`text` compiles, or is refused with problems that each name the file; nothing else."""
    try:
        load_plan(name, text=text)
    except PlaybookError as exc:
        assert exc.problems and all(p.file == name and p.message for p in exc.problems), exc.problems


def test_the_seed_corpus_holds_every_known_crash() -> None:
    names = {path.stem for path in [*YAML_SEEDS, *JSON_SEEDS]}
    assert {
        "nul_char",
        "control_char",
        "yaml_nested_700",
        "yaml_block_nested_650",
        "list_loop_mode",
        "list_routing_mode",
        "list_policy_do",
        "list_collect_strategy",
        "json_body_nested_5000",
        "json_workload_nested_300",
    } <= names


@pytest.mark.parametrize("seed", YAML_SEEDS, ids=lambda p: p.stem)
def test_each_yaml_seed_is_refused_with_file_and_line_exit_2(seed: Path) -> None:
    result = CliRunner().invoke(cli, ["validate", str(seed)])
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    first = result.output.splitlines()[0]
    assert first.startswith(f"{seed}:") and first.split(":")[1].isdigit(), first
    assert "Traceback" not in result.output
    with pytest.raises(PlaybookError) as raised:
        compile_playbook("content", text=seed.read_bytes().decode("utf-8"))
    assert all(problem.line for problem in raised.value.problems), raised.value.problems


@pytest.mark.parametrize("seed", JSON_SEEDS, ids=lambda p: p.stem)
def test_each_json_seed_is_refused_naming_its_line(seed: Path) -> None:
    with pytest.raises(InputError, match=r"^body: line \d+: nested \d+ levels deep, more than 100"):
        parse_json(seed.read_bytes(), "body")


def test_a_deep_set_value_is_refused() -> None:
    with pytest.raises(ValueError, match="nested more than 100 levels"):
        parse_assignments(["x=" + "[" * 300 + "]" * 300])


def test_a_deep_workload_is_a_problem() -> None:
    value: list[Any] = []
    for _ in range(300):
        value = [value]
    with pytest.raises(PlaybookError, match="NOETL_MAX_INPUT_DEPTH"):
        load_plan("pb.yaml", text=(EXAMPLES / "hello_world.yaml").read_text(), overrides={"deep": value})


# ---------------------------------------------------------------------------------------------
# The slow tier: fuzzing from the seeds and the playbooks of this repository and of the corpus


def _documents() -> list[Any]:
    files = [*sorted(EXAMPLES.glob("*.yaml")), *(sorted(CORPUS.rglob("*.yaml")) if CORPUS.is_dir() else [])]
    return [yaml.safe_load(path.read_text()) for path in files]


def _texts() -> list[str]:
    return [path.read_bytes().decode("utf-8", "replace") for path in [*YAML_SEEDS, *sorted(EXAMPLES.glob("*.yaml"))]]


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [prefix]
    if isinstance(value, dict):
        for key, item in value.items():
            found += _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += _paths(item, (*prefix, index))
    return found


def _replace(document: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    changed = copy.deepcopy(document)
    holder = changed
    for key in path[:-1]:
        holder = holder[key]
    holder[path[-1]] = value
    return changed


@pytest.mark.slow
def test_fuzz_playbook_structure() -> None:
    """A value anywhere in a real playbook replaced by any JSON-like value (lists where names go,
    mappings where text goes, numbers, nulls, deep nesting)."""
    from hypothesis import strategies as st

    documents = _documents()
    values = st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=12),
        lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
        max_leaves=12,
    )

    def one(data: Any) -> None:
        document = data.draw(st.sampled_from(documents))
        for _ in range(data.draw(st.integers(1, 3))):
            path = data.draw(st.sampled_from(_paths(document)))
            document = _replace(document, path, data.draw(values))
        assert_plan_or_problems(yaml.safe_dump(document, sort_keys=False))

    assert in_batches(one, st.data()) >= BATCH


@pytest.mark.slow
def test_fuzz_playbook_bytes() -> None:
    """Bytes inserted, deleted or replaced in the seeds and the example playbooks, decoded as text
    (control characters, broken indentation, unclosed brackets, stray anchors and tags)."""
    from hypothesis import strategies as st

    texts = _texts()
    pieces = st.sampled_from(
        ["\x00", "\x01", "\t", "[", "{", "]", "}", "&a ", "*a", "!!int ", ": ", "- ", "\n  ", "'", '"']
    )

    def one(data: Any) -> None:
        text = data.draw(st.sampled_from(texts))
        for _ in range(data.draw(st.integers(1, 4))):
            at = data.draw(st.integers(0, len(text)))
            cut = data.draw(st.integers(0, 3))
            text = text[:at] + data.draw(pieces | st.text(max_size=4)) + text[at + cut :]
        assert_plan_or_problems(text)

    assert in_batches(one, st.data()) >= BATCH


@pytest.mark.slow
def test_fuzz_json_bodies() -> None:
    """Any JSON-ish text as a request body: a value or a refusal, never a RecursionError."""
    from hypothesis import strategies as st

    def one(depth: int, opener: str, filler: str, close: bool) -> None:
        closer = "]" if opener == "[" else "}"
        raw = opener * depth + json.dumps(filler) + (closer * depth if close else "")
        try:
            parse_json(raw.encode("utf-8", "surrogatepass"), "body")
        except InputError as exc:
            assert str(exc).startswith("body: ")

    shapes = (st.integers(0, 3000), st.sampled_from(["[", '{"a":']), st.text(max_size=20), st.booleans())
    assert in_batches(one, *shapes, budget=FUZZ_BUDGET / 2) >= BATCH
