from dataclasses import replace

import pytest
import torch

from selfspec.decoding.sampling import (accept_probability, history_ids, kept_q, logits_processor, residual, sample,
                                       scores)
from selfspec.decoding.speculative import verify_sampled
from selfspec.errors import SelfspecError
from selfspec.settings import default_settings

SAMPLING = default_settings().sampling  # the config's: greedy, 128 new tokens
LOGITS = torch.tensor([[2.0, 1.0, 0.0, -1.0]])  # softmax: 0.6439, 0.2369, 0.0871, 0.0321


def probs(settings, logits=LOGITS, tokens=(0,)):
    return torch.softmax(scores(logits, list(tokens), len(tokens), logits_processor(settings)), dim=-1)


def test_temperature_divides_logits():
    expected = torch.softmax(LOGITS / 0.5, dim=-1)
    torch.testing.assert_close(probs(replace(SAMPLING, temperature=0.5)), expected)


def test_top_k_keeps_the_k_largest():
    e = torch.exp(torch.tensor([2.0, 1.0]))
    expected = torch.tensor([[e[0] / e.sum(), e[1] / e.sum(), 0, 0]])
    torch.testing.assert_close(probs(replace(SAMPLING, temperature=1.0, top_k=2)), expected)


def test_top_p_keeps_the_smallest_set_reaching_p():
    # 0.644 < 0.8 <= 0.644 + 0.237: the two largest tokens stay
    kept = probs(replace(SAMPLING, temperature=1.0, top_p=0.8))
    assert (kept[0, 2:] == 0).all() and torch.isclose(kept[0, :2].sum(), torch.tensor(1.0))
    kept = probs(replace(SAMPLING, temperature=1.0, top_p=0.5))
    torch.testing.assert_close(kept, torch.tensor([[1.0, 0, 0, 0]]))


def test_repetition_penalty_uses_each_rows_own_history():
    settings = replace(SAMPLING, repetition_penalty=2.0)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [2.0, 1.0, 0.0, -1.0]])
    out = scores(logits, [3, 0], 1, logits_processor(settings))  # row 0 saw [3], row 1 saw [3, 0]
    torch.testing.assert_close(out, torch.tensor([[2.0, 1.0, 0.0, -2.0], [1.0, 1.0, 0.0, -2.0]]))


def test_history_ids_pads_with_a_repeat():
    ids = history_ids([7, 8, 9], 2, 2, "cpu")
    assert ids.tolist() == [[7, 8, 7], [7, 8, 9]]


def test_greedy_applies_no_warpers():
    assert len(logits_processor(replace(SAMPLING, temperature=0.0, top_k=5, top_p=0.5))) == 0


def test_accept_then_resample_from_the_residual_yields_exactly_p():
    """Sum over drafts x ~ q of [accept x] + [reject] * residual equals p, for random p, q (and disjoint supports)."""
    gen = torch.Generator().manual_seed(0)
    cases = [(torch.rand(6, generator=gen, dtype=torch.float64), torch.rand(6, generator=gen, dtype=torch.float64))
             for _ in range(20)]
    cases.append((torch.tensor([0.5, 0.5, 0, 0], dtype=torch.float64), torch.tensor([0, 0, 0.3, 0.7], dtype=torch.float64)))
    cases.append((torch.tensor([0.2, 0.8], dtype=torch.float64), torch.tensor([0.2, 0.8], dtype=torch.float64)))
    for p, q in cases:
        p, q = p / p.sum(), q / q.sum()
        support = q > 0
        accept = torch.zeros_like(p)
        accept[support] = accept_probability(p[support], q[support])
        output = q * accept + (q * (1 - accept)).sum() * residual(p, q)
        torch.testing.assert_close(output, p, atol=1e-6, rtol=0)


def test_a_draft_holds_a_top_k_q_sparse_and_verification_reads_it_as_the_dense_one():
    gen = torch.Generator().manual_seed(0)
    top_k = replace(SAMPLING, temperature=1.0, top_k=5, top_p=1.0)
    logits = torch.randn(4, 300, generator=gen)  # (k, vocab): a chain of 3 drafts, and the bonus row
    q = [probs(top_k, row[None])[0] for row in logits[:3]]  # 5 nonzero entries each
    held = [kept_q(q_j) for q_j in q]
    assert all(h.is_sparse and h._nnz() == 5 for h in held)
    torch.testing.assert_close(torch.stack([h.to_dense() for h in held]), torch.stack(q))
    assert not kept_q(torch.softmax(logits[0], dim=-1)).is_sparse  # no zeros: dense is smaller
    p = torch.softmax(torch.randn(4, 300, generator=gen), dim=-1)  # (k+1, vocab)
    outcomes = set()
    for seed in range(200):
        tokens = [sample(q_j, torch.Generator().manual_seed(seed + j)) for j, q_j in enumerate(q)]
        dense = verify_sampled(tokens, q, p, torch.Generator().manual_seed(seed))
        assert verify_sampled(tokens, held, p, torch.Generator().manual_seed(seed)) == dense
        outcomes.add(dense[0])
    assert len(outcomes) > 1  # the seeds reach rejections (and their residuals), not only acceptances


@pytest.mark.parametrize("kwargs,name", [({"temperature": -1.0}, "temperature"), ({"top_k": -2}, "top_k"),
                                         ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
                                         ({"max_new_tokens": 0}, "max_new_tokens"),
                                         ({"repetition_penalty": 0.0}, "repetition_penalty")])
def test_bad_sampling_settings(kwargs, name):
    with pytest.raises(SelfspecError, match=f"^{name}="):
        replace(SAMPLING, **kwargs)


@pytest.mark.parametrize("top_k,top_p", [(50, 0.9), (5, 0.5), (1, 0.9), (40, 0.99)])
def test_top_p_within_top_k_equals_transformers_top_k_then_top_p(top_k, top_p):
    """The shortcut filters as transformers' warpers in sequence, on logits with tied leaders, tokens already at
    -inf (a banned token), a row with fewer finite scores than k (a token store's counts) and rows whose top-p sets
    differ in size: the same scores wherever no two tokens tie at the top-p cut. Where several tie there (rows 1, 2
    and 4), both keep the same number of them with the same scores; which of the equal tokens go follows the order
    of each one's unstable sort."""
    from transformers import LogitsProcessorList, TopKLogitsWarper, TopPLogitsWarper
    gen = torch.Generator().manual_seed(top_k)
    logits = 3 * torch.randn(6, 3000, generator=gen)  # (rows, vocab)
    logits[1, :8] = logits[1].max() + 1.0  # eight tied leaders
    logits[2, 100:400] = logits[2].topk(top_k).values[-1]  # ties at the k-th value: TopK keeps all of them
    logits[3, ::7] = float("-inf")
    logits[4] = logits[4].round()  # many ties everywhere
    logits[5, 4:] = float("-inf")  # four finite scores: the rest tie at the k-th value when k > 4
    reference = LogitsProcessorList([TopKLogitsWarper(top_k), TopPLogitsWarper(top_p)])
    ids = torch.zeros(6, 1, dtype=torch.long)
    ours = logits_processor(replace(SAMPLING, temperature=1.0, top_k=top_k, top_p=top_p))(ids, logits.clone())
    theirs = reference(ids, logits.clone())
    for row in (0, 3, 5):
        assert torch.equal(ours[row], theirs[row])
    assert torch.equal(ours.sort(dim=-1).values, theirs.sort(dim=-1).values)
