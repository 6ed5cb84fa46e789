"""The soak's bookkeeping: which failures the engine kill excuses, and what fails the verdict."""

from __future__ import annotations

from tools.bench.attackers import AttackPlan, AttackResult
from tools.bench.soak import (
    FD_NOISE,
    RSS_NOISE_BYTES,
    SWAPPED,
    WARM_UP_S,
    Kill,
    Outcome,
    Sample,
    SoakResult,
    _misroute,
)


def result(*outcomes: Outcome, kill_at: float | None = 50.0) -> SoakResult:
    soak = SoakResult(duration_s=100, concurrency=4, gateway_pid=1, outcomes=list(outcomes))
    if kill_at is not None:
        soak.kill = Kill(pid=2, at=kill_at, ready_again_at=kill_at + 40, restarts_after=1)
    soak.start = soak.end = Sample(at=0, rss_bytes=100 * 2**20, fds=20, threads=8)
    return soak


def ok(start: float) -> Outcome:
    return Outcome(start, start + 1, "pong", False, ok=True)


def failed(
    start: float, end: float, reason: str = "HTTP 503 engine_unavailable", clear: bool = True
) -> Outcome:
    return Outcome(start, end, "pong", True, ok=False, reason=reason, clear_error=clear)


def test_a_clear_error_for_a_request_in_flight_at_the_kill_is_expected() -> None:
    soak = result(ok(1), failed(49, 51), ok(60))
    assert len(soak.expected_failures()) == 1
    assert soak.lost() == []
    assert soak.problems() == []
    assert "verdict: PASS" in soak.report()


def test_failures_outside_the_kill_or_without_a_clear_error_are_lost() -> None:
    before = failed(10, 11)
    broken = failed(49, 51, "connection: RemoteProtocolError", clear=False)
    after = failed(95, 96)
    soak = result(ok(1), before, broken, after)
    assert soak.lost() == [before, broken, after]
    assert soak.problems() == ["3 requests lost"]
    assert "lost (any other failure): 3" in soak.report()


def test_without_a_kill_every_failure_is_lost() -> None:
    soak = result(failed(49, 51), kill_at=None)
    assert len(soak.lost()) == 1


def test_misroutes_fail_the_verdict_even_during_the_kill() -> None:
    misrouted = failed(49, 51, "misrouted: pong answered 'hoot hoot'")
    soak = result(misrouted)
    assert soak.misrouted() == [misrouted]
    assert soak.expected_failures() == []
    assert soak.problems() == ["1 requests misrouted"]


def test_growth_of_memory_or_descriptors_beyond_noise_fails_the_verdict() -> None:
    soak = result(ok(1))
    assert soak.start is not None
    soak.end = Sample(
        at=100,
        rss_bytes=soak.start.rss_bytes + RSS_NOISE_BYTES + 1,
        fds=soak.start.fds + FD_NOISE + 1,
        threads=8,
    )
    problems = soak.problems()
    assert any("RSS grew" in p for p in problems)
    assert any("descriptors grew" in p for p in problems)


def test_an_engine_that_never_comes_back_fails_the_verdict() -> None:
    soak = result(ok(1))
    assert soak.kill is not None
    soak.kill.ready_again_at = None
    assert "the engine did not come back after the kill" in soak.problems()


def test_a_request_that_reached_the_dead_engine_before_the_gateway_noticed_is_lost() -> None:
    late = failed(50.01, 50.05)
    soak = result(late)
    assert soak.kill is not None
    soak.kill.noticed_at = 50.03
    assert soak.lost() == [late]
    assert "1 arrived after the kill, before the gateway saw the engine gone" in soak.report()


def test_answers_are_checked_against_the_adapter_that_was_asked() -> None:
    assert _misroute("pong", " PONG PONG PONG") == ""
    assert _misroute("pong", " PONG") == ""  # stopped early, still pong's
    assert _misroute("pong", " PONG fox").startswith("misrouted")
    assert _misroute("loragate-demo", "a fox ran") == ""  # a word, not an adapter's phrase
    assert _misroute("pong", " fox fox fox").startswith("misrouted")
    assert _misroute("loragate-demo", "qz kk ab") == ""
    assert _misroute("loragate-demo", " hoot hoot").startswith("misrouted")
    assert _misroute("loragate-demo", " PONG PONG qz").startswith("misrouted")
    # The base's own random picks from the demo's 384-token vocabulary, seen in a CI run:
    assert _misroute("loragate-demo", "s foxlo f\x0e hoot hoot an  foxes") == ""
    assert _misroute(SWAPPED, " fox fox fox") == ""
    assert _misroute(SWAPPED, " PONG PONG") == ""
    assert _misroute(SWAPPED, " hoot hoot").startswith("misrouted")
    assert _misroute(SWAPPED, "gibberish").startswith("misrouted")


