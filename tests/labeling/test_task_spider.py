"""Spider task on tiny local fixtures in the xlangai/spider row format."""
from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest

from labeling.tasks import TaskError, build_task
from labeling.tasks.spider import SpiderTask, read_schema


def make_databases(db_dir: Path) -> None:
    specs = {
        "concert": ("CREATE TABLE singer (id INTEGER PRIMARY KEY, name TEXT, age INTEGER)",
                    "INSERT INTO singer VALUES (1, 'Ann', 34), (2, 'Ben', 28), (3, 'Cara', 41)"),
        "pets": ("CREATE TABLE pet (pet_id INTEGER, kind TEXT, weight REAL)",
                 "INSERT INTO pet VALUES (1, 'dog', 12.5), (2, 'cat', 4.0)"),
    }
    for db_id, (ddl, rows) in specs.items():
        (db_dir / db_id).mkdir(parents=True)
        conn = sqlite3.connect(db_dir / db_id / f"{db_id}.sqlite")
        conn.execute(ddl)
        conn.execute(rows)
        conn.commit()
        conn.close()


def row(db_id: str, question: str, query: str) -> dict:
    """A row with the hub's fields, token lists included."""
    return {"db_id": db_id, "query": query, "question": question, "query_toks": query.split(),
            "query_toks_no_value": query.split(), "question_toks": question.split()}


TRAIN = [
    row("concert", "How many singers are there?", "SELECT count(*) FROM singer"),
    row("concert", "Names of singers older than 30?", "SELECT name FROM singer WHERE age > 30"),
    row("concert", "Average singer age?", "SELECT avg(age) FROM singer"),
    row("pets", "How many pets are there?", "SELECT count(*) FROM pet"),
    row("pets", "What kinds of pets are there?", "SELECT DISTINCT kind FROM pet"),
    row("pets", "Heaviest pet weight?", "SELECT max(weight) FROM pet"),
]
DEV = [
    row("concert", "Names of singers by age?", "SELECT name FROM singer ORDER BY age"),
    row("pets", "Weight of the cat?", "SELECT weight FROM pet WHERE kind = 'cat'"),
    row("concert", "Youngest singer?", "SELECT name FROM singer ORDER BY age LIMIT 1"),
]


@pytest.fixture
def spider(tmp_path: Path, write_jsonl: Callable) -> dict[str, str]:
    write_jsonl(tmp_path / "spider" / "train.jsonl", TRAIN)
    write_jsonl(tmp_path / "spider" / "validation.jsonl", DEV)
    make_databases(tmp_path / "database")
    return {"source": str(tmp_path / "spider"), "db_dir": str(tmp_path / "database")}


def test_splits_follow_the_paper(spider: dict[str, str]) -> None:
    task = SpiderTask(val_size=2, **spider)
    train, val, test = (task.load_split(s) for s in ("train", "validation", "test"))
    assert (len(train), len(val), len(test)) == (4, 2, 3)
    assert not {e.question for e in train} & {e.question for e in val}
    assert {e.question for e in train} | {e.question for e in val} == {r["question"] for r in TRAIN}
    assert [e.question for e in test] == [r["question"] for r in DEV]  # hub 'validation' = Spider dev = our test
    assert [e.question for e in SpiderTask(val_size=2, **spider).load_split("validation")] == [e.question for e in val]


def test_prompt_has_schema_and_question(spider: dict[str, str]) -> None:
    task = SpiderTask(val_size=2, **spider)
    ex = task.load_split("test")[1]
    assert ex.meta["db_id"] == "pets"
    content = task.messages(ex)[0]["content"]
    assert "CREATE TABLE pet (pet_id INTEGER, kind TEXT, weight REAL);" in content
    assert "singer" not in content  # only this example's database
    assert "Weight of the cat?" in content
    assert "```sql" in content


def test_read_schema_lists_every_table(tmp_path: Path) -> None:
    db = tmp_path / "x.sqlite"
    conn = sqlite3.connect(db)
    conn.executescript("CREATE TABLE a (x INT); CREATE TABLE b (y TEXT); CREATE INDEX ia ON a(x);")
    conn.close()
    assert read_schema(db) == "CREATE TABLE a (x INT);\n\nCREATE TABLE b (y TEXT);"


def test_scoring_by_execution(spider: dict[str, str]) -> None:
    task = SpiderTask(val_size=2, **spider)
    by_age, cat, _ = task.load_split("test")
    assert task.score(by_age, "```sql\nSELECT name FROM singer ORDER BY age ASC;\n```") == 1
    assert task.score(by_age, "```sql\nSELECT name FROM singer ORDER BY age DESC;\n```") == 0  # gold is ordered
    assert task.score(cat, "SELECT weight FROM pet WHERE pet_id = 2") == 1
    assert task.score(cat, "SELECT weight FROM pet") == 0
    assert task.score(cat, "DELETE FROM pet") == 0


def test_unset_db_dir_fails_at_load_with_the_fix(spider: dict[str, str]) -> None:
    with pytest.raises(TaskError, match="db_dir"):
        SpiderTask(source=spider["source"], val_size=2).load_split("test")


def test_missing_database_names_db_id_and_path(spider: dict[str, str], tmp_path: Path, write_jsonl: Callable) -> None:
    write_jsonl(tmp_path / "spider2" / "validation.jsonl", [row("world_1", "Population of France?", "SELECT 1")])
    task = SpiderTask(source=str(tmp_path / "spider2"), db_dir=spider["db_dir"])
    with pytest.raises(TaskError) as err:
        task.load_split("test")
    assert "world_1" in str(err.value)
    assert str(Path(spider["db_dir"]) / "world_1" / "world_1.sqlite") in str(err.value)


def test_row_without_hub_fields_is_a_clear_error(spider: dict[str, str], tmp_path: Path, write_jsonl: Callable) -> None:
    write_jsonl(tmp_path / "bad" / "validation.jsonl", [{"database": "concert", "sql": "SELECT 1", "question": "q"}])
    with pytest.raises(TaskError, match="db_id"):
        SpiderTask(source=str(tmp_path / "bad"), db_dir=spider["db_dir"]).load_split("test")


def test_registry_builds_spider_with_sizes(spider: dict[str, str]) -> None:
    task = build_task("spider", sizes={"test": 1}, val_size=2, **spider)
    assert len(task.load_split("test")) == 1
    assert task.max_new_tokens == 256
