"""Where a Ray job's processes go, as plain data: the placement groups and the nodes' names.

Two placement groups reserve one bundle per process. The servers' group is STRICT_SPREAD when at
least as many alive nodes as servers could each hold a server's bundle, so that no two servers
share a node (each server's link then carries only its share of the pushes and pulls); otherwise
SPREAD, Ray's best effort. The scheduler and the workers go in a second, SPREAD group. A bundle no
node could ever hold, or more than the whole cluster has, fails at once rather than after the
placement timeout. No Ray import here: the plans are checked without a cluster.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from paratrain.errors import LaunchError

if TYPE_CHECKING:
    from paratrain.launch.api import LaunchConfig
    from paratrain.launch.engines.ray.driver import RayOptions


class RayJobError(LaunchError):
    """The job could not be placed or started on the Ray cluster (the message says what and where)."""


@dataclass(frozen=True)
class NodeInfo:
    """The Ray node a process landed on."""

    ip: str
    """The node's address, which its processes bind and advertise."""
    node_id: str
    """Ray's id of the node (hex)."""


@dataclass(frozen=True)
class GroupPlan:
    """One placement group: a bundle of resources for each of its members, in order."""

    strategy: str
    """PACK, SPREAD, STRICT_PACK or STRICT_SPREAD (Ray's placement strategies)."""
    bundles: tuple[dict[str, float], ...]
    members: tuple[tuple[str, int], ...]
    """(role, rank) of the process that runs on each bundle."""

    def describe(self) -> str:
        counts = Counter(role for role, _ in self.members)
        who = ", ".join(f"{n} {role}{'s' if n > 1 else ''}" for role, n in counts.items())
        return f"{who} ({self.strategy})"


def role_bundles(options: RayOptions) -> dict[str, dict[str, float]]:
    """The resources one process of each role reserves."""
    worker = {"CPU": float(options.cpus_per_worker)}
    if options.gpus_per_worker:
        worker["GPU"] = float(options.gpus_per_worker)
    return {
        "scheduler": {"CPU": float(options.cpus_per_scheduler)},
        "server": {"CPU": float(options.cpus_per_server)},
        "worker": worker,
    }


def plan_groups(
    config: LaunchConfig, options: RayOptions, nodes: Sequence[Mapping[str, float]]
) -> list[GroupPlan]:
    """The placement groups for the job on a cluster whose alive nodes have these total resources.

    Raises RayJobError when no node could hold some role's bundle, or the cluster is too small.
    """
    bundles = role_bundles(options)
    _check_fits(config, bundles, nodes)
    plans = []
    servers = config.num_servers
    if servers:
        fits = sum(1 for node in nodes if _fits(bundles["server"], node))
        strategy = "STRICT_SPREAD" if fits >= servers > 1 else "SPREAD"
        members = tuple(("server", rank) for rank in range(servers))
        plans.append(GroupPlan(strategy, tuple(dict(bundles["server"]) for _ in members), members))
    members = (("scheduler", 0),) + tuple(("worker", rank) for rank in range(config.num_workers))
    plans.append(GroupPlan("SPREAD", tuple(dict(bundles[role]) for role, _ in members), members))
    return plans


def _fits(bundle: Mapping[str, float], node: Mapping[str, float]) -> bool:
    return all(node.get(name, 0.0) >= amount for name, amount in bundle.items())


def _check_fits(
    config: LaunchConfig, bundles: Mapping[str, Mapping[str, float]], nodes: Sequence[Mapping[str, float]]
) -> None:
    counts = {"scheduler": 1, "server": config.num_servers, "worker": config.num_workers}
    for role, count in counts.items():
        if count and not any(_fits(bundles[role], node) for node in nodes):
            raise RayJobError(
                f"no node of the Ray cluster can hold a {role} ({_show(bundles[role])}); its "
                f"{len(nodes)} alive node(s) have {', '.join(_show(n) for n in nodes) or 'nothing'}"
            )
    for name in ("CPU", "GPU"):
        needed = sum(bundles[role].get(name, 0.0) * count for role, count in counts.items())
        total = sum(node.get(name, 0.0) for node in nodes)
        if needed > total:
            raise RayJobError(
                f"the job needs {needed:g} {name} ({counts['worker']} workers, {counts['server']} "
                f"servers and a scheduler) but the Ray cluster has {total:g} in all"
            )


def _show(resources: Mapping[str, float]) -> str:
    shown = [f"{name} {resources[name]:g}" for name in ("CPU", "GPU") if resources.get(name)]
    return " ".join(shown) or "no CPU"


def node_labels(nodes: Sequence[NodeInfo]) -> dict[str, str]:
    """A short name for each node id: its address, with the start of its id where several nodes
    share an address (nodes simulated on one machine)."""
    ids_by_ip: dict[str, set[str]] = {}
    for node in nodes:
        ids_by_ip.setdefault(node.ip, set()).add(node.node_id)
    return {
        node.node_id: node.ip if len(ids_by_ip[node.ip]) == 1 else f"{node.ip}/{node.node_id[:6]}"
        for node in nodes
    }
