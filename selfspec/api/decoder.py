"""The Python API: self-speculative decoding over a transformers model.

    decoder = SelfSpeculativeDecoder.from_pretrained("smollm2")  # an embedded model, its shipped drafts
    reply = decoder.generate([{"role": "user", "content": "Hi"}], max_new_tokens=64)
    print(reply.text, reply.stats.acceptance_rate)
    for chunk in decoder.stream("def fib(n):"): print(chunk.text, end="")

`SelfSpeculativeDecoder(model, tokenizer, skip=...)` wraps a model the caller loaded. Either way it builds the
same `Strategy` (decoding/strategies.py) that run.py, the benchmark and the search decode with.
"""

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from selfspec.api.streaming import Chunk, DecodingStats, interleaved, row_steps, stream_chunks
from selfspec.data.prompt_sets import as_token_ids, calibration_texts
from selfspec.decoding.options import GenerationOptions
from selfspec.decoding.results import Emitted, TokenLogprob
from selfspec.decoding.strategies import REGISTRY, Strategy, cost_meter, make_strategy
from selfspec.decoding.text_rules import text_rules
from selfspec.errors import SelfspecError
from selfspec.models.devices import output_device
from selfspec.models.draft_vocabulary import DraftVocabulary, make_draft_vocabulary
from selfspec.models.loading import load_model, model_end_ids
from selfspec.models.layouts import num_layers
from selfspec.models.skip_config import resolve_skip
from selfspec.settings import (DraftSettings, KangarooSettings, SamplingSettings, SkipSet, SkipSettings,
                               default_settings, named)
from selfspec.settings.typed import CONF

# The config's defaults, as `python run.py` runs with no overrides (default_settings): the sampling settings (greedy,
# 128 new tokens) of callers that give none, and the draft options (the adaptive draft exit) as a model without draft
# defaults of its own gets them (model=hf: the API takes any model, so no embedded model's head or draft vocabulary).
DEFAULT_DRAFT = default_settings("model=hf").draft
DEFAULT_SAMPLING = default_settings().sampling
DEFAULT_CONSTRAINTS = default_settings().constraints
MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs
STRATEGIES = tuple(name for name, spec in REGISTRY.items() if not spec.hf_baseline)  # ours: the ones that stream

Prompt = str | list[dict] | list[int]  # raw text | chat messages ({"role", "content"}) | token ids
SkipSpec = SkipSet | SkipSettings | dict | str | Path | None  # {"attn": [...], "mlp": [...]} or a best_skip.yaml


@dataclass(frozen=True)
class Request:
    """What a caller may ask of a generation: `generate`, `stream` and `job` take these fields as keywords."""
    max_new_tokens: int = DEFAULT_SAMPLING.max_new_tokens
    temperature: float = DEFAULT_SAMPLING.temperature  # 0: greedy
    top_p: float = DEFAULT_SAMPLING.top_p
    top_k: int = DEFAULT_SAMPLING.top_k
    repetition_penalty: float = DEFAULT_SAMPLING.repetition_penalty
    seed: int | None = None  # None: torch's global generator; a batch's row i samples from seed + i
    stop: Sequence[str] = ()  # the output ends before the first of these
    banned_words: Sequence[str] = ()  # words the output may not contain (decoding rolls back where one completes)
    case_sensitive: bool = DEFAULT_CONSTRAINTS.case_sensitive
    logprobs: int | None = None  # each token's log-probability and this many alternatives (at most 20)

    @classmethod
    def of(cls, fields: dict) -> "Request":
        allowed = [f.name for f in dataclasses.fields(cls)]
        unknown = [name for name in fields if name not in allowed]
        if unknown:
            raise SelfspecError(f"{unknown[0]} is not an option of generate; allowed: {', '.join(allowed)}")
        return cls(**fields)


@dataclass
class Completion:
    text: str  # before the first stop string, special tokens left out
    token_ids: list[int]  # every new token, EOS included
    sources: list[str]  # per token of token_ids: "model" | "ngram" | "store" | "verified" (streaming.py)
    prompt_tokens: int
    finish_reason: str  # "stop" (EOS or a stop string) | "length"
    stats: DecodingStats
    logprobs: list[TokenLogprob] | None = None  # per token of token_ids, when asked for (`logprobs=N`)


@dataclass
class Job:
    """One generation, set up: its prompt's token ids and its strategy, whose options carry the request's sampling,
    text rules and log-probabilities; `generator` samples (None: torch's global one)."""
    ids: list[int]
    strategy: Strategy
    generator: torch.Generator | None

    @property
    def options(self) -> GenerationOptions:
        return dataclasses.replace(self.strategy.options, generator=self.generator)

    def steps(self) -> Iterator[Emitted]:
        """Decode alone (batch size 1): what the prefill emitted, then what each verification emitted."""
        return self.strategy.steps(self.ids, self.generator)


