"""Notices between the brokers of one PostgreSQL store, through PostgreSQL's LISTEN/NOTIFY:
what one broker must tell the others (a lease or a cancel for a provider whose session is on
another broker; that jobs' events, logs or what placement depends on changed).

Every broker listens on one channel (``CHANNEL``) on a connection of its own and publishes
on another; a notice is a small JSON object naming its sender (a broker ignores its own).
NOTIFY is delivered to every listener of the database once its transaction commits (here:
at once, autocommit), in the order sent; a notice sent while a broker's listening
connection was down is lost to it, which is why what must arrive (a lease) is also found by
polling the store (broker/state.py, ``deliver_leases``). PostgreSQL bounds a payload to
8,000 bytes: a notice carries ids and small messages, never a lease's envelope.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

CHANNEL = "gpumarket_brokers"
MAX_PAYLOAD = 7_900          # PostgreSQL's limit is 8,000 bytes
RETRY_S = 1.0                # after a lost connection, before connecting again
QUEUE_MAX = 10_000           # notices waiting to be published (more are dropped, logged)


class Notices:
    """``await notices.run()`` listens and publishes until cancelled; ``publish(notice)``
    queues a notice (a dict) for the other brokers; ``on_notice(notice)`` is called with
    each notice another broker published."""

    def __init__(self, url: str, sender: str, on_notice: Callable[[dict[str, Any]], None]
                 ) -> None:
        self.url = url
        self.sender = sender
        self.on_notice = on_notice
        self.listening = asyncio.Event()     # set while the listening connection is up
        self._out: asyncio.Queue[str] = asyncio.Queue(QUEUE_MAX)
        self.received = 0
        self.published = 0

    def publish(self, notice: dict[str, Any]) -> None:
        payload = json.dumps({**notice, "from": self.sender}, separators=(",", ":"))
        if len(payload.encode()) > MAX_PAYLOAD:
            log.error("a notice of %d bytes is too long to publish; dropped", len(payload))
            return
        try:
            self._out.put_nowait(payload)
        except asyncio.QueueFull:
            log.error("%d notices wait to be published; one dropped", QUEUE_MAX)

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self._listen())
            tasks.create_task(self._publish())

    async def _connect(self):
        import psycopg

        return await psycopg.AsyncConnection.connect(self.url, autocommit=True,
                                                     connect_timeout=10)

    async def _listen(self) -> None:
        import psycopg

        while True:
            try:
                async with await self._connect() as conn:
                    await conn.execute(f"LISTEN {CHANNEL}")
                    self.listening.set()
                    async for n in conn.notifies():
                        self._dispatch(n.payload)
            except (psycopg.Error, OSError) as exc:
                log.warning("notices: listening connection lost (%s); connecting again",
                            " ".join(str(exc).split())[:200])
            finally:
                self.listening.clear()
            await asyncio.sleep(RETRY_S)

    def _dispatch(self, payload: str) -> None:
        try:
            notice = json.loads(payload)
            if not isinstance(notice, dict) or notice.get("from") == self.sender:
                return
            self.received += 1
            self.on_notice(notice)
        except Exception:   # one bad notice must not stop the listener
            log.exception("notices: a notice could not be handled")

    async def _publish(self) -> None:
        import psycopg

        pending: str | None = None
        while True:
            try:
                async with await self._connect() as conn:
                    while True:
                        if pending is None:
                            pending = await self._out.get()
                        await conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, pending))
                        self.published += 1
                        pending = None
            except (psycopg.Error, OSError) as exc:
                log.warning("notices: publishing connection lost (%s); connecting again",
                            " ".join(str(exc).split())[:200])
            await asyncio.sleep(RETRY_S)
