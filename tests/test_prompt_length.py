"""Prompts longer than the model's context: one line naming the prompt, or left-truncation that is counted."""

import pytest

from selfspec.data.formats import Prompt
from selfspec.data.lengths import ContextRoom, context_room, fit_prompts, with_truncated_count
from selfspec.errors import SelfspecError
from selfspec.models.tiny import tiny_model

PROMPTS = [Prompt("short", "c", ("a",), chat=True), Prompt("long", "c", ("b",), chat=True)]
IDS = [list(range(10)), list(range(100, 150))]  # 10 and 50 tokens
ROOM = ContextRoom(max_positions=64, max_new_tokens=16, draft_tokens=8)  # 40 prompt tokens


def test_the_room_is_the_models_positions_minus_new_tokens_and_the_draft():
    model = tiny_model("llama", num_layers=1, hidden_size=16)
    assert context_room(model, 128, 12) == ContextRoom(4096, 128, 12) and ContextRoom(4096, 128, 12).tokens == 3956


def test_a_prompt_longer_than_the_room_ends_in_one_line_naming_its_id_and_length():
    with pytest.raises(SelfspecError) as err:
        fit_prompts(PROMPTS, IDS, ROOM)
    message = str(err.value)
    assert message.startswith("prompt 'long' is 50 tokens, longer than the model leaves room for (40 = "
                              "max_position_embeddings 64 - sampling.max_new_tokens 16 - draft.max_tokens 8)")
    assert "data.max_prompt_tokens" in message and len(message.splitlines()) == 1


def test_max_prompt_tokens_keeps_the_last_tokens_warns_and_counts(capsys):
    fitted = fit_prompts(PROMPTS, IDS, ROOM, max_prompt_tokens=20)
    assert fitted.ids == [list(range(10)), list(range(130, 150))] and fitted.truncated == 1
    assert "selfspec: warning: 1 of 2 prompts were longer than data.max_prompt_tokens=20" in capsys.readouterr().err


def test_prompts_that_fit_are_kept_whole_and_silently(capsys):
    fitted = fit_prompts(PROMPTS, IDS, ContextRoom(4096, 128, 12))
    assert fitted.ids == IDS and fitted.truncated == 0 and capsys.readouterr().err == ""
    assert fit_prompts(PROMPTS, IDS, ContextRoom(None, 128, 12)).ids == IDS  # no position limit stated


@pytest.mark.parametrize("room, max_prompt_tokens, message", [
    (ROOM, 41, "data.max_prompt_tokens=41 is more than the model leaves room for (40 = "),
    (ContextRoom(64, 60, 4), None, "the model leaves no room for a prompt: 0 = max_position_embeddings 64"),
])
def test_settings_that_leave_too_little_room_end_in_one_line(room, max_prompt_tokens, message):
    with pytest.raises(SelfspecError, match=message.replace("(", r"\(")):
        fit_prompts(PROMPTS, IDS, room, max_prompt_tokens)


def test_the_summary_carries_the_truncated_count_for_every_strategy():
    summary = with_truncated_count({"plain": {"n_prompts": 2}, "self_spec": {"n_prompts": 2}}, 1)
    assert summary == {"plain": {"n_prompts": 2, "truncated_prompts": 1},
                       "self_spec": {"n_prompts": 2, "truncated_prompts": 1}}
