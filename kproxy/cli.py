"""The ``kproxy`` command: ``run``, ``cleanup``, ``show``, and the tools (``apiserver``, ``lab``, ``conformance``,
``bench``, ``compare``) whose sub-commands each tool package registers itself.

Flag names follow upstream kube-proxy where one exists (``--cluster-cidr``, ``--hostname-override``,
``--nodeport-addresses``, ``--iptables-localhost-nodeports``, ``--masquerade-all``, ``--min-sync-period``,
``--sync-period``, ``--healthz-bind-address``, ``--metrics-bind-address``, ``--kubeconfig``, ``--master``,
``--config``, ``--cleanup``, ``--proxy-mode``), so a kube-proxy DaemonSet's arguments carry over. Backends declare
their own flags (``Proxier.add_arguments``); the mode list in ``--help`` comes from the one mode table in
``kproxy.proxier``.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

from kproxy import __version__, top
from kproxy.bench.cli import register as register_bench
from kproxy.config import (
    DETECT_LOCAL_MODES,
    ConfigError,
    ProxyConfig,
    build_config,
    load_config_file,
    parse_duration,
    parse_hostport,
)
from kproxy.conformance.cli import register as register_conformance
from kproxy.counters import Measure
from kproxy.demo import register as register_demo
from kproxy.lab.apicli import register as register_apiserver
from kproxy.lab.cli import register as register_lab
from kproxy.proxier import (
    DEFAULT_MODE,
    MODE_NAMES,
    MODES,
    BackendError,
    LocalProbe,
    Proxier,
    availability,
    backend_class,
    cleanup_other_modes,
    installed_backends,
)
from kproxy.soak.cli import register as register_soak

log = logging.getLogger("kproxy")

# flag dest -> ProxyConfig field, for the flags that configure the core (defaults are suppressed so that only
# flags given on the command line override the --config file).
_CONFIG_FLAGS = {
    "mode": "mode",
    "hostname_override": "hostname_override",
    "cluster_cidr": "cluster_cidrs",
    "detect_local_mode": "detect_local_mode",
    "pod_bridge_interface": "pod_bridge_interface",
    "pod_interface_name_prefix": "pod_interface_name_prefix",
    "nodeport_addresses": "nodeport_addresses",
    "masquerade_all": "masquerade_all",
    "iptables_localhost_nodeports": "localhost_nodeports",
    "iptables_masquerade_bit": "masquerade_bit",
    "min_sync_period": "min_sync_period",
    "sync_period": "sync_period",
    "healthz_bind_address": "healthz_bind_address",
    "metrics_bind_address": "metrics_bind_address",
    "kubeconfig": "kubeconfig",
    "master": "master",
    "manifests": "manifests",
    "service_proxy_name": "service_proxy_name",
    "max_service_entries": "max_service_entries",
    "service_counters": "service_counters",
}


def _modes_help() -> str:
    return "; ".join(f"{m.name}: {m.summary}" for m in MODES)


def _add_run_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    S = argparse.SUPPRESS
    p = sub.add_parser(
        "run",
        help="run the proxy on this node",
        description="Run the service proxy. Modes, in order: " + _modes_help(),
    )
    p.add_argument("--mode", "--proxy-mode", dest="mode", default=S, help=f"one of {', '.join(MODE_NAMES)}")
    p.add_argument("--config", default=None, help="a KubeProxyConfiguration YAML file; flags given override it")
    p.add_argument("--kubeconfig", default=S, help="kubeconfig file (default: in-cluster service account)")
    p.add_argument("--master", default=S, help="API server address, overrides the kubeconfig's")
    p.add_argument("--manifests", default=S, help="read Services/EndpointSlices/Node from this folder instead")
    p.add_argument("--hostname-override", default=S, help="this node's Node name (default: the host name)")
    p.add_argument("--cluster-cidr", action="append", default=S, help="pod CIDR(s) of the cluster, comma-separated")
    p.add_argument("--detect-local-mode", default=S, choices=DETECT_LOCAL_MODES)
    p.add_argument("--pod-bridge-interface", default=S, help="the pods' bridge (--detect-local-mode BridgeInterface)")
    p.add_argument(
        "--pod-interface-name-prefix",
        default=S,
        help="pods' interface prefix (--detect-local-mode InterfaceNamePrefix)",
    )
    p.add_argument(
        "--nodeport-addresses",
        action="append",
        default=S,
        help="CIDRs (or 'primary') whose local addresses accept NodePorts; default all",
    )
    p.add_argument("--masquerade-all", action="store_true", default=S, help="SNAT all traffic to service IPs")
    p.add_argument(
        "--iptables-localhost-nodeports",
        type=_bool_flag,
        nargs="?",
        const=True,
        default=S,
        metavar="BOOL",
        help="NodePorts answer on 127.0.0.1 too when --nodeport-addresses lets loopback in; IPv4 only; every mode "
        "(true; upstream's iptables.localhostNodePorts)",
    )
    p.add_argument("--iptables-masquerade-bit", type=int, default=S, help="fwmark bit for masquerading (14)")
    p.add_argument("--min-sync-period", type=_duration_flag, default=S, help="min interval between syncs (1s)")
    p.add_argument(
        "--sync-period",
        type=_duration_flag,
        default=S,
        help="retry interval after a failed sync and periodic resync (30s)",
    )
    p.add_argument("--healthz-bind-address", default=S, help="HOST:PORT of /healthz and /livez (0.0.0.0:10256)")
    p.add_argument("--metrics-bind-address", default=S, help="HOST:PORT of /metrics (127.0.0.1:10249)")
    p.add_argument(
        "--service-proxy-name",
        default=S,
        help="serve services labelled service.kubernetes.io/service-proxy-name=<this>",
    )
    p.add_argument(
        "--max-service-entries",
        type=int,
        default=S,
        help="refuse a Service whose ports expand to more entries (addresses + endpoints, summed over its ports) "
        "than this (100000)",
    )
    p.add_argument(
        "--service-counters",
        action="store_true",
        default=S,
        help="count connections (and packets and bytes where the mode can) per service port and endpoint, as "
        "kproxy_service_*_total metrics (kproxy top); off by default",
    )
    p.add_argument("--cleanup", action="store_true", help="remove every mode's rules and exit (as upstream)")
    p.add_argument(
        "--no-cleanup-other-modes", action="store_true", help="do not remove other modes' leftovers at start-up"
    )
    p.set_defaults(func=cmd_run, backend_flags=_add_backend_flags(p))


def _bool_flag(text: str) -> bool:
    """A boolean flag's value as Go's flag package reads it (``--flag``, ``--flag=false``)."""
    value = text.strip().lower()
    if value in ("1", "t", "true"):
        return True
    if value in ("0", "f", "false"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not true or false")


def _duration_flag(text: str) -> float:
    """A duration flag's value; argparse names the flag in front of the message and exits 2."""
    try:
        return parse_duration(text, "")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_backend_flags(p: argparse.ArgumentParser) -> dict[str, list[str]]:
    """Every installed backend's typed options as flags, in a group per mode; mode -> the flags' dests."""
    backend_flags: dict[str, list[str]] = {}
    for mode, cls in installed_backends().items():
        if cls.options:
            backend_flags[mode] = cls.add_arguments(p.add_argument_group(f"{mode} mode"))
    return backend_flags


