"""The Kubernetes engine: one job as Kubernetes objects applied with kubectl (manifests.py); a
submitted job is asked about, followed and deleted with kubectl (job_cluster.py)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from paratrain.launch import job_cluster, jobs
from paratrain.launch.api import IDENTITY_VARS
from paratrain.launch.engines.api import ClusterEngine, LaunchArgs, SpecProblem
from paratrain.launch.engines.k8s.extras import check_overrides
from paratrain.launch.engines.k8s.manifests import K8sOptions

if TYPE_CHECKING:
    from paratrain.launch.api import LaunchConfig
    from paratrain.launch.jobspec import JobSpec


class K8sEngine(ClusterEngine):
    options_type = K8sOptions
    paths_here = False  # the script is in the image, the job's folders on the pods' volumes
    elastic = False  # a failed pod fails its Job: paratrain does not restart pods (manifests.py)

    def options(self, args: LaunchArgs) -> K8sOptions:
        if args.image is None and not args.dry_run:
            raise ValueError(f"--backend {self.name} needs --image (the container image every pod runs)")
        return K8sOptions(
            image=args.image or "IMAGE",
            namespace=args.namespace,
            dry_run=args.dry_run,
            pod_overrides=args.pod_overrides,
            form=args.k8s_form,
            dashboard=args.dashboard,
            **args.resources,
        )

    def launch(self, config: LaunchConfig, options: K8sOptions) -> int:
        from paratrain.launch.engines.k8s.manifests import run_k8s_job

        return run_k8s_job(config, options)

    def job_options(self, spec: JobSpec, job_id: str, folder: Path, dry_run: bool) -> K8sOptions:
        return job_cluster.k8s_options(spec, job_id, dry_run)

    def spec_problems(self, spec: JobSpec) -> list[SpecProblem]:
        problems = super().spec_problems(spec)
        for name in ("output_dir", "data_dir", "work_dir", "trace_dir"):
            value = getattr(spec, name)
            if value is not None and not value.startswith("/"):
                problems.append(
                    ((name,), f"must be an absolute path in the pods with backend k8s, got {value!r}")
                )
        try:
            overrides = {str(role): part for role, part in spec.k8s.pod_overrides.items()}
            check_overrides(overrides, IDENTITY_VARS, "pod_overrides")
        except ValueError as exc:
            where, _, message = str(exc).partition(": ")
            problems.append((tuple(["k8s", *where.split(" ")[0].split(".")]), message or str(exc)))
        if spec.k8s.output_pvc is None:
            problems.append(
                (("k8s", "output_pvc"), "is required with backend k8s: the claim mounted at output_dir")
            )
        if spec.data_dir is not None and spec.k8s.data_pvc is None:
            problems.append(
                (("k8s", "data_pvc"), "is required with backend k8s and a data_dir: the claim mounted there")
            )
        return problems

    def submit_problems(self, spec: JobSpec, dry_run: bool) -> list[str]:
        if spec.k8s.image is None and not dry_run:
            return ["k8s.image: is required to submit (the image every pod runs)"]
        return []

    def dry_run(self, spec: JobSpec, config: LaunchConfig, job_id: str, folder: Path) -> str:
        from paratrain.launch.engines.k8s.manifests import manifests_yaml

        options = self.job_options(spec, job_id, folder, dry_run=True)
        return manifests_yaml(job_cluster.k8s_manifests(spec, config, options))

    def submit(self, spec: JobSpec, config: LaunchConfig, record: jobs.JobRecord, folder: Path) -> str:
        from paratrain.launch.engines.k8s.manifests import manifests_yaml

        options = self.job_options(spec, record.id, folder, dry_run=False)
        job_cluster.k8s_apply(options, manifests_yaml(job_cluster.k8s_manifests(spec, config, options)))
        return "/".join([record.id, spec.k8s.namespace, *(["jobset"] if spec.k8s.form == "jobset" else [])])

    def cluster_state(self, cluster_id: str) -> str | None:
        return job_cluster.k8s_state(cluster_id)

    def cancel(self, cluster_id: str) -> None:
        job_cluster.k8s_delete(cluster_id)

    def logs_command(
        self, record: jobs.JobRecord, role: str | None, rank: int, follow: bool
    ) -> list[str] | None:
        if not record.cluster_id:
            return None
        return job_cluster.k8s_logs_command(record.cluster_id, role, rank, follow)
