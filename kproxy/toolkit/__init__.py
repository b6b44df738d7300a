"""The backend toolkit: what more than one backend needs and none owns (upstream's ``pkg/proxy/util``).

``keys`` (a service port's key text), ``cidr`` (address and prefix helpers), ``netns`` (entering a network
namespace), ``switching`` (the interpreter's thread switch interval lowered for a block, counted process-wide),
``trace`` (the packet and outcome of a rule walk), ``nft`` (a table of one's own in nftables: its JSON elements,
remnants, kernel view, cleanup, and a refused line mapped back to its service), ``netlink`` (the headers, constants,
walks and encoders of raw nf_tables netlink). Backends import it; it imports no backend.
"""
