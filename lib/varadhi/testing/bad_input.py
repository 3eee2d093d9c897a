"""The records of docs/bad-input.md's list, as the tests write them onto a subscription's main
topic with a plain Kafka producer, and what each must become: delivered with the group and
message id their text forms give, or dead-lettered with a reason. Shared by the shard's test
(tests/integration/test_bad_input.py) and the library runtime's
(tests/integration/test_library_bad_input.py). Case numbers are the rows of the list."""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass

from kafka import KafkaProducer
from kafka.admin import ConfigResource, ConfigResourceType, KafkaAdminClient

from varadhi.core import messages as m

QUEUE_LIMIT = 64 * 1024  # max.message.bytes of the RQ and DLQ here; the main topic takes 10 MiB
AVRO_KEY = b"\x00\x00\x00\x00\x07" + b"\x0ccust-7"  # Schema Registry frame, schema id 7
PROTO_KEY = b"\x00\x00\x00\x00\x09\x00" + b"\x0a\x03abc"  # frame, message index 0, field 1


def b64(data: bytes) -> str:
    return "b64:" + base64.b64encode(data).decode()


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass
class Case:
    """One record: what is written, and either the group/message id it is delivered with or
    the start of the reason it is dead-lettered with. `msg_id=None`: the id falls back to the
    record's position (`<topic>-<partition>-<offset>`)."""

    n: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]
    group: str | None = None
    msg_id: str | None = "same"  # "same": the case's own id header
    reason: str | None = None  # dead-lettered with this reason (prefix)
    script: tuple = ()  # the endpoint's answers to this message


def cases() -> list[Case]:
    def c(n, key=None, value=b"v", headers=None, **kw) -> Case:
        if headers is None:
            headers = [(m.H_MSG_ID, f"case-{n}".encode())]
        return Case(n, key, value, headers, **kw)

    big_text = b"k" * 2000
    return [
        # keys
        c(1, key=None, headers=[], msg_id=None),
        c(2, key=b"", headers=[], msg_id=None),
        c(3, key=b"plain-key", headers=[], msg_id=None, group="plain-key"),
        c(4, key=b"\xff\xfe\xfd", group=b64(b"\xff\xfe\xfd")),
        c(5, key=AVRO_KEY, group=b64(AVRO_KEY)),
        c(6, key=PROTO_KEY, group=b64(PROTO_KEY)),
        c(7, key=b"a\r\nX-Evil: 1", group=b64(b"a\r\nX-Evil: 1")),
        c(8, key=big_text, group=sha(big_text)),
        c(9, key=b"\x01" * 300, group=sha(b"\x01" * 300)),
        c(10, key=b"j" * 1024, group="j" * 1024),
        c(11, key="größe-日本-😀".encode(), group="größe-日本-😀"),
        c(12, key=b"\xff\x00", headers=[], msg_id=None, group=b64(b"\xff\x00")),
        # group id header
        c(
            13,
            headers=[(m.H_MSG_ID, b"case-13"), (m.H_GROUP_ID, b"\x80\x81")],
            group=b64(b"\x80\x81"),
        ),
        c(14, key=b"k14", headers=[(m.H_MSG_ID, b"case-14"), (m.H_GROUP_ID, b"")], group="k14"),
        c(
            15,
            key=b"k15",
            headers=[(m.H_MSG_ID, b"case-15"), (m.H_GROUP_ID, b"\x00")],
            group=b64(b"\x00"),
        ),
        c(16, headers=[(m.H_MSG_ID, b"case-16"), (m.H_GROUP_ID, b"g\r\n")], group=b64(b"g\r\n")),
        c(
            17,
            headers=[(m.H_MSG_ID, b"case-17"), (m.H_GROUP_ID, b"first"), (m.H_GROUP_ID, b"2nd")],
            group="first",
        ),
        c(18, key=b"\xff", headers=[(m.H_MSG_ID, b"case-18"), (m.H_GROUP_ID, b"g18")], group="g18"),
        # message id header
        c(
            19,
            key=b"g19",
            headers=[(m.H_MSG_ID, b"\xfa\xfb")],
            group="g19",
            msg_id=b64(b"\xfa\xfb"),
        ),
        c(20, key=b"g20", headers=[(m.H_MSG_ID, b"")], group="g20", msg_id=None),
        c(
            21,
            key=b"g21",
            headers=[(m.H_MSG_ID, b"id\r\nX: 1")],
            group="g21",
            msg_id=b64(b"id\r\nX: 1"),
        ),
        c(
            22,
            key=b"g22",
            headers=[(m.H_MSG_ID, b"i" * 5000)],
            group="g22",
            msg_id=sha(b"i" * 5000),
        ),
        c(
            23,
            key=b"g23",
            headers=[(m.H_MSG_ID, b"case-23"), (m.H_MSG_ID, b"other")],
            group="g23",
        ),
        # other headers
        c(
            24,
            key=b"g24",
            headers=[(m.H_MSG_ID, b"case-24"), ("x-trace", b"\xff\xfe\x00")],
            group="g24",
        ),
        c(25, key=b"g25", headers=[(m.H_MSG_ID, b"case-25"), ("x-empty", b"")], group="g25"),
        c(
            26,
            key=b"g26",
            headers=[(m.H_MSG_ID, b"case-26"), ("x-big", b"h" * 100_000)],
            group="g26",
        ),
        c(
            27,
            key=b"g27",
            headers=[(m.H_MSG_ID, b"case-27")] + [(f"x-{i}", b"v") for i in range(500)],
            group="g27",
        ),
        c(
            28,
            key=b"g28",
            headers=[(m.H_MSG_ID, b"case-28"), (m.H_PRODUCED_MS, b"12\r\n")],
            group="g28",
        ),
        # values
        c(29, key=b"g29", value=None, group="g29", reason="malformed: no value"),
        c(30, key=b"g30", value=b"", group="g30"),
        c(31, key=b"g31", value=b"\x00\x00\x00\x00\x07\xff\xfe binary avro", group="g31"),
        c(32, key=b"g32", value=b"x" * 300_000, group="g32", reason="malformed: value of 300000"),
        # a retry too large for the RQ: dead-lettered, as a truncated copy
        c(33, key=b"g33", value=b"y" * 100_000, group="g33", reason="HTTP 500", script=(500,)),
        # a fatal answer with a body: the dead letter carries its start
        c(34, key=b"g34", group="g34", reason="fatal response 404", script=(404,)),
    ]


