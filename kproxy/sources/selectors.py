"""Kubernetes label and field selectors: parsing and matching, as the API server does them.

Used by the API stand-in (kproxy.lab.apiserver) to answer `labelSelector=` / `fieldSelector=` exactly like
kube-apiserver, by the files source (kproxy.sources.files) to apply upstream's server-side Service/EndpointSlice
selector to objects read from disk, and by the kube source to build its selector strings. One parser, so the three
agree on what "matches" means.

Grammar (k8s.io/apimachinery/pkg/labels): a comma-separated conjunction of `key`, `!key`, `key=v`, `key==v`,
`key!=v`, `key in (a,b)`, `key notin (a,b)`. `!=` and `notin` also match objects that lack the key.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

SERVICE_PROXY_NAME_LABEL = "service.kubernetes.io/service-proxy-name"
HEADLESS_LABEL = "service.kubernetes.io/headless"


class SelectorError(ValueError):
    """A selector string that does not parse; the API server answers it with 400 BadRequest."""


@dataclass(frozen=True, slots=True)
class Requirement:
    key: str
    op: str  # "exists" | "!" | "=" | "!=" | "in" | "notin"
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        if self.op == "exists":
            return present
        if self.op == "!":
            return not present
        value = labels.get(self.key)
        if self.op in ("=", "in"):
            return present and value in self.values
        # "!=" and "notin" match when the key is absent, as upstream's labels.Requirement does.
        return not present or value not in self.values


_KEY = r"[A-Za-z0-9]([-A-Za-z0-9_./]*[A-Za-z0-9])?"
_KEY_RE = re.compile(rf"^{_KEY}$")
_VALUE_RE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def _split_terms(text: str) -> list[str]:
    """Split on commas that are not inside `( )`."""
    terms: list[str] = []
    depth = 0
    current: list[str] = []
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth < 0:
                raise SelectorError(f"unbalanced ')' in selector {text!r}")
        if ch == "," and depth == 0:
            terms.append("".join(current))
            current = []
        else:
            current.append(ch)
    if depth != 0:
        raise SelectorError(f"unbalanced '(' in selector {text!r}")
    terms.append("".join(current))
    return [t.strip() for t in terms]


def _check_key(key: str, text: str) -> str:
    if not _KEY_RE.match(key):
        raise SelectorError(f"invalid label key {key!r} in selector {text!r}")
    return key


def _check_value(value: str, text: str) -> str:
    if len(value) > 63 or not _VALUE_RE.match(value):
        raise SelectorError(f"invalid label value {value!r} in selector {text!r}")
    return value


_SET_RE = re.compile(r"^(?P<key>\S+)\s+(?P<op>in|notin)\s*\((?P<values>[^()]*)\)$")


def parse_label_selector(text: str) -> tuple[Requirement, ...]:
    """Parse a label selector; an empty string selects everything."""
    if not text or not text.strip():
        return ()
    reqs: list[Requirement] = []
    for term in _split_terms(text):
        if not term:
            raise SelectorError(f"empty term in selector {text!r}")
        m = _SET_RE.match(term)
        if m:
            values = tuple(_check_value(v.strip(), text) for v in m.group("values").split(",") if v.strip())
            if not values:
                raise SelectorError(f"empty value set in selector {text!r}")
            reqs.append(Requirement(_check_key(m.group("key"), text), m.group("op"), values))
            continue
        if term.startswith("!"):
            reqs.append(Requirement(_check_key(term[1:].strip(), text), "!"))
            continue
        for op_text, op in (("!=", "!="), ("==", "="), ("=", "=")):
            if op_text in term:
                key, _, value = term.partition(op_text)
                reqs.append(Requirement(_check_key(key.strip(), text), op, (_check_value(value.strip(), text),)))
                break
        else:
            reqs.append(Requirement(_check_key(term, text), "exists"))
    return tuple(reqs)


def labels_of(obj: Mapping[str, Any]) -> Mapping[str, str]:
    meta = obj.get("metadata") or {}
    labels = meta.get("labels") if isinstance(meta, Mapping) else None
    return labels if isinstance(labels, Mapping) else {}


def label_matcher(text: str) -> Callable[[Mapping[str, Any]], bool]:
    """A predicate over whole objects for a label selector string (raises SelectorError)."""
    reqs = parse_label_selector(text)

    def match(obj: Mapping[str, Any]) -> bool:
        labels = labels_of(obj)
        return all(r.matches(labels) for r in reqs)

    return match


# The fields every kind supports; the API server rejects others with "field label not supported".
SUPPORTED_FIELDS = ("metadata.name", "metadata.namespace")


def parse_field_selector(text: str) -> tuple[tuple[str, str, str], ...]:
    """Parse `metadata.name=x,metadata.namespace!=y` into (field, op, value) triples."""
    if not text or not text.strip():
        return ()
    out: list[tuple[str, str, str]] = []
    for term in _split_terms(text):
        for op_text, op in (("!=", "!="), ("==", "="), ("=", "=")):
            if op_text in term:
                field, _, value = term.partition(op_text)
                field = field.strip()
                if field not in SUPPORTED_FIELDS:
                    raise SelectorError(f'field label not supported: "{field}"')
                out.append((field, op, value.strip()))
                break
        else:
            raise SelectorError(f"invalid field selector term {term!r}")
    return tuple(out)


def field_matcher(text: str) -> Callable[[Mapping[str, Any]], bool]:
    terms = parse_field_selector(text)

    def match(obj: Mapping[str, Any]) -> bool:
        meta = obj.get("metadata") or {}
        for field, op, value in terms:
            actual = str(meta.get(field.split(".", 1)[1]) or "")
            if (actual == value) != (op == "="):
                return False
        return True

    return match


def proxy_label_selector(service_proxy_name: str = "") -> str:
    """The server-side selector upstream kube-proxy puts on its Service and EndpointSlice informers.

    Upstream (cmd/kube-proxy/app/server.go) selects objects with neither the service-proxy-name nor the headless
    label. A proxy with a name of its own must also see objects labelled with that name; "absent OR equal" is not
    expressible in one selector, so in that case only headless is filtered on the server and the name check is left
    to `wanted_by_proxy` on the client side.
    """
    if service_proxy_name:
        return f"!{HEADLESS_LABEL}"
    return f"!{SERVICE_PROXY_NAME_LABEL},!{HEADLESS_LABEL}"


def wanted_by_proxy(obj: Mapping[str, Any], service_proxy_name: str = "") -> bool:
    """True if a proxy called `service_proxy_name` ("" = the default proxy) should see this Service/EndpointSlice."""
    labels = labels_of(obj)
    if HEADLESS_LABEL in labels:
        return False
    if SERVICE_PROXY_NAME_LABEL in labels:
        return bool(service_proxy_name) and labels[SERVICE_PROXY_NAME_LABEL] == service_proxy_name
    return True
