"""Helpers shared by the test modules (plain functions and constants; shared fixtures live in conftest.py)."""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import gguf
import httpx
import numpy as np
import torch
from hydra import compose, initialize_config_dir
from scipy.stats import chisquare

from selfspec import SelfSpeculativeDecoder
from selfspec.decoding.draft_exit import CostAwareExit, DraftExit
from selfspec.decoding.drafters import ChainDrafter, HeadFeatures
from selfspec.decoding.drafters.layer_skip_tree import StoreTreeDrafter
from selfspec.decoding.options import GenerationOptions
from selfspec.decoding.sampling import logits_processor, scores
from selfspec.decoding.results import Emitted
from selfspec.decoding.speculative import Generation, generate, settled, verify_forward
from selfspec.decoding.text_rules import OutputWatch
from selfspec.models.tiny import byte_tokenizer
from selfspec.models.cache import forward, new_cache
from selfspec.models.feature_head import load_feature_head
from selfspec.models.loading import load_model
from selfspec.models.token_store import load_token_store
from selfspec.records.prompt_records import PromptRecord, RecordedStep
from selfspec.serve.bench import local_server
from selfspec.settings import ModelSettings, RunSettings, from_config, typed

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
TINY_MODEL = dict(family="llama", num_layers=3, hidden_size=32, sliding_window=8, seed=0)


def run_settings(*overrides: str) -> RunSettings:
    """The typed settings `python run.py <overrides>` would run with."""
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return from_config(compose("config", overrides=list(overrides)))


def run_py(*overrides, out_dir=None, wait=True, timeout=600, **popen_kwargs):
    """`python run.py <overrides>` from the repository root: the CompletedProcess, or with wait=False the Popen."""
    # out_dir adds hydra.run.dir=out_dir; stdout and stderr come back as text unless popen_kwargs send them elsewhere
    command = [sys.executable, "run.py", *overrides, *([f"hydra.run.dir={out_dir}"] if out_dir is not None else [])]
    options = dict(cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE) | popen_kwargs
    if not wait:
        return subprocess.Popen(command, **options)
    return subprocess.run(command, timeout=timeout, **options)


def cfg(source="tiny", **overrides) -> ModelSettings:
    """Model settings for load_model: a 3-layer tiny Llama in float32 on the CPU unless `overrides` say otherwise."""
    return typed(ModelSettings, dict(name="m", source=source, path=None, dtype="float32", device="cpu",
                                     cache_dir="~/.cache/selfspec", packed_linears=True, **TINY_MODEL) | overrides,
                 "model")


def hf_greedy(model, prompt, n, eos=None):
    """The next `n` tokens of transformers' own greedy `generate` after `prompt`."""
    # pass the attention mask: without it transformers guesses padding from pad == eos ids inside the prompt
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def shipped_head_acceptance(model, prompts: list[list[int]], settings, end_ids, plain: list[list[int]]) -> float:
    """The shipped feature head's acceptance rate drafting 3-token chains for `prompts`, asserting that every output
    equals plain decoding's (`plain`)."""
    drafter = ChainDrafter(HeadFeatures(model, load_feature_head("shipped", model)), DraftExit(3))
    return lossless_acceptance(model, drafter, prompts, settings, end_ids, plain)


def shipped_store_acceptance(model, prompts: list[list[int]], settings, end_ids, plain: list[list[int]]) -> float:
    """The shipped token store's acceptance rate drafting 3-deep trees of up to 6 nodes for `prompts`, asserting
    that every output equals plain decoding's (`plain`)."""
    drafter = StoreTreeDrafter(model, load_token_store("shipped", model), DraftExit(3), nodes=6, depth=3, width=2,
                               branch_below=0.6)
    return lossless_acceptance(model, drafter, prompts, settings, end_ids, plain)


def lossless_acceptance(model, drafter, prompts: list[list[int]], settings, end_ids, plain: list[list[int]]) -> float:
    """`drafter`'s acceptance rate over `prompts`, asserting that every output equals plain decoding's (`plain`)."""
    drafted = accepted = 0
    for ids, expected in zip(prompts, plain, strict=True):
        result = generate(model, ids, GenerationOptions(settings, end_ids=end_ids), drafter)
        assert result.new_tokens == expected
        drafted, accepted = drafted + result.drafted, accepted + result.accepted
    return accepted / drafted


