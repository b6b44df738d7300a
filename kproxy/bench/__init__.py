"""Benchmarks: ``kproxy bench sync`` (control plane: cache + backend sync times, memory, kernel floor) and, later,
``kproxy bench datapath`` and ``kproxy compare``. Tools around the core: they may import every core layer below
them, never a backend module by name (backends come through ``kproxy.proxier.backend_class``)."""
