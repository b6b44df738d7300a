"""``kproxy soak``: a bounded run on the lab that churns Services and EndpointSlices while injecting faults.

It proves with figures that nothing is lost (kubernetes#112604), that one bad object breaks nothing else
(kubernetes#73157) and that restarts do not drop traffic (kubernetes#75360): changes at a steady rate through the
lab's API stand-in (creates, updates, deletes, scale up/down, policy flips, bad objects among them) while dropped
watches, ``410 Gone``, 5xx bursts, a restart of the API stand-in, a SIGKILL and restart of one node's kproxy, a
flush of the mode's kernel state by someone else and (where the build has the switch) a failed kernel apply come on
a schedule; a long-lived TCP connection through a ClusterIP and new connections every few hundred milliseconds run
throughout. After each fault the run measures how long every node takes to program exactly what the API holds
and to read back without drift (``/verify``), checks a sample of services with real packets, and reports.

Parts: ``cli`` (the sub-command; loads the rest only when it runs), ``churn`` (the object model and the change
generator, pure), ``expect`` (what each node must have programmed, computed by kproxy's own cache from what the
API holds, and the comparison with a node's ``/rules``), ``run`` (the orchestration: lab, API, faults, traffic,
checkpoints), ``report`` (figures, JSON and the table) and ``traffic`` (the standard-library client that runs in a
pod's namespace: the held connection and the new ones).

This package file imports nothing: ``traffic`` runs as ``python -S -m kproxy.soak.traffic`` in a lab pod.
"""