def decode_checking_cache(model, prompt: list[int], options: GenerationOptions, drafter) -> list[int]:
    """Decode as decode_steps does, asserting after every step that the cache holds exactly the tokens fed so far
    (all but the last emitted one, which the next step feeds); returns the new tokens."""
    generation = Generation(model, prompt, options, drafter)
    generation.start()
    while not generation.finished:
        proposal = generation.propose()
        generation.conclude(proposal, verify_forward(model, generation.context.cache, proposal))
        assert_cache_holds(model, generation.context.cache, generation.tokens[:-1])
    return generation.tokens[len(prompt):]


def assert_cache_holds(model, cache, kept: list[int]) -> None:
    """`cache` holds exactly `kept`: its length, and the keys and values a fresh forward over them writes.
    Eager attention (Gemma-2) takes its softmax in float32, so keys masked out in one forward and absent in the
    other change a sum's order (~1e-7); sdpa (Llama, Gemma-3) stays in float64 and matches to rounding."""
    tolerance = dict(rtol=1e-5, atol=1e-5) if model.config._attn_implementation == "eager" else {}
    fresh = new_cache(model, len(kept) + 1)
    forward(model, fresh, kept, 0)
    for mine, ref in zip(cache.layers, fresh.layers):
        assert int(mine.get_seq_length()) == len(kept)
        torch.testing.assert_close(mine.keys[:, :, :len(kept)], ref.keys, **tolerance)
        torch.testing.assert_close(mine.values[:, :, :len(kept)], ref.values, **tolerance)


def exact_pair_distribution(model, prompt, settings):
    """P(new tokens 2 and 3) computed from the full model: sum over t1 of p(t1) p(t2|t1) p(t3|t1,t2)."""
    processor = logits_processor(settings)

    def dist(context):
        logits = forward(model, new_cache(model, 64), context, 0, last_only=True)
        return torch.softmax(scores(logits, context, len(context), processor)[0], dim=-1)

    pairs = {}
    p1 = dist(prompt)
    for t1 in p1.nonzero().flatten().tolist():
        p2 = dist(prompt + [t1])
        for t2 in p2.nonzero().flatten().tolist():
            p3 = dist(prompt + [t1, t2])
            for t3 in p3.nonzero().flatten().tolist():
                pairs[(t2, t3)] = pairs.get((t2, t3), 0.0) + float(p1[t1] * p2[t2] * p3[t3])
    return pairs


def chi_square_pvalue(counts: dict, exact: dict) -> float:
    """Goodness of fit of observed counts to exact probabilities; cells expecting < 5 are pooled."""
    n = sum(counts.values())
    big = [k for k in exact if exact[k] * n >= 5]
    observed = [counts.get(k, 0) for k in big]
    expected = [exact[k] * n for k in big]
    rest = n - sum(observed), n - sum(expected)
    if rest[1] >= 5:
        observed.append(rest[0])
        expected.append(rest[1])
    return chisquare(observed, [e * sum(observed) / sum(expected) for e in expected]).pvalue


def record(strategy, question_id, category="code", elapsed_s=1.0, steps=((3, 2), (3, 0), (4, 4)), threshold=0.5,
           plain_elapsed_s=None):
    """A PromptRecord; steps are (drafted, accepted) pairs (plain decoding: one token per step)."""
    if strategy == "plain":
        rows = [RecordedStep(drafted=0, accepted=0, emitted=1, threshold=0.0) for _ in range(9)]
    else:
        rows = [RecordedStep(drafted=d, accepted=a, emitted=a + 1, threshold=threshold + 0.01 * i)
                for i, (d, a) in enumerate(steps)]
    new_tokens = sum(r.emitted for r in rows) + 1
    drafted, accepted = sum(r.drafted for r in rows), sum(r.accepted for r in rows)
    plain_tps = 10 / (plain_elapsed_s or elapsed_s)
    return PromptRecord(strategy=strategy, question_id=question_id, category=category, prompt_tokens=5,
                        new_tokens=new_tokens, elapsed_s=elapsed_s, tokens_per_s=new_tokens / elapsed_s,
                        drafted=drafted, accepted=accepted, verify_steps=len(rows),
                        emitted=sum(r.emitted for r in rows), acceptance_rate=accepted / drafted if drafted else None,
                        mean_accepted_tokens=sum(r.emitted for r in rows) / len(rows),
                        speedup=(new_tokens / elapsed_s) / plain_tps, matches_plain=True, steps=rows)


