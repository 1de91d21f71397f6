import json

import pytest

from selfspec.data.prompt_sets import PROMPT_SETS, Prompt, encode_prompt, load_prompt_set, load_prompts
from selfspec.errors import SelfspecError
from selfspec.models.tiny import byte_tokenizer
from selfspec.settings import DataSettings


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_humaneval_has_164_completion_prompts_and_limit_takes_the_first():
    prompts = load_prompts("humaneval")
    assert len(prompts) == 164
    assert prompts[0].question_id == "HumanEval/0" and prompts[-1].question_id == "HumanEval/163"
    assert all(p.category == "code" and not p.chat and len(p.turns) == 1 for p in prompts)
    assert prompts[0].turns[0].startswith("from typing import List")
    assert load_prompts("humaneval", limit=3) == prompts[:3]


@pytest.mark.parametrize("name, minimum", [("chat", 40), ("summarize", 20)])
def test_shipped_sets_are_valid_chat_prompts_with_unique_ids(name, minimum):
    prompts = load_prompts(name)
    assert len(prompts) >= minimum
    assert len({p.question_id for p in prompts}) == len(prompts)
    assert all(p.chat and p.category and p.turns[0].strip() for p in prompts)
    assert load_prompts(name, limit=5) == prompts[:5]


def test_chat_set_is_varied():
    categories = {p.category for p in load_prompts("chat")}
    assert {"writing", "reasoning", "math", "coding", "extraction", "stem", "humanities", "roleplay"} <= categories


def test_summarize_prompts_carry_a_passage_to_summarize():
    for prompt in load_prompts("summarize"):
        instruction, passage = prompt.turns[0].split("\n\n", 1)
        assert instruction == "Summarize the following text in 3 sentences:"
        assert prompt.category == "summarize"
        assert 150 <= len(passage.split()) <= 250


def test_jsonl_round_trip(tmp_path):
    records = [{"question_id": "q1", "category": "math", "turns": ["What is 2 + 2?", "And 3 + 3?"], "reference": "4"},
               {"question_id": 81, "category": "writing", "turns": ["Write a limerick."], "reference": ["any", "x"]}]
    path = write_lines(tmp_path / "prompts.jsonl", [json.dumps(records[0]), "", json.dumps(records[1])])
    prompts = load_prompts("jsonl", path=str(path))
    assert prompts == [Prompt("q1", "math", ("What is 2 + 2?", "And 3 + 3?"), chat=True, reference="4"),
                       Prompt("81", "writing", ("Write a limerick.",), chat=True, reference="any")]
    assert load_prompts("jsonl", path=str(path), limit=1) == prompts[:1]


@pytest.mark.parametrize("kwargs, expected", [
    (dict(name="bogus"), "'bogus'"),
    (dict(name="jsonl"), "path=None"),
    (dict(name="chat", path="extra.jsonl"), "extra.jsonl"),
    (dict(name="jsonl", path="/nonexistent/prompts.jsonl"), "/nonexistent/prompts.jsonl"),
    (dict(name="chat", limit=0), "limit=0"),
    (dict(name="chat", limit=-2), "limit=-2"),
])
def test_bad_arguments_raise_naming_the_value(kwargs, expected):
    with pytest.raises(SelfspecError) as err:
        load_prompts(**kwargs)
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_unknown_name_lists_allowed_sets():
    with pytest.raises(SelfspecError) as err:
        load_prompts("bogus")
    assert all(name in str(err.value) for name in PROMPT_SETS)


GOOD_LINE = json.dumps({"question_id": "ok", "category": "c", "turns": ["fine"]})


def test_spec_bench_lines_load_as_published(tmp_path):
    """A UTF-8 byte-order mark, a retrieval entry whose reference is a list of lists, a record without category."""
    rag = {"question_id": 421, "category": "rag", "turns": ["When did it open?"],
           "reference": [["October 6 , 2017", "September 24 , 2017"]]}
    path = tmp_path / "question.jsonl"
    path.write_text("\ufeff" + "\n".join(json.dumps(r) for r in [rag, {"question_id": "x", "turns": ["Hi."]}]),
                    encoding="utf-8")
    prompts = load_prompts("jsonl", path=str(path))
    assert prompts == [Prompt("421", "rag", ("When did it open?",), chat=True, reference=None),
                       Prompt("x", "default", ("Hi.",), chat=True)]


