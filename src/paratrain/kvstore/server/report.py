"""A server's figures for the dashboard, read from the counters its shards keep as they serve.

`server_report(kv)` is what a server's heartbeat carries (node.py passes it to its SchedulerLink):
totals of pushes, pulls and bytes, late pushes dropped (backup workers), the pulls queued for a
round (queue depth), open rounds, the staleness histogram, the rows of each sparse table, and the
hottest keys by bytes moved, each with its counts and version. Per key, `pushes` and `pulls` are the
largest count of the key's slices here and bytes are their sum, as `DistKVStore.stats()` combines
slices, so the two can be compared.

Also the answers to a worker's `stats` (per shard) and `waiting` (what holds its pull back) requests.
"""

from __future__ import annotations

import logging
from typing import Any

from paratrain.kvstore.protocol import Waiting
from paratrain.metrics.telemetry import process_figures

logger = logging.getLogger(__name__)

TOP_KEYS = 20
NAME_CHARS = 120
"""Key names are cut to this length: the report rides on a heartbeat, whose header is capped."""
COUNTS = ("pushes", "pulls", "bytes_in", "bytes_out", "late")


def server_report(server: Any, top: int = TOP_KEYS) -> dict[str, Any]:
    with server._lock:
        shards = list(server._shards.values())
    waiting = len(server.pulls.waiting())
    keys: dict[Any, dict[str, Any]] = {}
    for shard in shards:
        counts = dict(shard.counts)  # a copy: the serving threads keep counting
        entry = keys.setdefault(
            shard.key,
            {"key": str(shard.key)[:NAME_CHARS], **dict.fromkeys(COUNTS, 0), "version": shard.version},
        )
        entry["pushes"] = max(entry["pushes"], counts["pushes"])
        entry["pulls"] = max(entry["pulls"], counts["pulls"])
        entry["late"] = max(entry["late"], counts["late"])
        entry["bytes_in"] += counts["bytes_in"]
        entry["bytes_out"] += counts["bytes_out"]
        entry["version"] = min(entry["version"], shard.version)
    hottest = sorted(keys.values(), key=lambda k: k["bytes_in"] + k["bytes_out"], reverse=True)[:top]
    return {
        **{name: sum(s.counts[name] for s in shards) for name in COUNTS},
        "waiting_pulls": waiting,
        "open_rounds": sum(len(s.rounds) for s in shards),
        "staleness": sorted([int(behind), int(count)] for behind, count in dict(server.staleness).items()),
        "tables": _tables(server),
        "keys": hottest,
        **process_figures(),
    }


def _tables(server: Any) -> list[dict[str, Any]]:
    tables = dict(server.tables.tables)
    rows: list[dict[str, Any]] = [
        {"key": str(key)[:NAME_CHARS], "rows": int(table.rows.count)} for key, table in tables.items()
    ]
    return sorted(rows, key=lambda t: t["rows"], reverse=True)[:TOP_KEYS]


def waits(server: Any, query: Waiting) -> list[dict]:
    """`waiting`: the rounds that hold back a waiting worker's pulls: per slice below its min_version,
    the round applied next and the members that have not pushed it."""
    rank = query.rank
    shards = server.shards_of(query)
    needs = [s.pull_version(rank, need) for s, need in zip(shards, query.min_versions, strict=True)]
    behind = [s.waiting(need) for s, need in zip(shards, needs, strict=True)]
    behind = [w for w in behind if w is not None]
    if behind:
        logger.warning(
            "server %d: worker %d waits for %s",
            server.rank,
            rank,
            "; ".join(
                f"round {w['round']} of key {w['key']!r} [{w['start']}, {w['stop']}), which worker(s) "
                f"{', '.join(map(str, w['missing'])) or 'none (being applied)'} have not pushed"
                for w in behind[:8]
            )
            + (f"; and {len(behind) - 8} more slices" if len(behind) > 8 else ""),
        )
    return behind


def stats(server: Any) -> dict:
    """`stats`: per shard, its counts, version, open rounds and the pulls waiting on it (queue depth)."""
    with server._lock:
        shards = list(server._shards.values())
    waiting = [s for pull in server.pulls.waiting() for s in pull.shards]
    return {"shards": [s.stats(sum(1 for w in waiting if w is s)) for s in shards]}
