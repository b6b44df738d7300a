"""kproxy's HTTP side: node health (/healthz, /livez), per-service healthCheckNodePort servers, and the metrics
server (/metrics, /proxyMode, /configz, /rules), each with upstream kube-proxy's codes, headers and bodies.

Modules: ``health`` (the state and JSON of node health, no sockets), ``http`` (HealthzServer, MetricsServer and
the listening-socket helper), ``service_health`` (ServiceHealthServer). Who uses it: the daemon.
"""

from kproxy.server.health import ProxyHealth
from kproxy.server.http import HealthzServer, MetricsServer
from kproxy.server.service_health import ServiceHealthServer

__all__ = ["HealthzServer", "MetricsServer", "ProxyHealth", "ServiceHealthServer"]
