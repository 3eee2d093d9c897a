"""The transactional outbox (seed 004): the application-side tables, the relay, the Delta outbox."""