def run_records(strategies=("plain", "self_spec"), categories=("code", "writing"), per_category=2, speed=2.0,
                steps=((3, 2), (3, 0), (4, 4)), threshold=0.5):
    """Records of one run: every strategy on every prompt; non-plain strategies `speed` times faster-ish."""
    rows = []
    for c, category in enumerate(categories):
        for p in range(per_category):
            question_id = f"{category}-{p}"
            for s, strategy in enumerate(strategies):
                elapsed = 1.0 if strategy == "plain" else 1.0 / (speed + 0.1 * p + 0.2 * s + 0.05 * c)
                rows.append(record(strategy, question_id, category, elapsed, steps, threshold, plain_elapsed_s=1.0))
    return rows


# the figures `make figures` draws from each experiment's runs
FIGURES = {
    "threshold_sweep": ["threshold_sweep"],
    "adaptive_trace": ["adaptive_trace", "adaptive_accepted"],
    "skip_ratio": ["skip_ratio"],
    "search_history": ["search_history", "search_pareto", "search_skip_mask"],
    "strategies": ["strategies_speedup", "strategies_accepted"],
    "sampling": ["sampling"],
    "batch": ["batch_speedup", "batch_throughput"],
    "field": ["field_speedup"],
}


def write_gguf(path: Path, architecture: str = "llama", layers: int = 2, hidden: int = 32) -> Path:
    """A tiny random float32 GGUF file of `architecture` as llama.cpp lays one out (config fields, the byte tokenizer
    as a GPT-2 style vocabulary, and for llama its tensors), which transformers reads back offline."""
    tokens = byte_tokenizer().convert_ids_to_tokens(list(range(259)))
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("tiny")
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(2 * hidden)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_dimension_count(hidden // 4)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * 256)  # control tokens, then normal ones
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_merges([])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (259, hidden), "output_norm.weight": (hidden,), "output.weight": (259, hidden)}
    for i in range(layers):
        shapes |= {f"blk.{i}.attn_norm.weight": (hidden,), f"blk.{i}.ffn_norm.weight": (hidden,),
                   f"blk.{i}.attn_q.weight": (hidden, hidden), f"blk.{i}.attn_k.weight": (hidden // 2, hidden),
                   f"blk.{i}.attn_v.weight": (hidden // 2, hidden), f"blk.{i}.attn_output.weight": (hidden, hidden),
                   f"blk.{i}.ffn_gate.weight": (2 * hidden, hidden), f"blk.{i}.ffn_up.weight": (2 * hidden, hidden),
                   f"blk.{i}.ffn_down.weight": (hidden, 2 * hidden)}
    for name, shape in shapes.items():
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.2).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def watched_steps(rules, tokenizer, pieces: list[str]):
    """What the decoding loop yields for steps that emit `pieces`, under `rules`."""
    context = SimpleNamespace(watch=OutputWatch(rules, tokenizer("> ").input_ids))
    for piece in pieces:
        yield settled(context, Emitted(tokenizer(piece).input_ids, None))


def printable(text: str) -> bool:
    """Printable ASCII without whitespace: text a random model's bytes decode to as written."""
    return text.isascii() and text.isprintable() and not any(c.isspace() for c in text)


def main_in_process(monkeypatch, capsys, *overrides: str) -> tuple[int, str]:
    """run.py's main() in this process (a subprocess costs seconds of imports): its exit status and stderr."""
    from selfspec.cli import main

    monkeypatch.setattr(sys, "argv", ["run.py", *overrides])
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)  # main() sets it; this puts it back after the test
    try:
        main()
        code = 0
    except SystemExit as stop:
        code = stop.code
    return code, capsys.readouterr().err


# the server (tests/test_serve.py, tests/test_serve_batch.py, tests/test_serve_bench.py)

server = local_server  # server(tmp_path, *overrides): a task=serve subprocess; yields its URL once /health answers


def plain_decoder(*overrides: str) -> SelfSpeculativeDecoder:
    """Plain greedy decoding in this process, over the weights a server with these overrides loads."""
    loaded = load_model(run_settings(*overrides).model)
    return SelfSpeculativeDecoder(loaded.model, loaded.tokenizer, strategy="plain")


def chat(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def stream_events(client: httpx.Client, url: str, body: dict) -> list[dict]:
    with client.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=600) as response:
        assert response.status_code == 200, response.read()
        data = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(event) for event in data[:-1]]


def pinned(policy: CostAwareExit) -> CostAwareExit:
    """`policy` with its costs kept as given: the clock of the loop (the tiny model's milliseconds) does not move
    them, so a test's costs decide what it drafts."""
    policy.observe_draft_ms = lambda per_token_ms: None
    policy.observe_verify_ms = lambda tokens, ms: None
    return policy
