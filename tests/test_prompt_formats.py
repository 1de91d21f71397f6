"""Prompt files in the formats people have: detected per file, one clear line when nothing fits, never a traceback."""

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from selfspec.data.formats import FORMATS, Prompt, parse_prompt_line
from selfspec.data.prompt_sets import load_prompt_set, load_prompts
from selfspec.errors import SelfspecError

from helpers import run_settings

SPEC_BENCH = Path(__file__).parent / "data" / "spec_bench_question.jsonl"  # lines in the shapes Spec-Bench publishes


def write_lines(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


# one record per format, with a field no format knows (ignored), and the Prompt it gives on line 1
RECORDS = {
    "fastchat": ({"question_id": 7, "turns": ["Hi.", "And then?"], "reference": [["a", "b"]], "extra": 1},
                 Prompt("7", "default", ("Hi.", "And then?"), chat=True)),
    "sharegpt": ({"id": "c1", "conversations": [{"from": "system", "value": "Be brief."},
                                                 {"from": "human", "value": "Name a colour."},
                                                 {"from": "gpt", "value": "Blue."},
                                                 {"from": "human", "value": "Another?"}], "lang": "en"},
                 Prompt("c1", "sharegpt", ("Name a colour.", "Another?"), chat=True)),
    "alpaca": ({"instruction": "Translate to French.", "input": "Good morning", "output": "Bonjour", "x": None},
               Prompt("1", "alpaca", ("Translate to French.\n\nGood morning",), chat=True, reference="Bonjour")),
    "gsm8k": ({"question": "What is 3 + 4?", "answer": "3 + 4 = 7\n#### 7"},
              Prompt("1", "gsm8k", ("What is 3 + 4?",), chat=True, reference="3 + 4 = 7\n#### 7")),
    "humaneval": ({"task_id": "HumanEval/0", "prompt": "def add(a, b):\n", "canonical_solution": "    return a + b\n",
                   "test": "assert add(1, 2) == 3", "entry_point": "add"},
                  Prompt("HumanEval/0", "humaneval", ("def add(a, b):\n",), chat=False,
                         reference="    return a + b\n")),
    "prompt": ({"prompt": "Tell me a joke.", "category": "fun"}, Prompt("1", "fun", ("Tell me a joke.",), chat=True)),
}


@pytest.mark.parametrize("name", list(RECORDS))
def test_each_public_format_is_detected_from_its_fields_and_read(tmp_path, name):
    record, expected = RECORDS[name]
    path = write_lines(tmp_path / f"{name}.jsonl", [record])
    assert load_prompts("jsonl", path=path) == [expected]
    assert load_prompts("jsonl", path=path, format_name=name) == [expected]


def test_every_format_has_a_test_record():
    assert set(RECORDS) == set(FORMATS)


def test_spec_bench_question_file_loads_as_published_and_limit_takes_the_first():
    prompts = load_prompts("jsonl", path=str(SPEC_BENCH))
    assert [p.question_id for p in prompts] == ["81", "111", "161", "241", "321", "401", "481"]
    assert [p.category for p in prompts] == ["writing", "math", "translation", "summarization", "qa",
                                             "math_reasoning", "rag"]
    assert [len(p.turns) for p in prompts] == [2, 2, 1, 1, 1, 1, 1]  # MT-bench keeps both turns
    assert prompts[1].reference == "Area is 3" and prompts[-1].reference is None  # RAG's list of lists is dropped
    chosen = load_prompt_set(run_settings("data=jsonl", f"data.path={SPEC_BENCH}", "data.limit=3").data)
    assert chosen == prompts[:3]


def test_a_json_array_file_loads_like_json_lines(tmp_path):
    records = [{"instruction": "Say hi.", "input": "", "output": "hi"}, {"instruction": "Count to 3.", "id": "c"}]
    array, lines = tmp_path / "alpaca_data.json", tmp_path / "alpaca.jsonl"
    array.write_text(json.dumps(records, indent=4), encoding="utf-8")
    write_lines(lines, records)
    expected = [Prompt("1", "alpaca", ("Say hi.",), chat=True, reference="hi"),
                Prompt("c", "alpaca", ("Count to 3.",), chat=True)]
    assert load_prompts("jsonl", path=str(array)) == expected == load_prompts("jsonl", path=str(lines))


def test_records_without_ids_are_numbered_by_their_line(tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    path.write_text('{"question": "a?"}\n\n{"question": "b?"}\n', encoding="utf-8")
    assert [p.question_id for p in load_prompts("jsonl", path=str(path))] == ["1", "3"]


def test_a_line_separator_inside_json_text_does_not_split_the_record(tmp_path):
    path = tmp_path / "u2028.jsonl"
    path.write_text('{"prompt": "one\u2028two"}\n', encoding="utf-8")
    assert load_prompts("jsonl", path=str(path))[0].turns == ("one\u2028two",)


@pytest.mark.parametrize("lines, format_name, expected", [
    (['{"text": "hi", "label": 1}'], "auto", "no prompt format fits fields ['label', 'text']; expected one of: "
                                            "fastchat {turns}"),
    (['{"question": "a?"}', '{"prompt": "b"}'], "auto", ":2: format gsm8k needs question; found fields ['prompt']"),
    (['{"turns": ["a"]}'], "alpaca", ":1: format alpaca needs instruction; found fields ['turns']"),
    (['{"conversations": [{"from": "gpt", "value": "hi"}]}'], "auto", "no turn from human or user"),
    (['{"conversations": "hi"}'], "auto", "conversations must be a list of {from, value} objects"),
    (['{"instruction": "a", "input": 3}'], "auto", "input must be text or absent, got 3"),
    (['{"prompt": "a", "id": 1.5}'], "auto", "id must be a string or an integer, got 1.5"),
    (['[{"prompt": "a"},', '{"prompt": "b"}'], "auto", "invalid JSON (Expecting ',' delimiter, line 3 column 1)"),
    (['[{"prompt": "a"}, 4]'], "auto", "item 2: format prompt needs prompt; found int 4 (a record is a JSON object)"),
])
def test_records_that_fit_no_format_end_in_one_line_naming_what_was_found(tmp_path, lines, format_name, expected):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(SelfspecError) as err:
        load_prompts("jsonl", path=str(path), format_name=format_name)
    assert expected in str(err.value) and len(str(err.value).splitlines()) == 1


def test_a_file_that_is_not_utf8_ends_in_one_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes('{"prompt": "caf\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(SelfspecError, match="not UTF-8 text"):
        load_prompts("jsonl", path=str(path))


@pytest.mark.parametrize("overrides, expected", [
    (["data=jsonl", "data.path=x.jsonl", "data.format=csv"], "data.format='csv' is unknown; allowed: auto, fastchat"),
    (["data=jsonl", "data.path=x.jsonl", "data.max_prompt_tokens=0"], "data.max_prompt_tokens=0 must be >= 1"),
])
def test_bad_format_settings_end_in_one_line_naming_the_key(overrides, expected):
    with pytest.raises(SelfspecError) as err:
        run_settings(*overrides)
    assert expected in str(err.value)


def test_a_format_is_only_read_for_prompt_files():
    with pytest.raises(SelfspecError, match="format='alpaca' is only read for prompt set 'jsonl', not 'chat'"):
        load_prompts("chat", format_name="alpaca")


def check_prompt_or_one_error_line(line: str, format_name: str = "auto") -> None:
    try:
        prompt = parse_prompt_line(line, format_name)
    except SelfspecError as err:
        assert len(str(err).splitlines()) == 1 and str(err).strip()
        return
    assert prompt.turns and all(isinstance(t, str) and t.strip() for t in prompt.turns)
    assert isinstance(prompt.question_id, str) and isinstance(prompt.category, str)


KEYS = sorted({k for fmt in FORMATS.values() for k in (*fmt.fields, fmt.id_field)}
              | {"category", "reference", "input", "from", "value", "output"})
SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text()
JSON = st.recursive(SCALARS, lambda children: st.lists(children, max_size=4)
                    | st.dictionaries(st.sampled_from(KEYS) | st.text(), children, max_size=5), max_leaves=20)
QUICK = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@QUICK
@given(JSON)
def test_any_json_line_gives_a_prompt_or_one_error_line(value):
    check_prompt_or_one_error_line(json.dumps(value))


MESSAGE = st.fixed_dictionaries({}, optional={"from": st.sampled_from(["human", "gpt", "user"]) | st.text(),
                                              "value": SCALARS})  # ShareGPT's turns
VALUE = st.text() | SCALARS | st.lists(st.text() | MESSAGE | SCALARS, max_size=4) | JSON
RECORD_OF_A_FORMAT = st.sampled_from(list(FORMATS.values())).flatmap(lambda fmt: st.tuples(st.just(fmt.name), (
    st.fixed_dictionaries({name: VALUE for name in fmt.fields},
                          optional={name: VALUE for name in KEYS if name not in fmt.fields}))))


@QUICK
@given(RECORD_OF_A_FORMAT)
def test_any_record_with_a_formats_fields_gives_a_prompt_or_one_error_line(named_record):
    format_name, record = named_record
    check_prompt_or_one_error_line(json.dumps(record), format_name)
    check_prompt_or_one_error_line(json.dumps(record))


@QUICK
@given(st.text())
def test_any_text_line_gives_a_prompt_or_one_error_line(line):
    check_prompt_or_one_error_line(line)


@pytest.mark.parametrize("line", ["1" * 5000, "[" * 100_000, '{"prompt": "a", "id": ' + "9" * 5000 + "}"])
def test_json_the_parser_refuses_for_size_gives_one_error_line(line):
    with pytest.raises(SelfspecError, match="invalid JSON"):
        parse_prompt_line(line)
