"""Draft chains in training (training/chains.py): every step of the parallel chains is what the head computes drafting
live (HeadFeatures, decoding/drafters/feature_head.py), padding and sliding windows included, and chain_acceptance
counts what greedy drafting would accept (training/objective.py)."""

import pytest
import torch

from selfspec.decoding.drafters.feature_head import HeadFeatures
from selfspec.models.cache import RewindableCache
from selfspec.models.feature_head import inner_states, new_feature_head
from selfspec.models.layouts import base_model
from selfspec.models.tiny import tiny_model
from selfspec.training.chains import chain_states
from selfspec.training.draft_data import TrainingSequence
from selfspec.training.objective import batch_states, chain_acceptance

STEPS = 4


@pytest.fixture(scope="module", params=["llama", "gemma3"])  # Gemma-3's head layer slides over a 16-token window
def model(request):
    return tiny_model(request.param, num_layers=4, hidden_size=32).double()


def final_states(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return base_model(model)(tokens[None]).last_hidden_state[0]  # (L, hidden)


def fused_states(model, tokens: torch.Tensor, layers: tuple[int, ...]) -> torch.Tensor:
    with torch.no_grad():
        states = base_model(model)(tokens[None], output_hidden_states=True).hidden_states
    return inner_states([states[layer][0] for layer in layers])  # (L, n x hidden)


def live_chain(model, head, tokens: torch.Tensor, final: torch.Tensor, start: int, steps: int,
               inner: torch.Tensor | None = None) -> list:
    """The head's predicted states drafting live after the kept tokens tokens[:start + 2], each later step fed the
    sequence's next token (what it drafts where it is right)."""
    features = HeadFeatures(model, head)
    features.head_cache, features.seen = RewindableCache(1, len(tokens) + steps), 0
    features.features, features.inner, features.tokens = final, inner, tokens[:start + 2].tolist()
    features.next_logits(features.tokens[-1:], start + 1)  # catches up over head positions 0..start
    predicted = [features.predicted]
    for position in range(start + 2, min(start + 1 + steps, len(tokens))):
        features.next_logits([int(tokens[position])], position)
        predicted.append(features.predicted)
    return predicted


@pytest.mark.parametrize("fused_layers", [(), (1, 3)])  # with fused layers, a chain's first step reads their states
def test_every_chain_step_is_what_the_head_computes_drafting_live(model, fused_layers):
    torch.manual_seed(0)
    head = new_feature_head(model, fused_layers)
    for fuse in (head.fuse, head.fuse_inner or head.fuse):  # a head whose outputs depend on what it is fed
        torch.nn.init.normal_(fuse.weight, std=0.3)
    lengths = [40, 27]  # two rows, the second right padded
    rows = [torch.randint(3, 259, (n,)) for n in lengths]
    finals = [final_states(model, tokens) for tokens in rows]
    inners = [fused_states(model, tokens, fused_layers) if fused_layers else None for tokens in rows]
    width = max(lengths) - 1
    features = torch.zeros(2, width, 32, dtype=model.dtype)
    embeds = torch.zeros_like(features)
    inner = torch.zeros(2, width, 32 * len(fused_layers), dtype=model.dtype) if fused_layers else None
    for row, (tokens, final) in enumerate(zip(rows, finals)):
        features[row, :len(tokens) - 1] = final[:-1]
        embeds[row, :len(tokens) - 1] = model.get_input_embeddings()(tokens[1:])
        if fused_layers:
            inner[row, :len(tokens) - 1] = inners[row][:-1]
    with torch.no_grad():
        chains = chain_states(head, features, embeds, [n - 1 for n in lengths], STEPS, inner)
        unfused = chain_states(head, features, embeds, [n - 1 for n in lengths], STEPS)
    assert torch.equal(chains[0], unfused[0]) != bool(fused_layers)  # step 1 alone reads the fused states
    for row, (tokens, final) in enumerate(zip(rows, finals)):
        for start in (0, 5, 17, len(tokens) - 5):
            live = live_chain(model, head, tokens, final, start, STEPS, inners[row])
            assert len(live) == STEPS
            for step, state in enumerate(live):
                assert torch.allclose(chains[step][row, start + step], state, atol=1e-10), (row, start, step)


def test_chain_acceptance_counts_what_greedy_drafting_accepts(model):
    """Scored over 3 output rows, a random head agrees by chance often enough to make chains of several tokens. A
    greedy sequence stays on the model's path; a sampled one leaves it, and chains stop there."""
    torch.manual_seed(1)
    head = new_feature_head(model)
    prompt = torch.randint(3, 259, (6,))
    greedy = model.generate(prompt[None], max_new_tokens=30, do_sample=False, attention_mask=torch.ones(1, 6),
                            pad_token_id=0)[0]
    sampled = torch.cat([greedy[:16], torch.randint(3, 259, (14,))])  # leaves the path after 10 greedy tokens
    weight = model.lm_head.weight.detach()[[10, 20, 30]]  # (3, hidden)
    batch = [TrainingSequence(tokens, len(prompt), final_states(model, tokens)) for tokens in (greedy, sampled)]
    with torch.no_grad():
        accepted = chain_acceptance(batch_states(head, model, batch, 0.0, steps=STEPS), model, weight).tolist()

    expected = []
    for seq in batch:
        full = model.lm_head(seq.final).argmax(-1)  # (L,): the model's greedy token after each position
        on_path = (full[:-1] == seq.tokens[1:]).tolist()  # x_{i+1} is the model's greedy token
        for start in range(len(prompt) - 2, len(seq.tokens) - 1):
            if not on_path[start]:
                continue
            count = 0
            for step, state in enumerate(live_chain(model, head, seq.tokens, seq.final, start, STEPS)):
                i = start + step
                if not (on_path[i] and (weight @ state).argmax() == (weight @ seq.final[i + 1]).argmax()):
                    break
                count += 1
            expected.append(count)
    assert accepted == expected
    assert max(accepted) >= 2 and len(accepted) > len(greedy) - len(prompt)  # chains longer than one; both rows
