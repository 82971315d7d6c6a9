"""Wire formats of the swarm: versioned msgpack messages with explicit size limits, defined once here."""

WIRE_VERSION = 1
