"""Training prompts the model writes itself (train.self_prompts): user turns sampled from the chat template's opening,
those the model did not end dropped, stored and read back, refused in one line for a model without a chat template."""

import pytest

from selfspec.errors import SelfspecError
from selfspec.models.loading import LoadedModel
from selfspec.models.tiny import byte_tokenizer, tiny_model
from selfspec.training import self_prompts as module
from selfspec.training.self_prompts import QUERY_TOKENS, self_prompts, user_turn_opening

from helpers import run_settings

ENDS = tuple(range(3, 259, 9))  # every ninth byte ends a turn, so a random model ends most turns within QUERY_TOKENS


@pytest.fixture(scope="module")
def loaded():
    return LoadedModel("tiny", tiny_model("llama", num_layers=2, hidden_size=32).double(), byte_tokenizer(), ENDS)


def settings(*overrides):
    return run_settings("model=tiny_llama", "experiment=train_draft", "train.generate_batch=5", "train.self_prompts=12",
                        *overrides).train


def test_user_turns_are_sampled_after_the_templates_user_opening(loaded, monkeypatch):
    assert loaded.tokenizer.decode(user_turn_opening(loaded)) == "<user>"
    monkeypatch.setattr(loaded.tokenizer, "decode", lambda ids: " ".join(map(str, ids)))  # texts that show the ids
    texts = module.write_user_turns(loaded, settings())
    assert len(texts) == 12 and 0 < sum(map(bool, texts)) < 12  # some ended, some ran past QUERY_TOKENS
    for text in filter(None, texts):
        ids = [int(i) for i in text.split()]  # the turn up to, not including, its first end id
        assert len(ids) < QUERY_TOKENS and not set(ids) & set(ENDS)


def test_self_prompts_are_stored_and_read_back(loaded, tmp_path, monkeypatch):
    made = self_prompts(loaded, settings(), tmp_path)
    assert made and all(p.chat and p.category == "self" and p.turns[0] for p in made)
    assert len({p.question_id for p in made}) == len(made)
    monkeypatch.setattr(module, "write_user_turns", lambda *_: pytest.fail("read back, not made again"))
    assert self_prompts(loaded, settings(), tmp_path) == made
    monkeypatch.setattr(module, "write_user_turns", lambda *_: ["other"] * 12)
    assert [p.turns for p in self_prompts(loaded, settings("train.seed=1"), tmp_path)] == [("other",)] * 12
    assert self_prompts(loaded, settings("train.self_prompts=0"), tmp_path) == []


def test_a_model_without_a_chat_template_is_refused(loaded, tmp_path):
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = None
    with pytest.raises(SelfspecError, match="train.self_prompts needs a chat model; tiny's tokenizer has no chat"):
        self_prompts(LoadedModel("tiny", loaded.model, tokenizer, ENDS), settings(), tmp_path)
    assert not (tmp_path / "self-prompts.pt").exists()
