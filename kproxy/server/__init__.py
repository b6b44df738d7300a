"""kproxy's HTTP side: node health (/healthz, /livez), per-service healthCheckNodePort servers, and the metrics
server (/metrics, /proxyMode, /configz, /rules, /verify, /trace), each with upstream kube-proxy's codes, headers and
bodies, all started by the daemon.

Modules: ``health`` (the state and JSON of node health, no sockets), ``connections`` (the limits every server puts
on hostile clients: connections per service and in all, header bytes, a whole-request deadline, 400 for malformed
requests), ``http`` (HealthzServer, MetricsServer and the listening-socket helper), ``service_health``
(ServiceHealthServer).
"""

from kproxy.server.health import ProxyHealth
from kproxy.server.http import HealthzServer, MetricsServer
from kproxy.server.service_health import ServiceHealthServer

__all__ = ["HealthzServer", "MetricsServer", "ProxyHealth", "ServiceHealthServer"]
