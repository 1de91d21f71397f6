import json
import re

import pytest

from selfspec.data.prompt_sets import (PROMPT_SETS, SHIPPED_SETS, Prompt, calibration_texts, encode_prompt,
                                       load_prompt_set, load_prompts, split_prompts)
from selfspec.errors import SelfspecError
from selfspec.models.tiny import byte_tokenizer
from selfspec.settings import DataSettings

from helpers import run_settings


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


SET_SIZES = {"chat": 40, "summarize": 20, "qa": 24, "math": 24, "translate": 24, "retrieval": 16}
SET_CATEGORIES = {"qa": "qa", "math": "math", "translate": "translation", "retrieval": "retrieval"}  # one each


def test_every_shipped_set_is_listed_here():
    assert set(SET_SIZES) == set(SHIPPED_SETS)


@pytest.mark.parametrize("name, size", SET_SIZES.items())
def test_shipped_sets_are_valid_chat_prompts_with_unique_ids(name, size):
    prompts = load_prompts(name)
    assert len(prompts) == size
    assert len({p.question_id for p in prompts}) == len(prompts)
    assert all(p.question_id.startswith(f"{name}-") for p in prompts)  # unique across sets too, for data=mix
    assert all(p.chat and p.category and len(p.turns) == 1 and p.turns[0].strip() for p in prompts)
    assert load_prompts(name, limit=5) == prompts[:5]
    if name in SET_CATEGORIES:
        assert {p.category for p in prompts} == {SET_CATEGORIES[name]}


def test_qa_prompts_are_short_questions_with_reference_answers():
    for prompt in load_prompts("qa"):
        assert prompt.turns[0].endswith("?") and len(prompt.turns[0].split()) <= 25, prompt.question_id
        assert prompt.reference


def test_math_prompts_are_word_problems_asking_for_working_with_a_final_answer():
    for prompt in load_prompts("math"):
        assert "step" in prompt.turns[0] and re.search(r"\d", prompt.turns[0]), prompt.question_id
        assert re.search(r"\d", prompt.reference or ""), prompt.question_id


TRANSLATION = re.compile(r"Translate the following (English|French|German|Spanish) text into "
                         r"(English|French|German|Spanish)\.\n\n(.+)", re.DOTALL)


def test_both_halves_translate_every_language_both_ways_and_start_varied():
    expected = {(a, b) for language in ("French", "German", "Spanish")
                for a, b in (("English", language), (language, "English"))}
    for split in ("calibration", "evaluation"):
        directions = [TRANSLATION.fullmatch(p.turns[0]).groups()[:2]
                      for p in split_prompts(load_prompts("translate"), split)]
        assert set(directions) == expected and len(directions) == 12
        assert len({language for pair in directions[:3] for language in pair}) == 4  # data.limit=3 sees all four
    for prompt in load_prompts("translate"):
        sentences = re.findall(r"[.?!](?:\s|$)", TRANSLATION.fullmatch(prompt.turns[0]).group(3))
        assert 2 <= len(sentences) <= 4, prompt.question_id


def test_retrieval_prompts_ask_one_question_after_a_long_passage():
    passages = set()
    for prompt in load_prompts("retrieval"):
        text, question = prompt.turns[0].rsplit("\n\nQuestion: ", 1)
        instruction, passage = text.split("\n\n", 1)
        assert instruction == "Read the passage below, then answer the question after it using only the passage."
        assert 250 <= len(passage.split()) <= 450 and "?" in question and prompt.reference
        passages.add(passage.split("\n", 1)[0])
    assert len(passages) == 16  # a different passage each time


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


@pytest.mark.parametrize("name", ["humaneval", *SHIPPED_SETS])
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


def test_mix_is_every_set_with_the_limit_per_set():
    data = run_settings("data=mix").data
    assert data.names == ["humaneval", *SHIPPED_SETS]
    prompts = load_prompt_set(DataSettings(**{**vars(data), "split": "evaluation"}))
    assert len(prompts) == 3 * len(data.names) and len({p.question_id for p in prompts}) == len(prompts)
    assert [p.question_id for p in prompts[3:6]] == ["chat-02", "chat-04", "chat-06"]
    assert {"code", "summarize", "qa", "math", "translation", "retrieval"} <= {p.category for p in prompts}
    bench = run_settings("experiment=bench").data
    assert bench.names == data.names and bench.split == "evaluation"


def test_calibration_texts_hold_every_calibration_half_and_no_evaluation_prompt():
    texts = "\n".join(calibration_texts())
    for name in SHIPPED_SETS:
        calibration, evaluation = (split_prompts(load_prompts(name), split) for split in ("calibration", "evaluation"))
        assert all(p.turns[0] in texts for p in calibration), name
        assert not any(p.turns[0] in texts for p in evaluation), name


def test_draft_training_takes_every_set():
    assert list(run_settings().train.sets) == ["humaneval", *SHIPPED_SETS]