def _backend_options(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    return {dest: getattr(args, dest) for dest in args.backend_flags.get(mode, []) if hasattr(args, dest)}


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    file_values = load_config_file(args.config) if args.config else {}
    flags: dict[str, Any] = {}
    for dest, field_name in _CONFIG_FLAGS.items():
        if hasattr(args, dest):
            flags[field_name] = getattr(args, dest)
    flags["mode"] = flags.get("mode") or file_values.get("mode") or DEFAULT_MODE
    flags["backend_options"] = _backend_options(args, flags["mode"])
    return build_config(file_values, flags)


def _cleanup_other_modes(config: ProxyConfig) -> None:
    # another mode's cleanup failing must not stop this one from starting
    for mode, error in cleanup_other_modes(config).items():
        if error is None:
            log.info("removed leftovers of mode %s (if any)", mode)
        else:
            log.warning("could not remove leftovers of mode %s: %s", mode, error)


def _make_source_factory(config: ProxyConfig) -> tuple[Any, Any]:
    """The source for the daemon, and an event sink (queued Warning Events about a service or this node) when there
    is an API server."""
    from pathlib import Path

    if config.manifests:
        from kproxy.sources.files import FilesSource

        return (lambda sink: FilesSource(sink, Path(config.manifests), config.node_name)), None
    from kproxy.sources.events import EventRecorder
    from kproxy.sources.kube import KubeSource, make_api_client

    client = make_api_client(config.kubeconfig, config.master)
    # events go through the recorder's queue and worker thread: a slow API server never holds up a sync
    recorder = EventRecorder(client, config.node_name)
    # upstream's "Starting" event, best effort and off the start-up path
    recorder.post("Starting", "", None, type_="Normal", action="StartKubeProxy")

    def factory(sink: Any) -> Any:
        return KubeSource(
            sink,
            client,
            config.node_name,
            service_proxy_name=config.service_proxy_name,
            on_stop=(lambda: recorder.stop(1.0),),
        )

    return factory, recorder.sink()


def cmd_run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"kproxy: {exc}", file=sys.stderr)
        return 2
    if args.cleanup:
        return _cleanup(list(installed_backends()), config)
    avail = availability(config.mode)
    if not avail:
        print(f"kproxy: mode {config.mode!r} cannot run here: {avail.reason}", file=sys.stderr)
        return 1
    cls = backend_class(config.mode)
    from kproxy.daemon import Daemon
    from kproxy.gcpause import limit_arenas

    limit_arenas()  # before the daemon's threads: each would keep a malloc arena's high-water mark of its own
    try:
        factory, event_sink = _make_source_factory(config)
        daemon = Daemon(config, cls(config), factory, event_sink=event_sink, settle_heap=True)
    except Exception as exc:
        print(f"kproxy: cannot start: {exc}", file=sys.stderr)
        return 1

    def _stop(signum: int, _frame: Any) -> None:
        log.info("received %s: stopping (kernel state is left in place)", signal.Signals(signum).name)
        daemon.stop()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        # other modes' leftovers go only once this kproxy runs (its ports bound, its config and kubeconfig read: a
        # second instance or a typo must not remove a running kproxy's rules and then stop) and has programmed its
        # own rules (a mode switch never leaves the node without rules)
        daemon.start(after_first_sync=None if args.no_cleanup_other_modes else lambda: _cleanup_other_modes(config))
    except OSError as exc:
        print(f"kproxy: cannot start: {exc}", file=sys.stderr)
        daemon.stop()
        return 1
    changed: list[str] = []
    stop_watch = None
    if args.config:
        # as upstream: a changed --config file ends the process (non-zero) and the DaemonSet restarts it with the new
        # file; kernel state stays, so traffic never notices
        from kproxy.configwatch import watch

        def _config_changed(why: str) -> None:
            changed.append(why)
            log.error("--config %s changed (%s): exiting so that kproxy restarts with it", args.config, why)
            daemon.stop()

        stop_watch = watch(args.config, _config_changed)
    try:
        while not daemon.wait(1.0):
            pass
    finally:
        if stop_watch is not None:
            stop_watch()
    return 1 if changed else 0


