import hashlib
import shutil
import time
from pathlib import Path

import pytest

from skyrl_core.data import load_dataset
from skyrl_envs.sql_env import SHIPPED_DB_DIR, SQLEnv, results_equal

SHOP_ROWS = load_dataset(SHIPPED_DB_DIR / "shop.jsonl")
LISBON = SHOP_ROWS[0]  # How many customers live in Lisbon?
TIMEOUT = 0.5


@pytest.fixture
def db_dir(tmp_path):
    """A copy of the shop database that the file system would let anyone write."""
    shutil.copy(SHIPPED_DB_DIR / "shop.sqlite", tmp_path / "shop.sqlite")
    (tmp_path / "shop.sqlite").chmod(0o666)
    return tmp_path


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def make_env(db_dir, **options):
    return SQLEnv(db_dir=str(db_dir), timeout_seconds=TIMEOUT, **options)


@pytest.mark.parametrize("solution, reward", [
    ("SELECT COUNT(*) FROM customers WHERE city = 'Lisbon'", 1.0),
    ("select count(id) from customers where city like 'lisbon'", 1.0),   # another query, same result
    ("SELECT COUNT(*) FROM customers", 0.0),                              # wrong result
    ("SELECT COUNT(*) FROM customer WHERE", 0.0),                         # malformed SQL
])
def test_solution_reward(db_dir, solution, reward):
    env = make_env(db_dir)
    messages = env.reset(LISBON)
    assert "CREATE TABLE customers" in messages[1]["content"]
    result = env.step(f"I think <solution>{solution}</solution>")
    assert (result.reward, result.done) == (reward, True)


def test_explore_then_solve(db_dir):
    env = make_env(db_dir)
    env.reset(SHOP_ROWS[1])  # books
    seen = env.step("<sql>SELECT name, category FROM products WHERE category = 'books'</sql>")
    assert not seen.done and seen.reward == 0.0
    assert seen.observation[0]["content"].splitlines() == ["name | category", "atlas | books", "cookbook | books",
                                                           "novel | books", "(3 rows)"]
    error = env.step("<sql>SELECT nme FROM products</sql>")
    assert "Error: no such column: nme" in error.observation[0]["content"] and not error.done
    schema = env.step("<sql>PRAGMA table_info(products)</sql>")
    assert "price" in schema.observation[0]["content"]
    done = env.step("<solution>SELECT name FROM products WHERE category = 'books' ORDER BY price</solution>")
    assert (done.reward, done.done, done.info["turn"]) == (1.0, True, 4)


def test_a_turn_without_a_tag_gets_a_reminder_and_turns_run_out(db_dir):
    env = make_env(db_dir, max_turns=2)
    env.reset(LISBON)
    first = env.step("Let me think about it.")
    assert not first.done and "No <sql> query or <solution>" in first.observation[0]["content"]
    last = env.step("<sql>SELECT 1</sql>")
    assert (last.done, last.reward, last.info["reason"]) == (True, 0.0, "max_turns")


WRITES = [
    "DELETE FROM customers",
    "DROP TABLE orders",
    "INSERT INTO customers VALUES (99, 'Mallory', 'Oslo', 2024)",
    "UPDATE products SET price = 0",
    "CREATE TABLE pwned (x)",
    "CREATE INDEX pwned ON customers(city)",
    "ALTER TABLE customers ADD COLUMN pwned",
    "ATTACH DATABASE '{dir}/other.db' AS other",
    "PRAGMA query_only = OFF",
    "PRAGMA journal_mode = WAL",
    "PRAGMA user_version = 7",
    "VACUUM",
    "VACUUM INTO '{dir}/copy.db'",
    "REINDEX",
    "BEGIN IMMEDIATE",
    "SELECT 1; DROP TABLE customers",
    "WITH x AS (SELECT 1) DELETE FROM customers",
    "SELECT load_extension('/tmp/evil.so')",
]


