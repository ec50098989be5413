"""Spider text-to-SQL (``xlangai/spider``, config ``spider``, or a local directory of JSONL).

Hub rows (checked against the dataset card): ``db_id``, ``query`` (gold SQL), ``question``,
plus token lists we do not use. The hub has splits ``train`` (7000) and ``validation``
(1034, Spider's dev set); the official test set is not on the hub, so the dev set plays the
"official test" role (``test_split: validation``; set ``test_split: test`` for a local
directory that holds the released test set). A local directory mirrors the hub split names:
``train.jsonl`` and ``validation.jsonl`` (or ``test.jsonl``) with the same fields.

The databases are not on the hub: ``db_dir`` must point at the Spider ``database`` folder
holding ``<db_id>/<db_id>.sqlite``. Prompt: the schema (the ``CREATE TABLE`` statements read
from the database file) and the question; output limit 256 tokens (paper). Q(·): execution
match in the SQL sandbox, on a private read-only copy of the database with a timeout and result
caps (``labeling/evaluators/sql.py``); the schema is read the same way.
"""
from __future__ import annotations

import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

from labeling.evaluators.sql import DEFAULT_TIMEOUT_S, execute_readonly, execution_match, sql_decided
from labeling.tasks.base import BaseTask, Example, TaskError, require_nonempty
from labeling.tasks.sources import PaperSplitOptions, paper_split

INSTRUCTION = "Write one SQLite query that answers the question. Put it in a ```sql code block."
SCHEMA_SQL = (
    "SELECT sql FROM sqlite_master WHERE type = 'table' AND sql IS NOT NULL "
    "AND name NOT LIKE 'sqlite_%' ORDER BY rowid"
)


def database_path(db_dir: str | Path | None, db_id: str) -> Path:
    """``<db_dir>/<db_id>/<db_id>.sqlite``; raise TaskError if ``db_dir`` is unset or the file is missing."""
    if db_dir is None:
        raise TaskError(
            f"task 'spider': no database directory for db_id '{db_id}'. Set task.db_dir (conf/task/spider.yaml, "
            f"options.db_dir) to the Spider 'database' folder holding <db_id>/<db_id>.sqlite."
        )
    if not db_id or "/" in db_id or "\\" in db_id or db_id in (".", ".."):
        raise TaskError(f"task 'spider': invalid db_id {db_id!r} in the dataset; expected a plain database name.")
    path = Path(db_dir).expanduser() / db_id / f"{db_id}.sqlite"
    if not path.is_file():
        raise TaskError(
            f"task 'spider': database for db_id '{db_id}' not found at {path}. Set task.db_dir "
            f"(conf/task/spider.yaml, options.db_dir) to the Spider 'database' folder holding "
            f"<db_id>/<db_id>.sqlite."
        )
    return path


def read_schema(db_path: Path) -> str:
    """The database's ``CREATE TABLE`` statements, one per paragraph, as stored by SQLite (read in
    the SQL sandbox, on a private copy); TaskError if the file is not a readable SQLite database."""
    try:
        rows = execute_readonly(db_path, SCHEMA_SQL)
    except (sqlite3.Error, OSError) as err:
        raise TaskError(f"task 'spider': cannot read the schema of {db_path} ({err}); replace it with the "
                        f"database file from the Spider release.") from None
    return "\n\n".join(row[0].strip() + ";" for row in rows)


@dataclass
class SpiderOptions(PaperSplitOptions):
    """db_dir: the Spider release's ``database`` folder; test_split: the source split used as
    test; timeout_s: execution timeout per query."""

    rules = {"hub_config": "optional_text", "db_dir": "optional_text", "test_split": "text",
             "timeout_s": "positive_number"}

    source: str = "xlangai/spider"
    hub_config: str | None = "spider"
    db_dir: str | None = None
    test_split: str = "validation"
    max_new_tokens: int = 256
    timeout_s: float = DEFAULT_TIMEOUT_S


@dataclass
class SpiderTask(BaseTask, SpiderOptions):
    name = "spider"
    required_fields = {"db_id": (str,), "query": (str,), "question": (str,)}
    Options = SpiderOptions
    _schemas: dict[str, str] = field(default_factory=dict, init=False, repr=False)

    def schema(self, db_id: str) -> str:
        """Schema text of ``db_id`` (cached); TaskError if the database file is missing."""
        if db_id not in self._schemas:
            self._schemas[db_id] = read_schema(database_path(self.db_dir, db_id))
        return self._schemas[db_id]

    def load_split(self, split: str) -> list[Example]:
        official = self.test_split if split == "test" else "train"
        rows = paper_split(self.name, self.source, split, self.val_size, self.seed, test_split=self.test_split,
                           hub_config=self.hub_config)
        examples = []
        for i, r in enumerate(rows):
            missing = [k for k in self.required_fields if not r.get(k)]
            if missing:
                raise TaskError(f"task 'spider': a row of split '{official}' in {self.source} lacks field(s) "
                                f"{missing} ({str(r)[:100]}…); expected the xlangai/spider fields "
                                f"db_id, query, question.")
            examples.append(Example(uid=f"spider-{split}-{i}", question=r["question"], reference=r["query"],
                                    meta={"db_id": r["db_id"]}))
        examples = require_nonempty(self.name, split, self.sizes.cap(split, examples), self.source)
        for ex in examples:  # fail fast on a missing database, before any generation
            self.schema(ex.meta["db_id"])
        return examples

    def messages(self, ex: Example) -> list[dict[str, str]]:
        schema = self.schema(ex.meta["db_id"])
        return [{"role": "user", "content": f"Database schema:\n{schema}\n\nQuestion: {ex.question}\n{INSTRUCTION}"}]

    def score(self, ex: Example, response: str) -> int:
        return execution_match(response, ex.reference, database_path(self.db_dir, ex.meta["db_id"]), self.timeout_s)

    def decided(self, ex: Example, prefix: str) -> bool:
        return sql_decided(prefix)
