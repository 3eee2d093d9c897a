"""bench/chaos.py's judge: the early-retry figure and the evidence it keeps; the endpoint's
command line and record file it runs and judges by (no service)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from varadhi.testing.endpoint import Record, TestEndpoint, from_command_line, read_records

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def chaos():
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("chaos_under_test", BENCH / "chaos.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


def rec(seq, msg, attempt, status, at_ms, delay_ms=0, gone=False):
    return Record(
        seq=seq,
        connection=1,
        method="POST",
        path="/",
        message_id=msg,
        group_id="g",
        attempt=attempt,
        body_bytes=4,
        received_ms=float(at_ms),
        status=status,
        delay_ms=delay_ms,
        headers={"X-Varadhi-Attempt": str(attempt), "X-Varadhi-Source": f"t/0/{seq}"},
        client_gone=gone,
    )


def test_early_retry_pairs_name_the_message_and_both_records(chaos):
    records = [
        rec(0, "a", 1, 500, 1_000),
        rec(1, "a", 2, 500, 1_150),  # 200 ms owed after attempt 1: early
        rec(2, "a", 3, 200, 1_600),  # 400 ms owed after attempt 2: on time
        rec(3, "b", 1, 503, 2_000),
        rec(4, "b", 2, 503, 2_100),  # 200 ms owed after attempt 1: early
        rec(5, "b", 3, 200, 2_550),  # 400 ms owed after attempt 2: on time
        rec(6, "c", 1, 200, 3_000, delay_ms=1_500),  # slow: the client timed out, no bound
        rec(7, "c", 2, 200, 3_100),
    ]
    verdict = chaos.judge(records, {}, set(), [], 0)
    assert verdict["early_retries"] == 2
    assert verdict["early_retry_pairs"] == [
        {"message": "a", "seq": [0, 1], "gap_ms": 150.0, "need_ms": 200},
        {"message": "b", "seq": [3, 4], "gap_ms": 100.0, "need_ms": 200},
    ]


def test_a_starved_endpoint_is_not_taken_for_early_retries(chaos):
    """Three messages of a 20,000-message run at load average 70 (the endpoint's records as it
    saw them), each counted early before: the client timed out on attempts the endpoint read
    late, and sent the next one after its backoff from its timeout."""
    records = [
        # g338-6: attempt 1 answered 200 and attempt 2 read 5 ms later: the client had timed
        # out on attempt 1 (it retries only failures) before the endpoint read it; so also 2.
        rec(0, "g338-6", 1, 200, 0, gone=True),
        rec(1, "g338-6", 2, 503, 5, gone=True),
        rec(2, "g338-6", 3, 200, 119),
        # g199-0: 503 read in time, the next attempt 267 ms later: the client's timeout came
        # first (1 s, answer or not), then the 200 ms backoff; its Retry-After never reached it.
        rec(3, "g199-0", 1, 503, 1_000),
        rec(4, "g199-0", 2, 200, 1_267),
        # g993-4: 500, then attempt 2 after 81 ms: attempt 1 was read after the client left.
        rec(5, "g993-4", 1, 500, 2_000, gone=True),
        rec(6, "g993-4", 2, 200, 2_081),
    ]
    verdict = chaos.judge(records, {}, set(), [], 0)
    assert verdict["early_retries"] == 0
    assert verdict["read_after_client_left"] == 3


def test_evidence_holds_every_record_of_offending_messages_only(chaos):
    records = [
        rec(0, "a", 1, 500, 1_000),
        rec(1, "ok", 1, 200, 1_010),
        rec(2, "a", 2, 200, 1_100),
        rec(3, "dead", 1, 500, 1_200),
        rec(4, "dead", 2, 500, 1_500),
    ]
    verdict = chaos.judge(records, {}, {"dead"}, [], 0)
    assert verdict["unexpected_dead_letters"] == ["dead"]
    kept = chaos.evidence(list(reversed(records)), verdict)
    assert sorted(kept) == ["a", "dead"]
    assert [r["seq"] for r in kept["a"]] == [0, 2]
    assert kept["dead"][1] == {
        "seq": 4,
        "received_ms": 1_500.0,
        "attempt": 2,
        "status": 500,
        "delay_ms": 0,
        "connection": 1,
        "client_gone": False,
        "headers": {"X-Varadhi-Attempt": "2", "X-Varadhi-Source": "t/0/4"},
    }


def test_no_evidence_when_the_figures_hold(chaos):
    records = [rec(0, "a", 1, 500, 1_000), rec(1, "a", 2, 200, 1_300)]
    verdict = chaos.judge(records, {"a": ("g", 0)}, set(), [], 0)
    assert verdict["early_retries"] == 0
    assert chaos.evidence(records, verdict) == {}


def test_a_dead_letter_is_told_apart_by_whether_every_attempt_failed(chaos):
    """All 12 attempts seen failing (every other one a 200 read after the client had left, a
    timeout of a starved endpoint): the attempts ran out on the endpoint's answers. Attempt 7
    never reached the endpoint: left open."""

    def attempts(msg, numbers, first_seq):
        return [
            rec(first_seq + i, msg, n, 500 if n % 2 else 200, n * 3_000, gone=not n % 2)
            for i, n in enumerate(numbers)
        ]

    records = attempts("t", range(1, 13), 0) + attempts("b", [*range(1, 7), *range(8, 13)], 100)
    verdict = chaos.judge(records, {}, {"t", "b"}, [], 0)
    assert verdict["unexpected_dead_letters"] == ["b", "t"]
    assert verdict["unexpected_dead_letters_every_attempt_failed"] == ["t"]
    assert verdict["early_retries"] == 0


def test_the_endpoint_process_answers_as_the_in_process_one_did(chaos, tmp_path):
    """The run's endpoint moved to a process of its own: its command line gives an endpoint that
    answers every delivery as the in-process one configured before did (failures drawn from the
    same seed and mix, the poison refused, slow answers past the timeout, Retry-After), keeps
    the headers and records to the file the judge reads."""
    poison = ["r-g3-0", "r-g7-2"]
    script = tmp_path / "poison.json"
    script.write_text(json.dumps({m: chaos.POISON_ANSWERS for m in poison}))
    record = tmp_path / "received.jsonl"
    before = TestEndpoint(
        fail_rate=0.2,
        seed=5,
        mix={"500": 0.4, "503": 0.4, "slow": 0.2},
        slow_ms=chaos.REQUEST_TIMEOUT_MS + 500,
        retry_after_s=chaos.RETRY["retry_after_s"],
        script={m: [422] * 20 for m in poison},
        record_headers=True,
    )
    now = from_command_line(chaos.endpoint_options(0.2, 5, script, record))
    ids = [f"r-g{g}-{n}" for g in range(50) for n in range(4)]
    answers = [(m, n, before._answer(m, 0, n)) for m in ids for n in range(13)]
    assert [now._answer(m, 0, n) for m, n, _ in answers] == [a for _, _, a in answers]
    assert {a for _, _, a in answers} == {200, 422, 500, 503, "slow"}
    assert (now.slow_ms, now.retry_after_s, now.record_headers) == (1_500, 1, True)
    assert now._record_path == str(record)


def test_the_judge_reads_from_the_record_file_what_the_endpoint_recorded(chaos, tmp_path):
    """Every field the judge and the evidence use comes back from the endpoint's record file as
    it was recorded (headers, `client_gone`, fractional milliseconds), so the verdict and the
    evidence are those of the records themselves."""
    records = [
        rec(0, "a", 1, 500, 1_000.25),
        rec(1, "a", 2, 503, 1_150.5),
        rec(2, "a", 3, 200, 1_600.125, gone=True),
        rec(3, "dead", 1, 500, 1_700),
        Record(
            seq=4,
            connection=2,
            method="POST",
            path="/",
            message_id="dead",
            group_id="g",
            attempt=2,
            body_bytes=4,
            received_ms=2_100.0,
            status=200,
            delay_ms=1_500,
            headers=None,
            batch=3,
        ),
    ]
    path = tmp_path / "received.jsonl"
    path.write_text("".join(json.dumps(r.to_json()) + "\n" for r in records))
    back = read_records(str(path))
    assert back == records
    verdict = chaos.judge(back, {"a": ("g", 0)}, {"dead"}, [], 0)
    assert verdict == chaos.judge(records, {"a": ("g", 0)}, {"dead"}, [], 0)
    assert verdict["early_retries"] == 1
    assert chaos.evidence(back, verdict) == chaos.evidence(records, verdict)


def test_the_endpoint_refuses_a_script_that_is_not_answer_lists(tmp_path, capsys):
    bad = tmp_path / "script.json"
    bad.write_text(json.dumps({"m": 422}))
    with pytest.raises(SystemExit) as refused:
        from_command_line(["--script", str(bad)])
    assert refused.value.code == 2
    assert "a script is a JSON object of answer lists" in capsys.readouterr().err
    bad.write_text(json.dumps({"m": [422, "later"]}))
    with pytest.raises(SystemExit):
        from_command_line(["--script", str(bad)])
    assert "an answer is an HTTP status" in capsys.readouterr().err


def test_re_deliveries_over_the_target_keep_examples_as_evidence(chaos):
    # "r" was accepted, then the same attempt came again 5 s later (a re-run batch): a
    # re-delivery; "ok" was accepted once. Over the 2% target, "r"'s records are evidence.
    records = [rec(0, "r", 1, 200, 1_000), rec(1, "ok", 1, 200, 1_010), rec(2, "r", 1, 200, 6_000)]
    verdict = chaos.judge(records, {}, set(), [], 0)
    assert verdict["duplicates_redelivered"] == 1 and verdict["redelivered_examples"] == ["r"]
    assert verdict["redelivered_by_10s_since_start"] == {0: 1}
    assert verdict["redelivered_success_by_10s_since_start"] == {0: 1}
    later = chaos.judge(records[:2] + [rec(2, "r", 1, 200, 16_000)], {}, set(), [], 0)
    assert later["redelivered_by_10s_since_start"] == {10: 1}
    assert later["redelivered_success_by_10s_since_start"] == {0: 1}
    assert [r["seq"] for r in chaos.evidence(records, verdict)["r"]] == [0, 2]
    quiet = dict(verdict, redelivered_share=chaos.REDELIVERY_TARGET)
    assert chaos.evidence(records, quiet) == {}


def test_hand_overs_are_counted_per_change_and_a_run_without_one_says_so(chaos):
    # The 2 -> 4 change handed over a killed shard's batch; the 4 -> 3 change found nothing
    # uncommitted (`handover` None): one change of two exercised the hand-over.
    events = [
        {"event": "kill", "shard": 1},
        {
            "event": "change-shards",
            "to": 4,
            "killed_in_batch": {"shard": 0, "batch": 7, "journaled": 120},
            "handover": {
                "batches": [{"shard": 0, "batch": 7, "accepted": 120}],
                "pending_dropped": 3,
                "handed_over": {"0": 80, "1": 37},
                "left_out": 0,
            },
        },
        {"event": "broker restart"},
        {"event": "change-shards", "to": 3, "killed_in_batch": {"shard": None}, "handover": None},
    ]
    summary = chaos.handovers(events)
    assert summary["changes"] == 2 and summary["changes_that_handed_over"] == 1
    first, second = summary["per_change"]
    assert first == {
        "to": 4,
        "killed_in_batch": 0,
        "batches": [(0, 7)],
        "accepted": 120,
        "pending_dropped": 3,
        "handed_over": 117,
        "left_out": 0,
    }
    assert second["accepted"] == 0 and second["killed_in_batch"] is None
    nothing = chaos.handovers([e for e in events if e.get("to") != 4])
    assert nothing["changes_that_handed_over"] == 0
