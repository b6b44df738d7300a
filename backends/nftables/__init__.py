"""The nftables mode (placeholder docstring, completed below)."""
