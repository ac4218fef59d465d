"""One receipt for many tasks of a job array (docs/jobs.md, "Task results"): a provider
signs one Receipt for a task results update whose ``tasks_root`` is the root of a hash tree
over the update's tasks, each leaf one task's index and the output files it left. A task's
outputs are then proved signed by that one signature and its path up the tree (a few dozen
bytes a level), so the broker checks one signature an update instead of one a task, and a
client still checks each task's outputs alone, as the provider named them.

The provider, the broker and the client all build and walk the tree with this code. Leaves
and inner nodes hash with different prefixes, so no inner node can pass for a leaf; an odd
node is carried up unchanged (never paired with itself). No grpc here."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence

from gpumarket.proto.v1 import types_pb2 as pb

HASH_BYTES = 32
STEP_BYTES = 1 + HASH_BYTES      # a path's step: which side the sibling is on, its hash
LEFT, RIGHT = b"L", b"R"


class PathError(ValueError):
    """A task's path to its receipt's root is malformed (not whole steps, a bad side)."""


def task_leaf(task: int, outputs: Iterable[pb.ArtifactRef]) -> bytes:
    """The leaf of one task: its index and every output it left (name, sha256, size), in
    name order, encoded one way only (JSON of plain values)."""
    refs = sorted((o.name, o.sha256, int(o.size_bytes)) for o in outputs)
    body = json.dumps([int(task), refs], separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(b"\x00" + body.encode()).digest()


def _node(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def root(leaves: Sequence[bytes]) -> bytes:
    """The root over ``leaves`` (in order); ValueError for no leaves."""
    return _levels(leaves)[-1][0]


def tree(leaves: Sequence[bytes]) -> tuple[bytes, list[bytes]]:
    """The root over ``leaves`` (in order) and each leaf's path to it (``root_of`` walks
    one); ValueError for no leaves."""
    levels = _levels(leaves)
    paths = []
    for i in range(len(leaves)):
        steps = []
        for level in levels[:-1]:
            sibling = i ^ 1
            if sibling < len(level):        # (else: the odd node, carried up unchanged)
                steps.append((LEFT if sibling < i else RIGHT) + level[sibling])
            i //= 2
        paths.append(b"".join(steps))
    return levels[-1][0], paths


def _levels(leaves: Sequence[bytes]) -> list[list[bytes]]:
    """Every level of the tree, the leaves first, the root alone last."""
    if not leaves:
        raise ValueError("a receipt tree needs at least one task")
    levels = [list(leaves)]
    while len(levels[-1]) > 1:
        level = levels[-1]
        up = [_node(level[k], level[k + 1]) for k in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            up.append(level[-1])
        levels.append(up)
    return levels


def root_of(leaf: bytes, path: bytes) -> bytes:
    """The root that ``leaf`` reaches by ``path`` (PathError if it is malformed)."""
    if len(path) % STEP_BYTES:
        raise PathError(f"a path of {len(path)} bytes is not whole steps of {STEP_BYTES}")
    node = leaf
    for k in range(0, len(path), STEP_BYTES):
        side, sibling = path[k:k + 1], path[k + 1:k + STEP_BYTES]
        if side == RIGHT:
            node = _node(node, sibling)
        elif side == LEFT:
            node = _node(sibling, node)
        else:
            raise PathError(f"a path's step {k // STEP_BYTES} has no side")
    return node


def covers(receipt: pb.Receipt, task: int, outputs: Iterable[pb.ArtifactRef],
           path: bytes) -> bool:
    """Whether ``receipt`` (an update's, with a ``tasks_root``) signs exactly these
    ``outputs`` of ``task``, by its ``path``."""
    if len(receipt.tasks_root) != HASH_BYTES:
        return False
    try:
        return root_of(task_leaf(task, outputs), path) == receipt.tasks_root
    except PathError:
        return False
