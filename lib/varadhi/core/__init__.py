"""The delivery core: what a message is and how it is delivered, with no Spark and no Kafka I/O.

Messages and record ids, routing, the subscription spec and its policies, retry decisions, the
group state machine, the HTTP delivery engine, batching, the circuit, filters, the GroupState
rows and the RQ/DLQ record formats. Everything here is pure or talks HTTP only; it imports no
other layer of the package (tests/unit/test_layers.py).
"""