@pytest.mark.parametrize("statement", WRITES)
def test_writes_are_refused_and_the_database_is_unchanged(db_dir, statement):
    database = db_dir / "shop.sqlite"
    before = digest(database)
    statement = statement.format(dir=db_dir)
    env = make_env(db_dir, max_turns=3)
    env.reset(LISBON)
    explored = env.step(f"<sql>{statement}</sql>")
    assert explored.observation[0]["content"].startswith("Error:"), explored.observation
    solved = env.step(f"<solution>{statement}</solution>")
    assert (solved.done, solved.reward) == (True, 0.0)
    assert digest(database) == before
    assert sorted(p.name for p in db_dir.iterdir()) == ["shop.sqlite"]  # no journal, WAL or new database


def test_control_the_same_writes_succeed_on_a_normal_connection(db_dir):
    import sqlite3

    database = db_dir / "shop.sqlite"
    before = digest(database)
    connection = sqlite3.connect(database)
    connection.execute(WRITES[0])
    connection.commit()
    connection.close()
    assert digest(database) != before


def test_a_slow_query_ends_with_an_error_observation(db_dir):
    env = make_env(db_dir, max_turns=3)
    env.reset(LISBON)
    started = time.monotonic()
    result = env.step("<sql>WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT COUNT(*) FROM c</sql>")
    assert time.monotonic() - started < TIMEOUT + 2.0
    assert result.observation[0]["content"] == f"Error: the query ran longer than {TIMEOUT:g} s and was stopped"
    assert not result.done
    huge = env.step("<sql>WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c LIMIT 10000000) "
                    "SELECT group_concat(x) FROM c</sql>")
    assert huge.observation[0]["content"].startswith("Error:")
    assert env.step("<solution>SELECT COUNT(*) FROM customers WHERE city = 'Lisbon'</solution>").reward == 1.0


def test_long_results_are_cut(db_dir):
    env = make_env(db_dir, max_rows_shown=5)
    env.reset(LISBON)
    shown = env.step("<sql>SELECT id FROM orders</sql>").observation[0]["content"].splitlines()
    assert shown == ["id", "1", "2", "3", "4", "5", "(5 rows, more not shown)"]


def test_result_comparison():
    assert results_equal([(1, "a"), (2, "b")], [(2, "b"), (1, "a")], order_matters=False)
    assert not results_equal([(1, "a"), (2, "b")], [(2, "b"), (1, "a")], order_matters=True)
    assert results_equal([(0.1 + 0.2,)], [(0.3,)], order_matters=True)
    assert results_equal([(3.0,)], [(3,)], order_matters=True)
    assert not results_equal([(1,), (1,)], [(1,)], order_matters=False)  # multisets, not sets
    assert not results_equal([(1, None)], [(1, 0)], order_matters=False)


def test_databases_are_found_by_db_id_or_path(db_dir, tmp_path_factory):
    spider = tmp_path_factory.mktemp("spider")
    (spider / "shop").mkdir()
    shutil.copy(db_dir / "shop.sqlite", spider / "shop" / "shop.sqlite")
    env = SQLEnv(db_dir=str(spider))
    env.reset(LISBON)
    assert env.step("<solution>SELECT 4</solution>").reward == 1.0
    env = SQLEnv(db_dir=str(spider))
    env.reset({**LISBON, "db_id": None, "db_path": str(db_dir / "shop.sqlite")})
    assert env.step("<solution>SELECT 4</solution>").reward == 1.0
    with pytest.raises(FileNotFoundError, match="no database for db_id 'nope'"):
        SQLEnv(db_dir=str(spider)).reset({**LISBON, "db_id": "nope"})
    with pytest.raises(ValueError, match="gold query of this row fails"):
        SQLEnv().reset({**LISBON, "reward_spec": {"ground_truth": "SELECT * FROM nowhere"}})


# --- hostile queries: dangerous functions and pragmas, huge results (issue 17) ------------------

