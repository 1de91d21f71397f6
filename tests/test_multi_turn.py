"""data.turns=all as Spec-Bench evaluates it (turn 2 after each strategy's own answer, equality with plain per turn),
and the answers written in Spec-Bench's model_answer format."""

import json
from dataclasses import replace

import pytest

from selfspec.api.decoder import DEFAULT_DRAFT, DEFAULT_SAMPLING
from selfspec.data.conversation import answer_text, check_multi_turn
from selfspec.data.prompt_sets import Prompt, encode_prompt
from selfspec.decoding.options import GenerationOptions
from selfspec.decoding.strategies import Strategy, make_strategy
from selfspec.errors import SelfspecError
from selfspec.evaluation.evaluate import evaluate
from selfspec.evaluation.spec_bench import write_answers
from selfspec.models.tiny import tiny_model
from selfspec.records.prompt_records import read_records
from selfspec.settings import SkipSet

EOS = (2,)
PROMPTS = [Prompt("81", "writing", ("Write a poem about rain.", "Now make it shorter."), chat=True),
           Prompt("82", "math", ("What is 2 + 2?",), chat=True)]


def tiny_strategies(model, max_new_tokens=12):
    """plain, a self-speculative strategy and `short` (plain decoding with fewer tokens: an answer of its own)."""
    sampling = replace(DEFAULT_SAMPLING, max_new_tokens=max_new_tokens)
    draft = replace(DEFAULT_DRAFT, policy="fixed", max_tokens=3, ngram_tokens=10)
    return [Strategy("plain", model, GenerationOptions(sampling, end_ids=EOS)),
            make_strategy("self_spec_fixed", model, GenerationOptions(sampling, end_ids=EOS),
                          skip=SkipSet(attn=(2,), mlp=(3,)), draft=draft),
            Strategy("short", model, GenerationOptions(replace(DEFAULT_SAMPLING, max_new_tokens=5), end_ids=EOS))]


@pytest.fixture(scope="module")
def multi_turn_run(tmp_path_factory, tokenizer):
    out_dir = tmp_path_factory.mktemp("multi_turn")
    model = tiny_model("llama", num_layers=6).double()
    ids = [encode_prompt(tokenizer, p) for p in PROMPTS]
    summary = evaluate(tiny_strategies(model), PROMPTS, ids, tokenizer, out_dir, warmup=False, all_turns=True)
    return out_dir, summary, read_records(out_dir / "records.jsonl")


def test_every_turn_is_decoded_and_recorded_with_its_turn(multi_turn_run):
    _, summary, records = multi_turn_run
    assert [(r.question_id, r.turn, r.strategy) for r in records] == [
        ("81", 0, "plain"), ("81", 0, "self_spec_fixed"), ("81", 0, "short"),
        ("81", 1, "plain"), ("81", 1, "self_spec_fixed"), ("81", 1, "short"),
        ("82", 0, "plain"), ("82", 0, "self_spec_fixed"), ("82", 0, "short")]
    assert summary["plain"]["n_prompts"] == 2 and summary["plain"]["n_turns"] == 3


def test_the_second_turn_follows_the_strategys_own_answer_in_the_chat_template(multi_turn_run, tokenizer):
    _, _, records = multi_turn_run
    by_key = {(r.question_id, r.turn, r.strategy): r for r in records}
    for name in ("plain", "short"):
        answer = answer_text(tokenizer, by_key[("81", 0, name)].output_ids)
        text = f"<user>Write a poem about rain.\n<assistant>{answer}\n<user>Now make it shorter.\n<assistant>"
        assert by_key[("81", 1, name)].prompt_tokens == len(tokenizer(text, add_special_tokens=False).input_ids)
    assert by_key[("81", 1, "short")].prompt_tokens < by_key[("81", 1, "plain")].prompt_tokens


def test_equality_with_plain_is_checked_per_turn(multi_turn_run):
    _, summary, records = multi_turn_run
    by_key = {(r.question_id, r.turn, r.strategy): r for r in records}
    for question_id, turn in (("81", 0), ("81", 1), ("82", 0)):
        plain, spec, short = (by_key[(question_id, turn, name)] for name in ("plain", "self_spec_fixed", "short"))
        assert spec.matches_plain and spec.first_difference is None and spec.output_ids == plain.output_ids
        assert spec.speedup == pytest.approx(spec.tokens_per_s / plain.tokens_per_s)
        d = short.first_difference  # 5 tokens against plain's 12; turn 1 also follows another answer
        assert not short.matches_plain and short.output_ids[:d] == plain.output_ids[:d]
        assert d == 5 or turn == 1
    assert summary["self_spec_fixed"]["outputs_match_plain"] == 1.0
    assert summary["short"]["outputs_match_plain"] == 0.0 and summary["short"]["median_first_difference"] == 5


def test_a_multi_turn_prompt_without_a_chat_template_is_one_line(tokenizer):
    check_multi_turn(tokenizer, PROMPTS, "tiny_llama")
    bare = tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer)  # no chat template
    check_multi_turn(bare, PROMPTS[1:], "base")  # single-turn prompts need none
    with pytest.raises(SelfspecError, match=r"data.turns=all: prompt '81' has 2 turns, but model base's tokenizer "
                                            r"has no chat template"):
        check_multi_turn(bare, PROMPTS, "base")


def test_answers_are_written_in_spec_benchs_model_answer_format(multi_turn_run, tokenizer):
    out_dir, _, records = multi_turn_run
    paths = write_answers(out_dir, records, tokenizer, "tiny_llama")
    assert [p.name for p in paths] == ["tiny_llama-plain.jsonl", "tiny_llama-self_spec_fixed.jsonl",
                                       "tiny_llama-short.jsonl"]
    rows = [json.loads(line) for line in paths[1].read_text().splitlines()]
    assert [row["question_id"] for row in rows] == [81, 82]  # Spec-Bench's ids are integers
    first = rows[0]
    assert set(first) == {"question_id", "category", "answer_id", "model_id", "choices", "tstamp"}
    assert first["model_id"] == "tiny_llama-self_spec_fixed" and first["category"] == "writing"
    assert len(first["answer_id"]) == 22 and rows[1]["answer_id"] != first["answer_id"]
    (choice,) = first["choices"]
    spec = [r for r in records if r.strategy == "self_spec_fixed" and r.question_id == "81"]
    assert choice["index"] == 0
    assert choice["turns"] == [answer_text(tokenizer, r.output_ids) for r in spec]
    assert choice["new_tokens"] == [r.new_tokens for r in spec] and choice["wall_time"] == [r.elapsed_s for r in spec]
    assert choice["decoding_steps"] == [r.verify_steps for r in spec]
    assert sum(choice["accept_lengths"]) == sum(r.emitted for r in spec)  # tokens per verification, bonus included
    assert len(rows[1]["choices"][0]["turns"]) == 1
