"""A judge's verdict rules and template check (stages/reward_judge.py), and the HTTP reward client's retries,
backoff, timeouts and concurrency limit against a real server on 127.0.0.1 (stages/reward_http.py)."""

from __future__ import annotations

import math

import pytest
from reward_endpoint import Endpoint

from rlflow.stages.reward_http import MAX_BACKOFF_S, HttpReward, backoff, parse_reply
from rlflow.stages.reward_judge import Unparseable, score_0_10, template_problem, verdict_rule, yes_no


@pytest.mark.parametrize("text,want", [("Yes", 1.0), (" yes, it is right", 1.0), ("NO.", 0.0), ("no", 0.0)])
def test_yes_no_reads_the_first_word(text, want):
    assert yes_no(text) == want


@pytest.mark.parametrize("text", ["maybe", "", "yesterday", "1"])
def test_yes_no_refuses_anything_else(text):
    with pytest.raises(Unparseable, match="is not yes or no"):
        yes_no(text)


def test_score_0_10_reads_the_first_integer_in_range():
    assert score_0_10("7/10") == 0.7 and score_0_10("score: 10") == 1.0 and score_0_10("0") == 0.0
    for bad in ("eleven", "11", "-1 points"):
        with pytest.raises(Unparseable, match="no integer from 0 to 10"):
            score_0_10(bad)


def test_regex_with_a_group_is_its_number_without_one_a_match():
    rule = verdict_rule(r"regex:score=(\d+(?:\.\d+)?)")
    assert rule("the score=2.5 overall") == 2.5
    with pytest.raises(Unparseable, match="does not match"):
        rule("no score here")
    with pytest.raises(Unparseable, match="is not a number"):
        verdict_rule(r"regex:grade=(\w+)")("grade=A")
    matches = verdict_rule(r"regex:\bcorrect\b")
    assert matches("that is correct") == 1.0 and matches("incorrect") == 0.0


def test_unknown_rules_and_bad_patterns_are_named():
    with pytest.raises(ValueError, match="unknown verdict rule 'yes-no'"):
        verdict_rule("yes-no")
    with pytest.raises(ValueError, match="not a valid regular expression"):
        verdict_rule("regex:(")


def test_template_must_show_the_completion_and_use_known_fields():
    assert template_problem("Q: {prompt}\nA: {completion}\nRef: {answer}") is None
    assert "no {completion}" in template_problem("Q: {prompt}")
    assert "uses {reference}" in template_problem("{completion} {reference}")
    assert "not a format string" in template_problem("{completion")


def test_parse_reply_takes_a_number_or_a_reward_field():
    assert parse_reply(b"0.5") == 0.5 and parse_reply(b'{"reward": 1}') == 1.0
    for bad in (b'"yes"', b'{"score": 1}', b"NaN", b"true", b"<html>"):
        with pytest.raises(Exception, match="not"):
            parse_reply(bad)


def test_backoff_doubles_up_to_a_cap():
    assert [backoff(k, 0.5) for k in (1, 2, 3)] == [0.5, 1.0, 2.0]
    assert backoff(20, 0.5) == MAX_BACKOFF_S


@pytest.fixture
def endpoint(request):
    made = []

    def make(*args, **kwargs):
        made.append(Endpoint(*args, **kwargs))
        return made[-1]

    yield make
    for e in made:
        e.close()


ITEM = {"traj_id": "t1", "prompt": "1+1=", "completion": "2", "answer": "2"}


def test_5xx_is_retried_with_backoff_until_it_recovers(endpoint):
    server, waits = endpoint([("status", 503), ("status", 500)]), []
    client = HttpReward(server.url, retries=3, backoff_s=0.25, sleep=waits.append)
    assert client.score_one(ITEM) == (1.0, "", False)
    assert server.requests == 3 and waits == [0.25, 0.5]
    assert server.bodies[0] == {"id": "t1", "prompt": "1+1=", "completion": "2", "answer": "2"}


def test_retries_run_out_into_a_recorded_failure(endpoint):
    server = endpoint([("status", 503)] * 5)
    reward, why, timed_out = HttpReward(server.url, retries=2, backoff_s=0, sleep=lambda s: None).score_one(ITEM)
    assert math.isnan(reward) and not timed_out and server.requests == 3
    assert why == f"{server.url} answered HTTP 503 (3 attempts)"


def test_a_4xx_or_a_bad_reply_is_not_retried(endpoint):
    server = endpoint([("status", 404), ("ok", "yes")])
    client = HttpReward(server.url, retries=3, backoff_s=0, sleep=lambda s: None)
    assert client.score_one(ITEM)[1].endswith("answered HTTP 404 (1 attempt)")
    assert "not a finite number" in client.score_one(ITEM)[1] and server.requests == 2


def test_a_slow_reply_times_out_and_the_retry_gets_the_reward(endpoint):
    server = endpoint([("sleep", 1.0)])
    client = HttpReward(server.url, timeout_s=0.2, retries=1, backoff_s=0, sleep=lambda s: None)
    assert client.score_one(ITEM) == (1.0, "", False) and server.requests == 2
    server.plan = [("sleep", 1.0), ("sleep", 1.0)]
    reward, why, timed_out = client.score_one(ITEM)
    assert math.isnan(reward) and timed_out and "timed out after 0.2 s (2 attempts)" in why


def test_an_unreachable_endpoint_fails_by_name():
    client = HttpReward("http://127.0.0.1:9/score", timeout_s=1, retries=1, backoff_s=0, sleep=lambda s: None)
    reward, why, _ = client.score_one(ITEM)
    assert math.isnan(reward) and "could not be reached" in why and "(2 attempts)" in why


def test_concurrency_limits_requests_in_flight(endpoint):
    server = endpoint(hold_s=0.1)
    client = HttpReward(server.url, concurrency=2)
    items = [dict(ITEM, traj_id=f"t{i}", completion=str(i % 3)) for i in range(8)]
    out = client.score(items)
    assert [r for r, _, _ in out] == [float(str(i % 3) == "2") for i in range(8)]  # in order
    assert server.requests == 8 and server.peak == 2
