"""``kproxy soak``: a bounded run on the lab that churns Services and EndpointSlices while injecting faults.

It proves with figures that nothing is lost (kubernetes#112604), that one bad object breaks nothing else
(kubernetes#73157) and that restarts do not drop traffic (kubernetes#75360): changes at a steady rate through the
lab's API stand-in (creates, updates, deletes, scale up/down, policy flips, bad objects among them) while dropped
watches, ``410 Gone``, 5xx bursts, a restart of the API stand-in, a SIGKILL and restart of one node's kproxy, a
flush of the mode's kernel state by someone else and (where the build has the switch) a failed kernel apply come on
a schedule; a long-lived TCP connection through a ClusterIP and new connections every few hundred milliseconds run
throughout. After each fault the run measures how long every node takes to program exactly what the API holds
and to read back without drift (``/verify``), then checks the kernel against the soak's own reference model of the
API's objects: real TCP and UDP packets to every address of the services changed since the last checkpoint, and
the service ports the kernel holds.

Parts: ``cli`` (the sub-command; loads the rest only when it runs), ``churn`` (the object model and the change
generator, pure), ``expect`` (what each node must have programmed, computed by kproxy's own cache from what the
API holds, and the comparison with a node's ``/rules``: the convergence signal), ``model`` (the independent
reference model: what each service address must do, from the API's objects, without kproxy's cache),
``packets`` (the targets a checkpoint tries and the verdicts), ``sweep`` (the standard-library client that sends
them from a pod), ``run`` (the orchestration: lab, API, faults, traffic,
checkpoints), ``report`` (figures, JSON and the table) and ``traffic`` (the standard-library client that runs in a
pod's namespace: the held connection and the new ones).

This package file imports nothing: ``traffic`` runs as ``python -S -m kproxy.soak.traffic`` in a lab pod.
"""
