"""The DaemonSet's entrypoint check: kproxy does not start while a value that belongs to the user's cluster is still
the placeholder ``deploy/base/configmap.yaml`` ships, or while it would reach the API server only through the
``kubernetes`` Service whose rules it programs itself.

    python -m kproxy.preflight kproxy run --config /var/lib/kproxy/config.conf ...

checks the ``kproxy run`` command line that follows and then replaces itself with it (``exec``); on a problem it
prints one line per problem, naming the field and where it lives, and exits 2 (the pod crash-loops with that
message in its log instead of running on a wrong cluster CIDR or never listing).

Why each check:

* ``clusterCIDR``: the pod CIDR(s) decide which traffic is masqueraded. A CIDR that is not the cluster's
  masquerades the wrong traffic silently, so the ConfigMap ships ``REPLACE-ME-...`` rather than a lab's value.
* the API server's address: without a kubeconfig the kubernetes client uses the in-cluster settings, which name the
  ``kubernetes`` Service's ClusterIP (``KUBERNETES_SERVICE_HOST``). On a rebooted node nothing programs that
  ClusterIP before kproxy has listed, and kproxy cannot list before it is programmed. kube-proxy's answer (kubeadm)
  is a kubeconfig with the control plane's own address; the ConfigMap ships one whose ``server`` is a placeholder.

Flags win over the ``--config`` file, as in kproxy itself: ``--cluster-cidr``, ``--kubeconfig`` and ``--master``
given on the command line are what is checked then.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

PLACEHOLDER = "REPLACE-ME"


def flag(argv: Sequence[str], name: str) -> str | None:
    """The value of ``--name VALUE`` or ``--name=VALUE`` in ``argv`` (the last one wins, as with argparse)."""
    value = None
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


def _yaml(path: str) -> dict[str, Any]:
    """The YAML mapping in ``path``, or {} when it cannot be read (kproxy itself reports a broken file)."""
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return doc if isinstance(doc, dict) else {}


def kubeconfig_servers(path: str) -> list[tuple[str, str]]:
    """(cluster name, server) of the kubeconfig's current context, or of every cluster when no context is current."""
    doc = _yaml(path)
    clusters = {
        str(c.get("name", "")): str((c.get("cluster") or {}).get("server", ""))
        for c in doc.get("clusters") or []
        if isinstance(c, dict)
    }
    current = str(doc.get("current-context") or "")
    for ctx in doc.get("contexts") or []:
        if isinstance(ctx, dict) and ctx.get("name") == current:
            name = str((ctx.get("context") or {}).get("cluster", ""))
            return [(name, clusters.get(name, ""))]
    return sorted(clusters.items())


def _server_problem(server: str, where: str, env: Mapping[str, str]) -> str | None:
    if PLACEHOLDER in server:
        return (
            f"{where} is still the placeholder {server!r}: set it to the control plane's own address (kubeadm's "
            "controlPlaneEndpoint, e.g. https://192.0.2.10:6443), never the kubernetes Service's ClusterIP"
        )
    service_ip = env.get("KUBERNETES_SERVICE_HOST", "")
    if service_ip and urlsplit(server if "://" in server else f"//{server}").hostname == service_ip.strip("[]"):
        return (
            f"{where} is {server!r}, the kubernetes Service's ClusterIP (KUBERNETES_SERVICE_HOST): kproxy programs "
            "that address itself, so on a rebooted node it could never list; name the control plane's own address"
        )
    return None


def _api_problems(argv: Sequence[str], doc: Mapping[str, Any], env: Mapping[str, str]) -> list[str]:
    master = flag(argv, "--master")
    if master:
        found = _server_problem(master, "--master", env)
        return [found] if found else []
    kubeconfig = flag(argv, "--kubeconfig") or str((doc.get("clientConnection") or {}).get("kubeconfig") or "")
    if kubeconfig:
        where = "--kubeconfig" if flag(argv, "--kubeconfig") else "clientConnection.kubeconfig"
        servers = kubeconfig_servers(kubeconfig)
        if not servers:
            return [f"{where} {kubeconfig}: no cluster server in it (missing or not a kubeconfig)"]
        checked = [_server_problem(s, f"server of cluster {n!r} in {kubeconfig}", env) for n, s in servers]
        return [p for p in checked if p]
    if env.get("KUBERNETES_SERVICE_HOST"):
        return [
            "clientConnection.kubeconfig is empty and there is no --master: the in-cluster settings reach the API "
            f"server through the kubernetes Service ({env['KUBERNETES_SERVICE_HOST']}), which kproxy itself "
            "programs, so on a rebooted node it could never list; give a kubeconfig with the control plane's address"
        ]
    return []


def problems(argv: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """What keeps the ``kproxy run`` command line ``argv`` from starting on a real cluster (empty when nothing)."""
    config = flag(argv, "--config")
    doc = _yaml(config) if config else {}
    out = []
    if flag(argv, "--cluster-cidr") is None:
        cidr = str(doc.get("clusterCIDR") or "")
        if PLACEHOLDER in cidr:
            out.append(
                f"clusterCIDR in {config} is still the placeholder {cidr!r}: set it to the cluster's pod CIDR(s), "
                "comma-separated for dual-stack (kubeadm's networking.podSubnet)"
            )
    return out + _api_problems(argv, doc, env)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print("usage: python -m kproxy.preflight kproxy run [flags...]", file=sys.stderr)
        return 2
    found = problems(args, os.environ)
    for p in found:
        print(f"kproxy: cannot start: {p}", file=sys.stderr)
    if found:
        return 2
    os.execvp(args[0], args)  # noqa: S606 - the DaemonSet's own command line, never a shell


if __name__ == "__main__":
    sys.exit(main())
