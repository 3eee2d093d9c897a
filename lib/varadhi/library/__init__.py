"""The library runtime: a subscription delivered by plain Python processes, no Spark, no Delta
(docs/library.md). `Consumer` is the embeddable API; `varadhi-consumer` the console script."""

from varadhi.library.handler import Fatal, Message, Retry, Success
from varadhi.library.keys import OrderingKey
from varadhi.library.runtime import Consumer, Options
from varadhi.library.support import Unsupported

__all__ = [
    "Consumer",
    "Fatal",
    "Message",
    "Options",
    "OrderingKey",
    "Retry",
    "Success",
    "Unsupported",
]