class SelfSpeculativeDecoder:
    """One model; one prompt, or a list decoded as a batch. `strategy` is any of STRATEGIES (`plain` decodes
    without drafts); `skip` is the layer-skip draft's skip set (default: none skipped); `draft` the draft options
    (default DEFAULT_DRAFT, the adaptive draft exit); `draft_model` drafts for `two_model`, `kangaroo` names the
    adapter of `kangaroo`, `searched` the skip set of `self_spec_searched`."""

    def __init__(self, model, tokenizer, skip: SkipSpec = None, draft: DraftSettings | None = None,
                 strategy: str = "self_spec", draft_model=None, kangaroo: KangarooSettings | None = None,
                 searched: SkipSpec = None):
        if strategy not in STRATEGIES:
            raise SelfspecError(f"strategy={strategy!r} is not allowed; allowed: {', '.join(STRATEGIES)}")
        draft = draft or DEFAULT_DRAFT
        layers = num_layers(model)
        skip_set, file_vocab = _skip_set(skip, layers, "skip")

        def vocabulary(size: int) -> DraftVocabulary:
            return make_draft_vocabulary(model, tokenizer, size, calibration_texts())

        vocab = draft.vocab_size or file_vocab
        searched_draft = None
        if searched is not None:
            searched_skip, searched_vocab = _skip_set(searched, layers, "searched")
            searched_draft = (searched_skip, vocabulary(searched_vocab) if searched_vocab else None)
        self.model, self.tokenizer, self.name = model, tokenizer, strategy
        self.end_ids = model_end_ids(model, tokenizer)
        self._make = partial(make_strategy, strategy, model, skip=skip_set, draft=draft, draft_model=draft_model,
                             draft_vocabulary=vocabulary(vocab) if vocab else None, kangaroo=kangaroo,
                             searched=searched_draft, costs=cost_meter(model, draft))  # greedy and sampled share costs
        self._options = GenerationOptions(DEFAULT_SAMPLING, self.end_ids)
        self._strategies: dict[bool, Strategy] = {}
        self.strategy(DEFAULT_SAMPLING)  # a bad combination fails here, not at the first request

    @classmethod
    def from_pretrained(cls, model: str, strategy: str = "self_spec_tree") -> "SelfSpeculativeDecoder":
        """`model` loaded as run.py loads it, with its config's skip set and drafts: an option of conf/model/
        (smollm2, gemma3_270m: their shipped skip set, feature head and token store), else a local folder or a hub
        id (`model=hf model.path=<model>`)."""
        embedded = (CONF / "model" / f"{model}.yaml").is_file()
        settings = default_settings(*([f"model={model}"] if embedded else ["model=hf", f"model.path={model}"]))
        loaded = load_model(settings.model)
        return cls(loaded.model, loaded.tokenizer, settings.skip, settings.draft, strategy)

    def strategy(self, sampling: SamplingSettings) -> Strategy:
        """The Strategy decoding with `sampling`; one per mode (greedy or sampled), so a draft-exit policy keeps
        adapting across calls as across a benchmark's prompts."""
        if sampling.greedy not in self._strategies:
            self._strategies[sampling.greedy] = self._make(dataclasses.replace(self._options, sampling=sampling))
        strategy = self._strategies[sampling.greedy]
        return dataclasses.replace(strategy, options=dataclasses.replace(strategy.options, sampling=sampling))

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids: raw text as is; chat messages through the tokenizer's chat template (as run.py's chat
        prompts), or their contents joined by newlines if it has none; token ids unchanged."""
        if isinstance(prompt, str):
            ids = as_token_ids(self.tokenizer(prompt))
        elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            ids = self._chat_ids(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        else:
            raise SelfspecError(f"prompt={repr(prompt)[:60]} is not allowed; give text, chat messages "
                                f"[{{'role': ..., 'content': ...}}] or token ids")
        if not ids:
            raise SelfspecError("prompt encodes to no tokens; give some text")
        return ids

    def stream(self, prompt: Prompt | list[Prompt], **request) -> Iterator[Chunk] | Iterator[tuple[int, Chunk]]:
        """One Chunk per verification step (its accepted tokens, their text and sources, the stats so far), then a
        last one with the finish reason; `request`: the fields of `Request`. Stopping the iteration stops the
        generation at the next step. A list of prompts (texts, chat conversations or token-id lists, one kind)
        decodes as one batch (decoding/batch.py): (prompt index, Chunk) pairs as the rows' steps come."""
        if not is_batch(prompt):
            job = self.job(prompt, **request)
            return self.chunks(job.steps(), job)
        seed = request.pop("seed", None)
        jobs = [self.job(p, seed=None if seed is None else seed + i, **request)
                for i, p in enumerate(check_batch(prompt))]
        steps = jobs[0].strategy.batch_steps([job.ids for job in jobs], [job.generator for job in jobs])
        return interleaved([self.chunks(row, job) for row, job in zip(row_steps(steps, len(jobs)), jobs)])

    def job(self, prompt: Prompt, **request) -> Job:
        """What `stream` decodes, set up and checked but not started (a server's batch runs it: serve/batcher.py)."""
        asked = Request.of(request)
        ids = self.encode(prompt)
        if asked.logprobs is not None and not 0 <= asked.logprobs <= MAX_TOP_LOGPROBS:
            raise SelfspecError(f"logprobs={asked.logprobs} is not allowed; allowed: 0..{MAX_TOP_LOGPROBS}")
        sampling = SamplingSettings(asked.temperature, asked.top_k, asked.top_p, asked.repetition_penalty,
                                    asked.max_new_tokens, tuple(asked.stop))
        rules = text_rules(self.model, self.tokenizer, asked.banned_words, asked.case_sensitive, sampling.stop)
        strategy = self.strategy(sampling)
        options = dataclasses.replace(strategy.options, rules=rules, top_logprobs=asked.logprobs)
        seed = asked.seed
        generator = torch.Generator(output_device(self.model)).manual_seed(seed) if seed is not None else None
        return Job(ids, dataclasses.replace(strategy, options=options), generator)

    def chunks(self, steps: Iterator[Emitted], job: Job) -> Iterator[Chunk]:
        """`job`'s Chunks over `steps`, what its generation emits (its own `steps()`, or its row of a batch)."""
        return stream_chunks(steps, self.tokenizer, self.end_ids, job.strategy.options.rules)

    def generate(self, prompt: Prompt | list[Prompt], **request) -> Completion | list[Completion]:
        """The whole reply (`request`: the fields of `Request`): greedy by default, lossless for every strategy; for
        a list of prompts, one Completion per prompt, decoded together."""
        with_logprobs = request.get("logprobs") is not None
        if not is_batch(prompt):
            ids = self.encode(prompt)
            return completion(self.stream(ids, **request), len(ids), with_logprobs)
        ids = [self.encode(p) for p in check_batch(prompt)]
        chunks = [[] for _ in ids]
        for row, chunk in self.stream(ids, **request):
            chunks[row].append(chunk)
        return [completion(iter(row), len(row_ids), with_logprobs) for row, row_ids in zip(chunks, ids)]

    def _chat_ids(self, messages: list[dict]) -> list[int]:
        for index, message in enumerate(messages):
            if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
                raise SelfspecError(f"messages[{index}]={repr(message)[:60]} is not allowed; each message needs "
                                    f"a 'role' and a text 'content'")
        if getattr(self.tokenizer, "chat_template", None):
            return as_token_ids(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                                   tokenize=True))
        return as_token_ids(self.tokenizer("\n".join(m["content"] for m in messages)))


