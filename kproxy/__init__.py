"""kproxy: a Kubernetes service proxy with four backends behind one contract."""

__version__ = "0.1.0"
