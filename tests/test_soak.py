"""The soak test (`make soak`, serve/soak.py and soak_traffic.py): the seeded traffic mix, the holds judged from what
a soak measured, and a short soak of a tiny-model server that keeps every hold."""

import json
import random

import pytest

from selfspec.serve import soak
from selfspec.serve.soak_traffic import KINDS, Answer, plan
from selfspec.settings import default_settings

SERVE = default_settings("model=tiny_llama").serve
PROMPTS = ["first prompt", "second prompt", "third prompt"]


def requests(seed: int, n: int) -> list:
    rng = random.Random(seed)
    return [plan(rng, "tiny_llama", SERVE, PROMPTS) for _ in range(n)]


def test_a_seed_fixes_the_mix_and_the_mix_has_every_kind():
    assert requests(0, 50) == requests(0, 50) and requests(0, 50) != requests(1, 50)
    drawn = requests(0, 400)
    assert {p.kind for p in drawn} == set(KINDS)
    assert {p.expect for p in drawn if p.kind == "bad"} == {400, 404, 413}
    assert all(p.expect == 200 for p in drawn if p.kind != "bad")
    disconnects = [p for p in drawn if p.kind == "disconnect"]
    assert all(p.body["stream"] and p.body["max_tokens"] == SERVE.max_tokens and 1 <= p.read_events <= 4
               for p in disconnects)


def answer(kind: str = "chat_stream", status: int = 200, expect: int = 200, error: str | None = None) -> Answer:
    return Answer(0, kind, "/v1/chat/completions", {}, expect, 0.0, status, error=error)


def failed(answers, rss=(500, 500, 510), mismatches=(), checked=5, drain_ok=True, probe=(4, 3)) -> list[str]:
    return [h.name for h in soak.judge(answers, rss, list(mismatches), checked, drain_ok, probe) if not h.ok]


def test_each_hold_fails_on_its_own_evidence():
    fine = [answer(), answer(status=429), answer("bad", 400, 400)]
    assert failed(fine) == []
    assert failed([*fine, answer(status=500, error="boom")]) == ["no 5xx", "expected statuses"]
    assert failed([*fine, answer(error="a decoding step failed")]) == ["no 5xx"]  # a stream's error event
    assert failed([*fine, answer("bad", 429, 400)]) == ["expected statuses"]  # a bad request must get its 4xx
    assert failed(fine, rss=(500, 500, 526)) == ["memory growth < 5%"]
    assert failed(fine, mismatches=["stop: text differs"]) == ["greedy equals plain"]
    assert failed(fine, checked=0) == ["greedy equals plain"]
    assert failed(fine, drain_ok=False) == failed(fine, probe=(4, 400)) == ["disconnect frees its row"]
    assert failed(fine, probe=(0, 0)) == ["disconnect frees its row"]  # no row was in the batch to leave


def test_bad_arguments_end_with_the_value_and_what_is_allowed(capsys):
    with pytest.raises(SystemExit) as stop:
        soak.main(["--duration", "0"])
    assert stop.value.code == 2 and "'0' is not allowed; give a positive integer" in capsys.readouterr().err


@pytest.mark.slow  # a tiny-model server for about 25 s of traffic
def test_a_short_soak_keeps_every_hold_and_writes_its_records(tmp_path, capsys):
    soak.main(["--duration", "25", "--check", "12", "--out", str(tmp_path)])  # exits non-zero if a hold fails
    printed = capsys.readouterr().out
    assert "| tiny_llama | 16 | 8 | 25 |" in printed and printed.count("ok   ") == 5
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["checked"] == 12 and summary["disconnects"] >= 1 and summary["tokens_per_s"] > 0
    assert {"200", "400", "429"} <= set(summary["statuses"]) and not any(int(s) >= 500 for s in summary["statuses"])
    answers = [json.loads(line) for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    assert len(answers) == summary["requests"] and {a["kind"] for a in answers} == set(KINDS)
