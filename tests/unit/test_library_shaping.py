"""The library runtime refuses request shaping by name (it builds its requests without it), rather
than delivering requests without the forwarded headers or to the unshaped path."""

from varadhi.core.policies import CircuitPolicy, Endpoint, RequestShaping, SubscriptionSpec
from varadhi.kafka.subscriptions import Subscription
from varadhi.kafka.topics import CompositeTopic, StorageTopic
from varadhi.library.support import unsupported


def test_request_shaping_is_named_among_what_the_library_does_not_support():
    main = CompositeTopic("t", (StorageTopic("t.0", 4, 1),))
    rq = CompositeTopic("s.rq", (StorageTopic("s.rq.0", 2, 1),), internal=True)
    dlq = CompositeTopic("s.dlq", (StorageTopic("s.dlq.0", 1, 1),), internal=True)
    for shaping, named in (
        (RequestShaping(path="/t/{header:tenant}"), "endpoint.path"),
        (RequestShaping((("a", "X-A"),)), "endpoint.forward_headers"),
        (RequestShaping(key_header="X-Key"), "endpoint.key_header"),
        (RequestShaping((("a", "X-A"),), key_header="X-Key"),
         "endpoint.forward_headers / endpoint.key_header"),
    ):  # fmt: skip
        endpoint = Endpoint("http://127.0.0.1:1/", shaping=shaping)
        spec = SubscriptionSpec(
            "s", "t", endpoint, on_dead_letter="skip", circuit_breaker=CircuitPolicy(enabled=False)
        )
        assert unsupported(Subscription(spec, 1, 0), main, rq, dlq) == [
            f"{named} (request shaping)"
        ]