def is_batch(prompt) -> bool:
    """A list of prompts (texts, or lists: chat conversations or token-id lists) rather than one prompt."""
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(p, (str, list)) for p in prompt)


def check_batch(prompts: list) -> list:
    """`prompts`, if all of one kind: a batch takes texts, chat conversations or token-id lists, not a mix."""
    def kind(prompt) -> str:
        if isinstance(prompt, str):
            return "text"
        return "chat messages" if prompt and all(isinstance(m, dict) for m in prompt) else "token ids"

    kinds = list(dict.fromkeys(map(kind, prompts)))
    if len(kinds) > 1:
        raise SelfspecError(f"the batch mixes {' and '.join(kinds)}; a batch takes prompts of one kind")
    return prompts


def completion(chunks: Iterator[Chunk], prompt_tokens: int, with_logprobs: bool) -> Completion:
    """A whole reply from its chunks."""
    tokens = []
    for chunk in chunks:
        chunk.onto(tokens)
    return Completion("".join(t.text for t in tokens), [t.id for t in tokens], [t.source for t in tokens],
                      prompt_tokens, chunk.finish_reason, chunk.stats,
                      [t.logprob for t in tokens] if with_logprobs else None)


def _skip_set(skip: SkipSpec, layers: int, name: str) -> tuple[SkipSet, int | None]:
    """(skip set, the draft vocabulary a best_skip.yaml was searched with, or None)."""
    if skip is None:
        return SkipSet(), None
    if isinstance(skip, SkipSet):
        skip = SkipSettings(attn=list(skip.attn), mlp=list(skip.mlp))
    elif isinstance(skip, dict):
        unknown = set(skip) - {"attn", "mlp"}
        if unknown:
            raise SelfspecError(f"{name}: keys {sorted(unknown)} are not allowed; allowed: attn, mlp")
        skip = SkipSettings(attn=list(skip.get("attn", [])), mlp=list(skip.get("mlp", [])))
    elif isinstance(skip, (str, Path)):
        skip = SkipSettings(path=str(skip))
    with named(name):
        return resolve_skip(skip, layers)