def _cleanup(modes: Sequence[str], config: ProxyConfig) -> int:
    """Remove everything of each mode, then check the kernel with the mode's ``remnants`` (what is left is an
    error, listed)."""
    rc = 0
    for mode in modes:
        try:
            cls: type[Proxier] = backend_class(mode)
        except BackendError as exc:
            print(f"kproxy cleanup: {exc}", file=sys.stderr)
            rc = 1
            continue
        avail = availability(mode)
        if not avail:
            print(f"kproxy cleanup: skipping {mode}: {avail.reason}", file=sys.stderr)
            continue
        try:
            cfg = config.with_(mode=mode)
            cls.cleanup_leftovers(cfg)
            left = cls.remnants(LocalProbe(options=cls.option_values(cfg.backend_options)))
        except Exception as exc:
            print(f"kproxy cleanup: {mode}: {exc}", file=sys.stderr)
            rc = 1
            continue
        if left:
            print(f"kproxy cleanup: {mode}: {len(left)} object(s) remain:", file=sys.stderr)
            for line in left[:20]:
                print(f"  {line}", file=sys.stderr)
            rc = 1
        else:
            print(f"kproxy cleanup: removed everything of mode {mode}")
    return rc


def cmd_cleanup(args: argparse.Namespace) -> int:
    modes = list(installed_backends()) if args.mode == "all" else [args.mode]
    options: dict[str, Any] = {}
    for mode in modes:
        options.update(_backend_options(args, mode))
    return _cleanup(modes, ProxyConfig(backend_options=options))


