"""The lab: a Kubernetes-like cluster made of network namespaces, its API stand-in, pod echo servers and probes.

Used by ``kproxy lab``, the conformance suite and the benchmarks. The public names (``Lab``, ``LabNode``,
``LabPod``, ``LabError``, ``ProbeResult``) are imported lazily, so ``python -m kproxy.lab.echo`` and
``python -m kproxy.lab.probe`` (started once per pod and once per probe) stay standard-library-only and fast
(not even ``typing`` is imported on that path).
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from kproxy.lab.cluster import Lab, LabError, LabNode, LabPod
    from kproxy.lab.probe import ProbeResult

__all__ = ["Lab", "LabError", "LabNode", "LabPod", "ProbeResult"]


def __getattr__(name: str) -> object:
    if name == "ProbeResult":
        from kproxy.lab import probe

        return probe.ProbeResult
    if name in ("Lab", "LabError", "LabNode", "LabPod"):
        from kproxy.lab import cluster

        return getattr(cluster, name)
    raise AttributeError(f"module 'kproxy.lab' has no attribute {name!r}")