FTS3_CRASH = """
import sqlite3, sys
from skyrl_envs.sql_env import open_read_only, run_query, QueryError
connection = open_read_only(sys.argv[1])
for sql in ("SELECT fts3_tokenizer('simple')",
            "SELECT fts3_tokenizer('simple', x'4141414141414141')",
            "SELECT * FROM docs WHERE docs MATCH 'x'"):
    try:
        print("ran", run_query(connection, sql, timeout_seconds=1, max_rows=5)[1])
    except QueryError as error:
        print("refused", error)
print("survived")
"""


def test_fts3_tokenizer_is_refused_and_the_process_survives(tmp_path):
    import sqlite3
    import subprocess
    import sys

    database = tmp_path / "fts.sqlite"
    connection = sqlite3.connect(database)
    connection.execute("CREATE VIRTUAL TABLE docs USING fts3(body)")
    connection.execute("INSERT INTO docs VALUES ('x y z')")
    connection.commit()
    connection.close()
    completed = subprocess.run([sys.executable, "-c", FTS3_CRASH, str(database)], capture_output=True, text=True,
                               timeout=60)
    assert completed.returncode == 0, (completed.returncode, completed.stdout, completed.stderr[-500:])
    lines = completed.stdout.splitlines()
    assert lines[0] == "refused not authorized: fts3_tokenizer is not an allowed function", lines
    assert lines[1].startswith("refused") and lines[-1] == "survived"


DANGEROUS = [
    "SELECT fts3_tokenizer('simple')",
    "SELECT load_extension('/tmp/evil.so')",
    "SELECT readfile('/etc/passwd')",
    "SELECT writefile('/tmp/pwned', 'x')",
    "SELECT zeroblob(1000000)",
    "SELECT randomblob(1000000)",
    "SELECT sqlite_compileoption_get(0)",
    "PRAGMA writable_schema = ON",
    "PRAGMA writable_schema",
    "PRAGMA hard_heap_limit = 0",
    "PRAGMA temp_store = FILE",
    "PRAGMA cache_size = -2000000",
    "PRAGMA mmap_size = 1000000000",
    "PRAGMA database_list",
    "SELECT * FROM pragma_database_list",
    "SELECT * FROM pragma_function_list",
    "PRAGMA trusted_schema = ON",
    "ATTACH DATABASE ':memory:' AS other",
    "ATTACH DATABASE '/etc/passwd' AS other",
    "SELECT * FROM sqlite_dbpage",
]


@pytest.mark.parametrize("statement", DANGEROUS)
def test_functions_and_pragmas_outside_the_allowlist_are_refused(db_dir, statement):
    env = make_env(db_dir, max_turns=2)
    env.reset(LISBON)
    seen = env.step(f"<sql>{statement}</sql>").observation[0]["content"]
    assert seen.startswith("Error:"), seen


def test_allowed_functions_still_work(db_dir):
    env = make_env(db_dir, max_turns=2)
    env.reset(LISBON)
    seen = env.step("<sql>SELECT upper(name), length(name), round(avg(price), 1), strftime('%Y', '2024-05-01'), "
                    "coalesce(NULL, 2), printf('%03d', 7), json_extract('{\"a\": 5}', '$.a'), abs(-3), "
                    "typeof(price), sqrt(16) FROM products WHERE id = 1</sql>").observation[0]["content"]
    assert not seen.startswith("Error:"), seen
    assert " | 2024 | 2 | 007 | 5 | 3 | " in seen and seen.rstrip().endswith("(1 rows)")


