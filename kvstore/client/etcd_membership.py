"""Membership from etcd: every daemon registers ``<prefix><addr> -> Member JSON`` under a lease
it keeps alive (kvstore/member/register.py); this source lists the prefix, then watches it
from the next revision, so joins show up at once and departures within the lease TTL.

When etcd is unreachable the last known members stay in force (the data path keeps working)
and the source re-lists with backoff until etcd answers again. A malformed record is skipped
and counted, never fatal.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

from kvstore.client.etcd import EtcdClient, EtcdError, EtcdTarget, EtcdWatchIdle, parse_etcd_url
from kvstore.client.etcd_security import EtcdSecurity
from kvstore.client.membership import Member, Membership, MembershipError

log = logging.getLogger("kvstore.client")


class EtcdMembership(Membership):
    def __init__(
        self,
        target: EtcdTarget | str,
        timeout_s: float = 2.0,
        max_backoff_s: float = 2.0,
        watch_idle_s: float = 60.0,
        security: EtcdSecurity | None = None,
    ) -> None:
        super().__init__()
        self.target = parse_etcd_url(target) if isinstance(target, str) else target
        self.client = EtcdClient(self.target.endpoints, timeout_s, watch_idle_s, security)
        self.max_backoff_s = max_backoff_s
        self.counters: Counter[str] = Counter()
        self.synced = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def start(self, wait_s: float = 2.0) -> None:
        """Start listing + watching; wait up to ``wait_s`` for the first view (never raises)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())
        try:
            await asyncio.wait_for(self.synced.wait(), wait_s)
        except TimeoutError:
            log.warning("event=etcd_not_synced endpoints=%s", ",".join(self.target.endpoints))

    def _parse(self, key: bytes, value: bytes) -> Member | None:
        try:
            return Member.from_json(value)
        except MembershipError as exc:
            self.counters["bad_records"] += 1
            log.warning("event=etcd_bad_record key=%r error=%r", key, str(exc))
            return None

    async def _run(self) -> None:
        backoff = 0.1
        prefix = self.target.prefix
        while True:
            try:
                kvs, rev = await self.client.range_prefix(prefix)
                current = {k: m for k, v in kvs if (m := self._parse(k, v)) is not None}
                self._set(list(current.values()))
                self.synced.set()
                self.counters["lists"] += 1
                backoff = 0.1
                async for typ, key, value in self.client.watch(prefix, rev + 1):
                    if typ == "DELETE":
                        current.pop(key, None)
                    elif (m := self._parse(key, value)) is not None:
                        current[key] = m
                    self._set(list(current.values()))
            except EtcdWatchIdle:
                self.counters["watch_renewals"] += 1
                continue  # a quiet cluster: list again and reopen the watch at once
            except EtcdError as exc:
                self.counters["etcd_errors"] += 1
                log.warning("event=etcd_unavailable error=%r keeping=%d", str(exc), len(self.members))
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.max_backoff_s)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None
        await self.client.close()
