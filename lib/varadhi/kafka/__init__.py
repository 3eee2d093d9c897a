"""The Kafka layer: client configuration and clients, the catalog, composite topics, the
subscription documents, leases, the producer and the ACL table each component needs (`acls`).
Imports the core and nothing above it."""