def _fetch_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - loopback URL built from a flag
        return json.loads(resp.read().decode())


def cmd_verify(args: argparse.Namespace) -> int:
    """``kproxy verify``: the running kproxy reads the kernel back and diffs it against what it wants (``/verify``):
    exit 0 without drift, 1 with drift (listed), 2 when it cannot tell."""
    host, port = parse_hostport(args.metrics_bind_address, "--metrics-bind-address")
    host = host if host not in ("", "0.0.0.0", "::") else "127.0.0.1"
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}/verify"
    try:
        data = _fetch_json(url, timeout=args.timeout)
    except urllib.error.HTTPError as exc:
        body = exc.read().decode(errors="replace").strip()
        try:
            why = json.loads(body)["error"]
        except (ValueError, KeyError, TypeError):
            why = body
        print(f"kproxy verify: {why}", file=sys.stderr)
        return 2
    except (OSError, urllib.error.URLError, ValueError) as exc:
        print(f"kproxy verify: cannot read {url}: {exc} (is `kproxy run` running on this node?)", file=sys.stderr)
        return 2
    if args.format == "json":
        print(json.dumps(data, indent=2, sort_keys=True))
    else:
        print(render_verify_table(data))
    if data.get("errors"):
        return 2
    return 1 if data.get("drift") else 0


def render_verify_table(data: Mapping[str, Any]) -> str:
    lines = [f"mode {data.get('mode')}  node {data.get('node')}  generation {data.get('generation')}"]
    drift = data.get("drift", 0)
    lines.append(f"drift: {drift}" + ("" if drift else " (the kernel holds exactly what kproxy wants)"))
    for key, fams in sorted((data.get("services") or {}).items()):
        for fam, why in sorted(fams.items()):
            lines.append(f"  {key} {fam}: {why}")
    lines.extend(f"  extra {line}" for line in data.get("extra") or [])
    for key, fams in sorted((data.get("refused") or {}).items()):
        for fam, why in sorted(fams.items()):
            lines.append(f"  {key} {fam}: {why} [known: the kernel refused it; not counted]")
    lines.extend(f"  error {line}" for line in data.get("errors") or [])
    return "\n".join(lines)