def set_max_message_bytes(bootstrap: str, topics: list[str], limit: int) -> None:
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        admin.alter_configs(
            [
                ConfigResource(
                    ConfigResourceType.TOPIC, t, configs={"max.message.bytes": str(limit)}
                )
                for t in topics
            ]
        )
    finally:
        admin.close()


def misjudged(
    all_cases: list[Case],
    where: dict[int, tuple[int, int]],
    topic: str,
    ok: dict,
    dlq: dict[str, dict],
) -> list[str]:
    """What went wrong with the cases, one line each (none: each case met its fate).
    `where`: case number -> (partition, offset) on `<topic>.0`; `ok`: the endpoint's 2xx
    records by their `X-Varadhi-Source` (recorded headers); `dlq`: DLQ records (as
    `harness.read_queue` gives them) by their `varadhi-origin`. A delivered case carries the
    text forms of its ids (message id, `Idempotency-Key`, group) and its whole body, and no
    header its key or ids tried to inject; a dead-lettered one is not delivered and its DLQ
    copy's reason starts with the case's."""
    out = []
    for case in all_cases:
        partition, offset = where[case.n]
        source = f"{topic}.0/{partition}/{offset}"
        expected_id = (
            f"case-{case.n}"
            if case.msg_id == "same"
            else case.msg_id or f"{topic}.0-{partition}-{offset}"
        )
        if case.reason is None:
            r = ok.get(source)
            if r is None:
                out.append(f"case {case.n} was not delivered")
                continue
            got = (r.message_id, r.headers.get("Idempotency-Key"), r.group_id, r.body_bytes)
            want = (expected_id, expected_id, case.group, len(case.value or b""))
            if got != want:
                out.append(f"case {case.n}: delivered as {got}, not {want}")
            if "X-Evil" in r.headers or "X" in r.headers:
                out.append(f"case {case.n}: a header was injected")
        elif source in ok:
            out.append(f"case {case.n} was delivered")
        else:
            d = dlq.get(f"0:{partition}:{offset}")
            if d is None:
                out.append(f"case {case.n} is not in the DLQ")
            elif not d["headers"][m.H_REASON].startswith(case.reason):
                out.append(f"case {case.n}: dead-lettered with {d['headers'][m.H_REASON]!r}")
    return out


def write_cases(bootstrap: str, storage_topic: str, rq_topic: str, all_cases: list[Case]):
    """Write each case onto `storage_topic` (partition: its number mod 4) as a plain producer
    would, and two records no shard or member wrote onto `rq_topic` (binary junk, a damaged
    origin: rows 35 and 36); returns case number -> (partition, offset)."""
    kafka = KafkaProducer(
        bootstrap_servers=bootstrap,
        max_request_size=8 * 1024 * 1024,
        max_in_flight_requests_per_connection=1,
    )
    where: dict[int, tuple[int, int]] = {}
    try:
        for case in all_cases:
            meta = kafka.send(
                storage_topic,
                key=case.key,
                value=case.value,
                headers=case.headers,
                partition=case.n % 4,
            ).get(30)
            where[case.n] = (meta.partition, meta.offset)
        for key, headers in [
            (b"\xff\xfe", [("x", b"\xff")]),
            (b"g-rq", [(m.H_ORIGIN, b"not:an:origin:at:all"), (m.H_ATTEMPTS, b"\xff")]),
        ]:
            kafka.send(rq_topic, key=key, value=b"junk", headers=headers).get(30)
    finally:
        kafka.close()
    return where
