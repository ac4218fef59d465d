"""The broker's migrations from m024 on: schema.py registers them after its own, in this
order (it reached the 600 lines a module may have)."""

from __future__ import annotations

from sqlite_utils import Database


def m024_task_receipt_paths(db: Database) -> None:
    """One receipt for a task results update's tasks (issue 32, kinds/receipt_tree.py): a
    task's row keeps that receipt (``receipt``) and its path up the receipt's hash tree, so
    a client checks the task's outputs alone against the one signature."""
    db.execute("ALTER TABLE array_tasks ADD COLUMN receipt_path BLOB")


LATER = (m024_task_receipt_paths,)