def cmd_show(args: argparse.Namespace) -> int:
    host, port = parse_hostport(args.metrics_bind_address, "--metrics-bind-address")
    host = host if host not in ("", "0.0.0.0", "::") else "127.0.0.1"
    hostpart = f"[{host}]" if ":" in host else host
    url = f"http://{hostpart}:{port}/rules"
    if args.service:
        url += "?service=" + urllib.parse.quote(args.service, safe="")
    if args.trace:
        src, target = args.trace
        try:
            dst, dport, proto = parse_trace_target(target)
        except ValueError as exc:
            print(f"kproxy show: --trace: {exc}", file=sys.stderr)
            return 2
        query = {"src": src, "dst": dst, "dport": dport, "proto": proto}
        if args.from_node:
            query["src_local"] = "1"
        if args.to_node:
            query["dst_local"] = "1"
        url = f"http://{hostpart}:{port}/trace?" + urllib.parse.urlencode(query)
    try:
        data = _fetch_json(url)
    except urllib.error.HTTPError as exc:
        body = exc.read().decode(errors="replace").strip()
        try:
            why = json.loads(body)["error"]
        except (ValueError, KeyError, TypeError):
            why = body
        print(f"kproxy show: {why}", file=sys.stderr)
        return 2 if exc.code == 400 else 1
    except (OSError, urllib.error.URLError, ValueError) as exc:
        print(f"kproxy show: cannot read {url}: {exc} (is `kproxy run` running on this node?)", file=sys.stderr)
        return 1
    if args.service and not args.trace:
        data["counters"] = _show_counters(args.metrics_bind_address, args.service)
    if args.format == "json":
        print(json.dumps(data, indent=2, sort_keys=True))
        return 0
    if args.trace:
        print(render_trace_table(data))
        return 0
    print(render_show_table(data))
    return 0


def _show_counters(address: str, service: str) -> dict[str, Any] | None:
    """The service's traffic counters (``kproxy top``'s figures), None when that kproxy does not count."""
    try:
        return top.for_service(address, service)
    except (OSError, urllib.error.URLError, ValueError) as exc:
        return {"error": f"cannot read the counters: {exc}"}


def parse_trace_target(target: str) -> tuple[str, str, str]:
    """``DST:PORT[/PROTO]`` -> (dst, port, proto); IPv6 as ``[addr]:port``. A ValueError says what is wrong."""
    body, _, proto = target.partition("/")
    proto = (proto or "tcp").lower()
    if body.startswith("["):
        addr, bracket, rest = body[1:].partition("]")
        if not bracket or not rest.startswith(":"):
            raise ValueError(f"{target!r}: expected [IPv6]:PORT[/PROTO]")
        dst, port = addr, rest[1:]
    else:
        if body.count(":") > 1:
            raise ValueError(f"{target!r}: write an IPv6 destination as [ADDRESS]:PORT")
        dst, colon, port = body.partition(":")
        if not colon:
            raise ValueError(f"{target!r}: expected DST:PORT[/PROTO] (the port is needed)")
    if not port.isdigit():
        raise ValueError(f"{target!r}: port {port!r} is not a number")
    return dst, port, proto


def render_show_table(data: dict[str, Any]) -> str:
    """A human summary of ``/rules``: one block per service port and family."""
    lines = [f"mode {data.get('mode')}  node {data.get('node')}  ready {data.get('ready')}"]
    sync = data.get("sync") or {}
    lines.append(f"syncs {sync.get('syncs')}  failures {sync.get('failures')}  last error {sync.get('lastError')}")
    for key, why in sorted((sync.get("failedServices") or {}).items()):
        lines.append(f"  REFUSED BY KERNEL {key}: {why}")
    for key, why in sorted((data.get("rejectedObjects") or {}).items()):
        lines.append(f"  REJECTED {key}: {why}")
    counters = data.get("counters")
    if isinstance(counters, dict) and "services" in counters:
        offered = frozenset(Measure(m) for m in counters.get("offered") or ())
        lines.append(top.render(counters["services"], offered, len(counters["services"])))
    elif isinstance(counters, dict):
        lines.append(f"counters: {counters.get('error')}")
    backend = data.get("backend") or {}
    services = backend.get("services") or {}
    for name in sorted(services):
        lines.append(name)
        per_family = services[name]
        for fam in sorted(per_family):
            info = per_family[fam]
            if isinstance(info, dict):
                summary = ", ".join(f"{k}={v}" for k, v in info.items() if not isinstance(v, (list, dict)))
                lines.append(f"  {fam}: {summary}")
                for k, v in info.items():
                    if isinstance(v, list):
                        lines.append(f"    {k}:")
                        lines.extend(f"      {item}" for item in v)
            else:
                lines.append(f"  {fam}: {info}")
    return "\n".join(lines)


