"""The network: frames on the wire, calls over libp2p and the direct plane, the DHT node, identities,
the allowlist and the reachability check."""
