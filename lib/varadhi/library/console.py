"""`varadhi-consumer SUBSCRIPTION`: one member of a subscription's library consumer group, run
until SIGTERM or Ctrl-C (docs/library.md).

Exit codes as the `varadhi` command's: 0 stopped on a signal, 2 refused before starting (an
unsupported feature, an unknown subscription, a subscription of `runtime: spark`, a bad
option), 1 a failure while running (the subscription edited or its runtime changed meanwhile),
4 a missing ACL, 130 interrupted before it started.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from kafka.errors import AuthorizationError

from varadhi.core.errors import InvalidArgument, NotAuthorized, VaradhiError
from varadhi.kafka.clients import not_authorized
from varadhi.kafka.settings import Settings
from varadhi.library.keys import OrderingKey
from varadhi.library.runtime import Consumer, Options, group_id


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="varadhi-consumer",
        description=(
            "Deliver a subscription without Spark: this process joins the subscription's"
            " consumer group (varadhi-library.SUBSCRIPTION) and delivers its share. Run more"
            " copies to share the work. Stops on SIGTERM or Ctrl-C. See docs/library.md."
        ),
    )
    p.add_argument("subscription", metavar="SUBSCRIPTION")
    p.add_argument(
        "--ordering-key",
        default="group-id",
        metavar="KEY",
        help="what orders messages: group-id (default), record-key, header:NAME or"
        " json:/POINTER (a JSON pointer into the body)",
    )
    p.add_argument(
        "--max-pending",
        type=int,
        default=Options.max_pending,
        metavar="N",
        help="messages read and not finished before reading the main topic pauses (the retry"
        " queue is read on; default %(default)s)",
    )
    p.add_argument(
        "--max-in-flight",
        type=int,
        metavar="N",
        help="this process's cap on concurrent requests (each of up to delivery.max_messages"
        " messages in batch mode), below its share of the subscription's"
        " consumption.max_in_flight, which the members share by slot (default: its share)",
    )
    p.add_argument(
        "--session-timeout-ms",
        type=int,
        metavar="MS",
        help="how long the group waits for a silent member (killed or hung) before its slots"
        " move to the others (default: kafka-python's 45000)",
    )
    p.add_argument("--bootstrap", help="Kafka bootstrap servers (default $VARADHI_BOOTSTRAP)")
    p.add_argument(
        "--command-config",
        metavar="FILE",
        help="Kafka client properties (default $VARADHI_KAFKA_CONFIG; docs/kafka.md)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not args.verbose:
        logging.getLogger("kafka").setLevel(logging.CRITICAL)
    try:
        if args.session_timeout_ms is not None and args.session_timeout_ms < 1:
            raise InvalidArgument(
                f"must be >= 1, got {args.session_timeout_ms}", field="--session-timeout-ms"
            )
        if args.max_in_flight is not None and args.max_in_flight < 1:
            raise InvalidArgument(
                f"must be >= 1, got {args.max_in_flight}", field="--max-in-flight"
            )
        options = Options(
            ordering_key=OrderingKey.parse(args.ordering_key),
            max_pending=args.max_pending,
            max_in_flight=args.max_in_flight,
            session_timeout_ms=args.session_timeout_ms,
        )
        settings = Settings.from_env(command_config=args.command_config, bootstrap=args.bootstrap)
        consumer = Consumer(args.subscription, settings, options=options).start()
    except VaradhiError as e:
        print(f"varadhi-consumer: {e}", file=sys.stderr)
        return e.exit_code
    except AuthorizationError as e:
        print(f"varadhi-consumer: {not_authorized(e)}", file=sys.stderr)
        return 4
    except KeyboardInterrupt:
        return 130
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(
        f"varadhi-consumer: delivering {args.subscription} as a member of"
        f" {group_id(args.subscription)}",
        file=sys.stderr,
    )
    while not stop.wait(0.5):
        if consumer.health()["state"] == "failed":
            break
    consumer.stop()
    health = consumer.health()
    if health["state"] == "failed":
        print(f"varadhi-consumer: {health['error']}", file=sys.stderr)
        # a missing ACL met while running is 4, as one met at the start; any other failure 1
        return 4 if isinstance(consumer.failure, NotAuthorized) else 1
    print(f"varadhi-consumer: stopped; {consumer.counters()}", file=sys.stderr)
    return 0


if __name__ == "__main__":  # `python -m varadhi.library.console`, as the tests run it
    sys.exit(main())
