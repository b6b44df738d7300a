"""``--backend-option KEY=VALUE`` of the benchmarks (``bench sync``, ``bench datapath``, ``bench apiscale``): the
flag, and its values checked against what each requested mode declares, before anything starts.

The decision: one parser for every command that takes the flag (``kproxy.proxier.parse_option_assignments`` types a
value as the backend declares it, ``lab up`` and ``conformance`` use it too). A run of several modes gives an
option to every requested mode that declares it and to no other; an option that no requested mode declares is a
usage error, since a typo must not cost a lab and a run measured without the option. The lab's nodes get the
options the way ``kproxy lab up --backend-option`` gives them (``Lab.up(backend_options=...)``), and the lab hands
each node's kproxy only those of the mode it runs (``Lab.node_options``).
"""

from __future__ import annotations

import argparse
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from kproxy.proxier import backend_class, parse_option_assignments, split_option_assignment

FLAG = "--backend-option"


def add_argument(parser: argparse.ArgumentParser, what: str = "the mode's backend") -> None:
    """The repeatable ``--backend-option KEY=VALUE`` (its values land in ``args.backend_option``, a list)."""
    parser.add_argument(
        FLAG,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"an option of {what} as the backend declares it (kproxy run's flag without its dashes), e.g."
        " bpf_map_size=2097152 or iptables_flavour=legacy (repeatable)",
    )


def parse_for_modes(
    modes: Sequence[str], assignments: Sequence[str], skip: Collection[str] = ()
) -> dict[str, dict[str, Any]]:
    """Mode -> the options among ``assignments`` that this mode declares, typed (``skip``: modes that run no
    backend, e.g. datapath's ``none``). ValueError for a malformed item, a value the option's type refuses, or an
    option no requested mode declares; BackendError for a mode that cannot be loaded."""
    classes = {mode: backend_class(mode) for mode in dict.fromkeys(modes) if mode not in skip}
    out: dict[str, dict[str, Any]] = {mode: {} for mode in classes}
    for item in assignments:
        name, _value = split_option_assignment(item)
        takers = [mode for mode, cls in classes.items() if name in {o.name for o in cls.options}]
        if not takers:
            have = "; ".join(
                f"{mode}: {', '.join(sorted(o.name for o in cls.options)) or 'none'}" for mode, cls in classes.items()
            )
            raise ValueError(f"{FLAG} {name}: no requested mode has such an option ({have or 'no proxied mode'})")
        for mode in takers:
            out[mode].update(parse_option_assignments(classes[mode], [item]))
    return out


def lab_options(per_mode: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The options a lab gives its nodes (``Lab.up(backend_options=...)``): every mode's in one map. Each node's
    kproxy gets only those its own mode declares (``Lab.node_options``), so a mode never sees another's."""
    out: dict[str, Any] = {}
    for options in per_mode.values():
        out.update(options)
    return out