def attack(**values: object) -> AttackResult:
    plan = AttackPlan(host="127.0.0.1", port=1, idle=8, slow_headers=2, head_deadline_s=20)
    outcome = AttackResult(plan, probes=100)
    outcome.lifetimes = {"idle": [10.2, 10.4], "slow_header": [10.9]}
    for name, value in values.items():
        setattr(outcome, name, value)
    return outcome


def test_attackers_closed_in_time_with_every_probe_answered_pass() -> None:
    soak = result(ok(1.0), kill_at=None)
    soak.attack = attack()
    assert soak.problems() == []
    assert "2 closed by the gateway" in soak.report()


def test_a_failed_liveness_probe_fails_the_soak() -> None:
    soak = result(ok(1.0), kill_at=None)
    soak.attack = attack(probe_failures=[(12.5, "HTTP/1.1 503 Service Unavailable")])
    assert soak.problems() == [
        "1 of 100 /health/live probes failed (first at 12.5 s: HTTP/1.1 503 Service Unavailable)"
    ]


def test_an_attacker_socket_held_past_the_deadline_fails_the_soak() -> None:
    soak = result(ok(1.0), kill_at=None)
    soak.attack = attack(lifetimes={"idle": [10.0, 95.0], "slow_header": [10.0]})
    assert soak.problems() == ["1 idle connections lived past 20 s (longest 95.0 s)"]


def test_a_gateway_that_never_closes_an_idle_socket_fails_the_soak() -> None:
    soak = result(ok(1.0), kill_at=None)
    soak.attack = attack(lifetimes={"slow_header": [10.0]}, open_at_end={"idle": 8})
    assert soak.problems() == ["the gateway never closed an idle connection"]


def request_attack(**values: object) -> AttackResult:
    """The request attackers too: trickled bodies, wide bodies, departing clients."""
    plan = AttackPlan(
        host="127.0.0.1", port=1, idle=8, slow_headers=2, head_deadline_s=20,
        trickle_bodies=2, body_deadline_s=12, wide_model="loragate-demo", departing=True,
    )  # fmt: skip
    outcome = AttackResult(plan, probes=100, departed=40, server_errors=0)
    outcome.lifetimes = {"idle": [10.2], "slow_header": [10.9], "trickle_body": [10.1, 10.3]}
    outcome.wide = [(0.4, "400"), (0.5, "400")]
    for name, value in values.items():
        setattr(outcome, name, value)
    return outcome


def test_request_attackers_answered_in_time_pass_and_are_reported() -> None:
    soak = result(ok(1.0), kill_at=None)
    soak.attack = request_attack()
    assert soak.problems() == []
    report = soak.report()
    assert "trickle_body: 2 closed by the gateway" in report
    assert "wide bodies: 2 answered (400)" in report and "40 hung up mid-body" in report


def test_a_trickled_body_held_past_the_body_deadline_fails_the_soak() -> None:
    soak = result(ok(1.0), kill_at=None)
    lifetimes = {"idle": [10.2], "slow_header": [10.9], "trickle_body": [10.0, 15.0]}
    soak.attack = request_attack(lifetimes=lifetimes)  # 15 s: under the head bound, over 12
    assert soak.problems() == ["1 trickle_body connections lived past 12 s (longest 15.0 s)"]


def test_a_slow_or_failed_wide_body_or_a_500_fails_the_soak() -> None:
    soak = result(ok(1.0), kill_at=None)
    soak.attack = request_attack(wide=[(0.4, "400"), (4.2, "400"), (0.3, "500")])
    soak.attack.server_errors = 3
    assert soak.problems() == [
        "2 of 3 wide bodies got no 2xx or 4xx within 3 s (first: 400 after 4.2 s)",
        "the gateway counted 3 500s during the soak",
    ]


def test_memory_is_counted_from_the_warm_up_so_a_high_water_mark_passes_and_a_leak_fails() -> None:
    mib = 2**20
    warm_up = [Sample(at=at, rss_bytes=rss * mib, fds=20, threads=8) for at, rss in
               [(5, 100), (10, 140), (WARM_UP_S, 150), (WARM_UP_S + 5, 152)]]  # fmt: skip
    soak = result(ok(1))
    soak.samples = warm_up
    soak.end = Sample(at=100, rss_bytes=160 * mib, fds=20, threads=8)  # +60 from the start
    assert soak.rss_growth() == 10 * mib and not soak.problems()
    assert f"at {WARM_UP_S:.0f} s 150.0 MiB" in soak.report()
    soak.end = Sample(at=100, rss_bytes=(150 + 25) * mib, fds=20, threads=8)  # still growing
    assert soak.problems() == ["gateway RSS grew by 25.0 MiB"]