def render_trace_table(data: dict[str, Any]) -> str:
    """A human summary of ``/trace``: each possible outcome with its chance, then the rules of the first one."""
    pkt = data.get("packet") or {}
    dst = str(pkt.get("dst"))
    dst = f"[{dst}]" if ":" in dst else dst
    where = [w for w, flag in (("from the node", pkt.get("srcLocal")), ("to the node", pkt.get("dstLocal"))) if flag]
    lines = [f"{pkt.get('proto')} {pkt.get('src')} -> {dst}:{pkt.get('dport')} ({data.get('mode')})"]
    if where:
        lines[0] += "  " + ", ".join(where)
    trace = data.get("trace") or {}
    outcomes = trace.get("outcomes") if isinstance(trace, dict) else None
    if not isinstance(outcomes, list) or not outcomes:
        return "\n".join([*lines, json.dumps(trace, indent=2, sort_keys=True)])
    for o in outcomes:
        chance = o.get("probability")
        masq = "  (masqueraded)" if o.get("masquerade") else ""
        lines.append(f"  {chance if chance is not None else '-':>8}  {o.get('verdict')}{masq}")
    lines.append("  rules of the first outcome:")
    lines.extend(f"    {rule}" for rule in outcomes[0].get("rules") or [])
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kproxy",
        description="A Kubernetes service proxy: one cache, one contract, modes " + ", ".join(MODE_NAMES) + ".",
    )
    parser.add_argument("--version", action="version", version=f"kproxy {__version__}")
    parser.add_argument("-v", "--v", dest="verbosity", type=int, default=0, help="log verbosity (0-4), as klog's --v")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_run_parser(sub)
    c = sub.add_parser("cleanup", help="remove every rule, map and chain a mode wrote, then exit")
    c.add_argument("--mode", default="all", choices=(*MODE_NAMES, "all"), help="the mode to clean up (default: all)")
    c.set_defaults(backend_flags=_add_backend_flags(c))
    c.set_defaults(func=cmd_cleanup)
    s = sub.add_parser("show", help="how each service is programmed on this node (reads the running kproxy)")
    s.add_argument(
        "--service", default=None, help="ns/name[:port][/PROTO]: one service (all its ports unless port is given)"
    )
    s.add_argument("--format", choices=("table", "json"), default="table")
    s.add_argument("--metrics-bind-address", default="127.0.0.1:10249")
    s.add_argument(
        "--trace",
        nargs=2,
        metavar=("SRC", "DST:PORT[/PROTO]"),
        help="where a new connection from SRC to DST:PORT would go (the packet explainer)",
    )
    s.add_argument(
        "--from-node",
        action="store_true",
        help="with --trace: SRC is the node itself (implied when SRC is its address)",
    )
    s.add_argument(
        "--to-node",
        action="store_true",
        help="with --trace: DST is the node (implied when DST is one of its addresses)",
    )
    s.set_defaults(func=cmd_show)
    v = sub.add_parser(
        "verify", help="read back what the kernel holds and diff it against what kproxy wants (exit 1 on drift)"
    )
    v.add_argument("--format", choices=("table", "json"), default="table")
    v.add_argument("--metrics-bind-address", default="127.0.0.1:10249")
    v.add_argument("--timeout", type=float, default=60.0, help="seconds to wait (reading 10k services takes a few)")
    v.set_defaults(func=cmd_verify)
    register_apiserver(sub)
    register_lab(sub)
    register_conformance(sub)
    register_bench(sub)  # also registers `compare` (kproxy.bench.compare)
    register_demo(sub)
    register_soak(sub)
    top.register(sub)
    return parser


def setup_logging(verbosity: int) -> None:
    level = logging.DEBUG if verbosity >= 4 else logging.INFO if verbosity >= 0 else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(levelname).1s %(name)s] %(message)s", stream=sys.stderr)
    for noisy in ("urllib3", "kubernetes", "pyroute2"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(args.verbosity)
    rc: int = args.func(args)
    return rc


if __name__ == "__main__":
    sys.exit(main())
