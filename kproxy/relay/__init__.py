"""The relay: proxy sockets whose connections kproxy itself carries to an endpoint (TCP: accept, dial with
upstream's timeouts, ``splice``; UDP: a session per client), on one asyncio event loop thread.

It is the userspace mode's data path (upstream's first proxier: every service port relayed) and the nftables mode's
localhost NodePorts (upstream's KEP-6032 proxy: a listener on 127.0.0.1 per NodePort); it lives in the core so that
neither backend imports the other. Modules: ``datapath`` (``Engine``: the loop thread, ``ListenerSpec``: what a
sync hands it), ``tcp``, ``udp``, ``balancer`` (round robin and ClientIP affinity), ``stats`` (its counters). Why
splice, one loop and upstream's dial timeouts: ``backends/userspace/__init__.py`` and docs/PERFORMANCE.md.
"""
