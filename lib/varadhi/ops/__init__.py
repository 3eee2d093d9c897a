"""Operations on subscriptions and topics: change-shards, offset reset, replay, lifecycle (pause,
resume, delete), the DLQ and status."""
