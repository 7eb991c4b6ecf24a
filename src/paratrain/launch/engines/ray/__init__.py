"""The Ray engine: every process of the job on a node of an existing Ray cluster (driver.py)."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path
from typing import IO, TYPE_CHECKING

from paratrain.launch.engines.api import DrivenEngine, LaunchArgs
from paratrain.launch.engines.ray.driver import RayOptions

if TYPE_CHECKING:
    from paratrain.launch.api import LaunchConfig
    from paratrain.launch.jobspec import JobSpec
    from paratrain.launch.report import JobResult


class RayEngine(DrivenEngine):
    options_type = RayOptions

    def options(self, args: LaunchArgs) -> RayOptions:
        return RayOptions(address=args.address, **args.resources)

    def launch(self, config: LaunchConfig, options: RayOptions) -> int:
        from paratrain.launch.engines.ray.driver import run_ray_job

        return run_ray_job(config, options)

    def job_options(self, spec: JobSpec, job_id: str, folder: Path, dry_run: bool) -> RayOptions:
        from paratrain.launch.jobspec import launch_args

        return self.options(launch_args(spec, dry_run))

    def where(self, spec: JobSpec) -> str:
        return f"the Ray cluster at {spec.ray.address}"

    def drive(self, spec: JobSpec, config: LaunchConfig, out: IO[str]) -> JobResult:
        """The job on Ray, once every node has been seen to hold data_dir and output_dir."""
        import ray

        from paratrain.launch.engines.ray.driver import run_ray
        from paratrain.launch.report import JobResult

        connected_here = not ray.is_initialized()
        if connected_here:
            try:
                ray.init(address=spec.ray.address, log_to_driver=False, logging_level=logging.WARNING)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                report = f"paratrain: could not connect to the Ray cluster at {spec.ray.address!r}: {exc}\n"
                return JobResult(1, None, report, [])
        try:
            missing = missing_on_ray_nodes([d for d in (spec.data_dir, spec.output_dir) if d])
            if missing:
                report = (
                    f"paratrain: the job's directories must be on a file system every node sees: {missing}\n"
                )
                out.write(report)
                return JobResult(1, None, report, [])
            return run_ray(config, self.job_options(spec, "", Path(), False), out=out, err=out)
        finally:
            if connected_here:
                ray.shutdown()


def missing_on_ray_nodes(paths: list[str], timeout_s: float = 60.0) -> str:
    """'' when every alive node of the connected Ray cluster has every folder in `paths`, else which
    node lacks which."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0)
    def where_missing(paths: list[str]) -> tuple[str, list[str]]:
        return socket.gethostname(), [p for p in paths if not os.path.isdir(p)]

    nodes = [node["NodeID"] for node in ray.nodes() if node.get("Alive")]
    refs = [
        where_missing.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(
            paths
        )
        for node in nodes
    ]
    answers = ray.get(refs, timeout=timeout_s)
    return "; ".join(f"node {host} has no {', '.join(lacks)}" for host, lacks in answers if lacks)
