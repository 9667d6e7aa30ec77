"""``kvrouter bench soak`` in short: the real proxy process, three worker processes, bad input and a kill."""

import time

import pytest

from bench.soak_bench import BAD_KINDS, GOOD_KINDS, run

pytestmark = pytest.mark.sockets


def test_a_short_soak_survives_bad_input_and_a_worker_kill():
    t0 = time.monotonic()
    res = run(duration_s=20, kill_interval_s=7, big_interval_s=5, stop_at_s=10, stop_s=2, rss_interval_s=2)
    assert time.monotonic() - t0 < 60
    assert res["verdict"] == "PASS", (res["failures"], res["bad_input"])
    assert res["proxy"]["alive_at_end"] and not res["proxy"]["log_tracebacks"], \
        "\n".join(res["proxy"]["log_non_warnings_first"])

    bad, expected = res["requests"]["bad"], res["bad_input"]["expected_status"]
    assert set(bad) == set(BAD_KINDS)  # every kind of bad input was sent, the 30 MB prompt included
    for kind, statuses in bad.items():
        assert set(statuses) == {str(expected[kind])}, (kind, statuses)  # and each got its answer, every time
        assert expected[kind] == 200 or 400 <= expected[kind] < 500
    assert res["bad_input"]["5xx"] == 0
    assert all(b["status"] == "400" for b in res["big_prompt"]["each"])

    assert set(res["requests"]["good"]) == set(GOOD_KINDS)
    for ends in res["streams"].values():
        assert ends["clean_no_done"] == 0 and ends["error_event_clean_end"] == 0 and ends["done"] > 0
    assert res["good"]["http_5xx_away_from_faults"] == 0
    assert res["good"]["streams_ended_in_error_away_from_faults"] == 0
    # what the client saw cut is what the proxy counted as truncated
    assert res["proxy_metrics"]["kvrouter_responses_truncated_total"] == res["good"]["streams_ended_in_error"]

    kills = res["faults"]["kills"]
    assert kills and all("restarted_at" in k for k in kills), kills
    first = kills[0]
    assert first["good_ok_after"] > 0 and first["good_ok_on_it_after"] > 0, first  # survived, and back in use
    assert set(first["stream_endings"]) <= {"error_event"}  # streams it was serving ended as errors
    assert res["faults"]["stops"] and res["health"]["status"] == {"200": res["health"]["samples"]}