@pytest.mark.parametrize("bad_line, expected", [
    ('{"question_id": "a", "turns": [', "invalid JSON"),
    ('["not", "an", "object"]', "JSON object"),
    ('{"question_id": "a", "category": "c"}', "format fastchat needs turns; found fields ['category', 'question_id']"),
    ('{"question_id": "a", "category": 5, "turns": ["x"]}', "category must be a string"),
    ('{"question_id": "a", "category": "c", "turns": []}', "[]"),
    ('{"question_id": "a", "category": "c", "turns": "just a string"}', "'just a string'"),
    ('{"question_id": "a", "category": "c", "turns": ["   "]}', "'   '"),
    ('{"question_id": "a", "category": "c", "turns": ["first", ""]}', "turn 1"),
    ('{"question_id": "a", "category": "c", "turns": [42]}', "42"),
    ('{"question_id": "", "category": "c", "turns": ["x"]}', "question_id"),
    ('{"question_id": "ok", "category": "c", "turns": ["x"]}', "'ok' appears more than once"),
])
def test_malformed_line_raises_naming_file_line_and_problem(tmp_path, bad_line, expected):
    path = write_lines(tmp_path / "bad.jsonl", [GOOD_LINE, bad_line])
    with pytest.raises(SelfspecError) as err:
        load_prompts("jsonl", path=str(path))
    message = str(err.value)
    assert str(path) in message and expected in message and "\n" not in message
    if "more than once" not in expected:
        assert f"{path}:2:" in message


def test_empty_file_raises(tmp_path):
    path = write_lines(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(SelfspecError, match="no prompts"):
        load_prompts("jsonl", path=str(path))


def test_prompt_rejects_empty_turn():
    with pytest.raises(SelfspecError, match="turn 0"):
        Prompt("q", "c", ("",), chat=True)


def test_encode_applies_chat_template_only_to_chat_prompts():
    tokenizer = byte_tokenizer()
    chat_prompt = load_prompts("chat", limit=1)[0]
    code_prompt = load_prompts("humaneval", limit=1)[0]

    chat_ids = encode_prompt(tokenizer, chat_prompt)
    code_ids = encode_prompt(tokenizer, code_prompt)

    assert all(type(i) is int for i in chat_ids + code_ids)
    assert tokenizer.decode(chat_ids) == f"<user>{chat_prompt.turns[0]}\n<assistant>"
    assert code_ids == tokenizer(code_prompt.turns[0]).input_ids
    assert tokenizer.decode(code_ids) == code_prompt.turns[0]


def test_encode_chat_prompt_without_template_uses_raw_text():
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = None
    prompt = Prompt("q", "c", ("hello there",), chat=True)
    assert tokenizer.decode(encode_prompt(tokenizer, prompt)) == "hello there"


def test_encode_raises_when_nothing_is_encoded():
    class EmptyTokenizer:
        chat_template = None

        def __call__(self, text):
            return {"input_ids": []}

    with pytest.raises(SelfspecError, match="'q'"):
        encode_prompt(EmptyTokenizer(), Prompt("q", "c", ("hello",), chat=False))


@pytest.mark.parametrize("name", ["humaneval", "chat", "summarize"])
def test_calibration_and_evaluation_halves_split_every_shipped_set_and_category(name):
    every = load_prompts(name)
    halves = {split: load_prompt_set(DataSettings(name=name, split=split)) for split in ("calibration", "evaluation")}
    calibration, evaluation = ({p.question_id for p in prompts} for prompts in halves.values())
    assert not calibration & evaluation and calibration | evaluation == {p.question_id for p in every}
    assert halves["evaluation"][0] == every[1]  # the 2nd, 4th, ... prompt
    assert {p.category for p in halves["calibration"]} == {p.category for p in halves["evaluation"]}


def test_split_applies_before_offset_and_limit_and_never_to_a_file_of_yours(tmp_path):
    assert [p.question_id for p in load_prompt_set(DataSettings(name="chat", split="evaluation", offset=1, limit=2))] \
        == ["chat-04", "chat-06"]
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps({"turns": [f"q{i}"]}) + "\n" for i in range(3)))
    assert len(load_prompt_set(DataSettings(name="jsonl", path=str(path), split="evaluation"))) == 3
    with pytest.raises(SelfspecError, match="split='half' is unknown; allowed: all, calibration, evaluation"):
        DataSettings(name="chat", split="half")
