"""The Kafka layer: client configuration and clients, the catalog, composite topics, the
subscription documents, leases and the producer. Imports the core and nothing above it."""