def _peak_rss_growth(action):
    """Peak resident memory of this process during ``action`` minus before (Linux: clear_refs resets the peak)."""
    import psutil

    Path("/proc/self/clear_refs").write_text("5")
    before = psutil.Process().memory_info().rss
    started = time.monotonic()
    value = action()
    elapsed = time.monotonic() - started
    peak_kib = int(next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmHWM")).split()[1])
    return value, peak_kib * 1024 - before, elapsed


WIDE = ", ".join(f"printf('%.*c', 90000, 'x') AS c{i}" for i in range(60))  # each value under the value limit
WIDE_ATTACKS = [
    f"WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r LIMIT 30) SELECT {WIDE} FROM r",
    "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r LIMIT 30) SELECT "
    + ", ".join(f"zeroblob(900000) AS z{i}" for i in range(60)) + " FROM r",
    f"WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r LIMIT 2000) SELECT {WIDE} FROM r ORDER BY i DESC",
]


@pytest.mark.parametrize("query", WIDE_ATTACKS)
def test_wide_results_are_bounded_in_time_and_memory(db_dir, query):
    env = make_env(db_dir, max_turns=3)
    env.reset(LISBON)
    seen, growth, elapsed = _peak_rss_growth(lambda: env.step(f"<sql>{query}</sql>").observation[0]["content"])
    assert elapsed < 2.0 and growth < 200 * 1024 * 1024, (elapsed, growth / 2**20)
    assert seen.startswith("Error:") or "result cut" in seen, seen[:300]
    assert len(seen) <= env.options.max_observation_chars + 100
    solved, growth, elapsed = _peak_rss_growth(lambda: env.step(f"<solution>{query}</solution>"))
    assert elapsed < 2.0 and growth < 200 * 1024 * 1024, (elapsed, growth / 2**20)
    assert (solved.done, solved.reward) == (True, 0.0) and solved.info["reason"] in ("solution_error", "solution_too_large")


def test_sorting_more_than_the_heap_limit_fails_fast_in_memory(db_dir):
    """ORDER BY over ~9 GB of rows: no temporary file is written (temp_store=MEMORY), and memory stops
    at the heap limit (or time at the time limit)."""
    import psutil

    env = make_env(db_dir, max_turns=2)
    env.reset(LISBON)
    query = ("WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r LIMIT 100000) "
             "SELECT printf('%.*c', 90000, 'x') || i AS v FROM r ORDER BY v")
    written = psutil.Process().io_counters().write_chars
    seen, growth, elapsed = _peak_rss_growth(lambda: env.step(f"<sql>{query}</sql>").observation[0]["content"])
    written = psutil.Process().io_counters().write_chars - written
    assert seen.startswith("Error: the query"), seen[:200]  # out of memory or out of time, never finished
    assert written < 1024 * 1024, written  # the sort spilled nothing to temporary files
    assert elapsed < 2.5 and growth < env.options.sqlite_heap_bytes + 64 * 1024 * 1024, (elapsed, growth / 2**20)


EXPENSIVE = [
    "SELECT printf('%.*c', 99000, 'a') LIKE '" + "%a" * 20 + "%b'",   # backtracking patterns
    "SELECT printf('%.*c', 99000, 'a') GLOB '" + "*a" * 20 + "*b'",
    "SELECT instr(printf('%.*c', 99000, 'a'), printf('%.*c', 50000, 'a') || 'b')",
    "SELECT replace(replace(replace(printf('%.*c', 99000, 'a'), 'a', 'aa'), 'a', 'aa'), 'a', 'aa')",
    "SELECT group_concat(printf('%.*c', 99000, 'a')) FROM customers",
    "SELECT json('" + "[" * 5000 + "]" * 5000 + "')",
    "SELECT count(*) FROM customers a, customers b, customers c, customers d, customers e, customers f, "
    "customers g, customers h, customers i",
    'SELECT 1 AS "' + "c" * 5000 + '"',
]


@pytest.mark.parametrize("query", EXPENSIVE)
def test_expensive_allowed_functions_stay_within_the_bounds(db_dir, query):
    env = make_env(db_dir, max_turns=2)
    env.reset(LISBON)
    started = time.monotonic()
    seen = env.step(f"<sql>{query}</sql>").observation[0]["content"]
    assert time.monotonic() - started < TIMEOUT + 1.0
    assert len(seen) <= env.options.max_observation_chars + 100
