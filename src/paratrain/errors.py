"""The root of paratrain's exceptions: one family per subsystem.

Bad user input raises ValueError / TypeError naming the value; these classes are for failures of the
distributed system itself (a peer that lied, died or never answered). Every message ends with the
address of its family's section of the troubleshooting page, so a reader of a log knows where to look.
"""

from __future__ import annotations

DOCS_URL = "https://paratrain.github.io/paratrain/"
"""Where the docs site (mkdocs.yml) is published."""

# The troubleshooting page's anchor (docs/troubleshooting.md) of each family, by class name: the
# families defined in other layers (serve, pipeline, launch) are named here too, so that this file
# alone decides where a message points.
ANCHORS = {
    "AuthenticationError": "authentication",
    "TransportError": "transport",
    "RemoteError": "remote",
    "RegistrationError": "rendezvous",
    "RendezvousError": "rendezvous",
    "JobAbortedError": "job-aborted",
    "ClusterError": "cluster",
    "KVStoreTimeoutError": "kvstore-timeout",
    "KVStoreError": "kvstore",
    "CheckpointError": "checkpoint",
    "MissingExtraError": "missing-extra",
    "ServeError": "serve",
    "PipelineError": "pipeline",
    "RayJobError": "ray",
    "ParatrainError": "report",
}


def troubleshooting_url(error: type[BaseException]) -> str:
    """The troubleshooting section of the nearest family of `error` in ANCHORS (the page's top for
    an error that is no ParatrainError)."""
    for cls in error.__mro__:
        if cls.__name__ in ANCHORS:
            return f"{DOCS_URL}troubleshooting/#{ANCHORS[cls.__name__]}"
    return f"{DOCS_URL}troubleshooting/"


class ParatrainError(Exception):
    """Root of every error paratrain raises on purpose."""

    def __str__(self) -> str:
        message = super().__str__()
        # A message that already points into the docs (a peer's error carried in a RemoteError or a
        # scheduler's reason) keeps the first, more specific address.
        if DOCS_URL in message:
            return message
        see = f"see {troubleshooting_url(type(self))}"
        return f"{message} ({see})" if message else see


class TransportError(ParatrainError):
    """A connection failed, a frame was malformed or unauthenticated, or a peer went away."""


class AuthenticationError(TransportError):
    """The peer does not hold the job secret (handshake or frame MAC failed)."""


class RemoteError(ParatrainError):
    """The peer ran our request and it raised; the message carries the peer's error text."""


class ClusterError(ParatrainError):
    """Registration was refused, a barrier timed out, or the job was aborted."""


class RendezvousError(ClusterError):
    """This node could not join the job (version or config mismatch, duplicate rank, timeout)."""


class RegistrationError(RendezvousError):
    """The scheduler refused a node's registration (version, config, role or rank); the message
    says why."""


class JobAbortedError(ClusterError):
    """The scheduler ended the job because some node failed; the message names it."""


class LaunchError(ParatrainError):
    """A job could not be started, asked about or stopped: a cluster's command failed or is
    missing, its driver did not start, or its cluster could not hold it."""


class KVStoreError(ParatrainError):
    """A key-value store operation failed (unknown key, shape mismatch, server refused)."""


class CheckpointError(ParatrainError):
    """A checkpoint is missing, incomplete, corrupt, or holds something other than tensors and plain data."""


class MissingExtraError(ParatrainError, ImportError):
    """An optional dependency is not installed; the message names the extra that installs it."""

    def __init__(self, package: str, extra: str, needed_by: str) -> None:
        super().__init__(
            f"{needed_by} needs {package}, which is not installed: pip install 'paratrain[{extra}]'"
        )
        self.name = package
