"""Hugging Face `generate` baselines behind our Strategy interface.

Names (summary.json keys): `hf_generate` (plain `model.generate`), `hf_generate_stock` (the same on the stock model:
`nn.Linear` where `model.packed_linears` packed the decoder's linears, what a user without selfspec runs),
`hf_prompt_lookup` (n-gram drafts copied from the prompt), `hf_early_exit` (the model's first layers draft, HF
`assistant_early_exit`), `hf_assistant` (a separate draft model); all but hf_generate_stock run on the packed model.
Assisted decoding reads its draft length and confidence threshold from the *assistant's* `generation_config`, not
from generate() arguments, so they are written there for one call and restored afterwards.
Per-step records come from timing the candidate generator HF builds for the call (assisted modes) or the streamer
(hf_generate); in assisted modes the prefill is the first step's verify forward, so `prefill_s` is 0 there.
"""

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from functools import partial

import torch
from transformers.generation.streamers import BaseStreamer

from selfspec.decoding.prompt_ids import single_prompt
from selfspec.decoding.registry import StrategyInputs, StrategySpec
from selfspec.decoding.results import GenerationResult, StepRecord
from selfspec.decoding.options import GenerationOptions
from selfspec.errors import SelfspecError
from selfspec.models.devices import input_device
from selfspec.models.packed_linear import unpacked_copy
from selfspec.models.layouts import num_layers, require_hf_assisted
from selfspec.settings import default_settings
from selfspec.timing import clock

HF_STRATEGIES = ("hf_generate", "hf_generate_stock", "hf_prompt_lookup", "hf_early_exit", "hf_assistant")
PROMPT_LOOKUP_TOKENS = 10


@dataclass
class HFStrategy:
    """`model.generate` with our settings; assisted if prompt_lookup_tokens, early_exit_layer or draft_model is set."""
    name: str
    model: object
    options: GenerationOptions  # sampling and end ids; HF's generate has no banned words or log-probabilities
    num_assistant_tokens: int  # most draft tokens per step (early exit, draft model)
    confidence_threshold: float  # stop drafting below this draft probability; 0 = fixed length
    prompt_lookup_tokens: int | None = None
    early_exit_layer: int | None = None  # draft with layers [0, early_exit_layer), then the final norm and head
    draft_model: object | None = None

    def generate(self, prompt: list[int], generator: torch.Generator | None = None) -> GenerationResult:
        """Batch size 1; sampling draws from the global RNG, seeded from `generator.initial_seed()` inside a fork."""
        prompt = single_prompt(prompt)
        assistant = self.model if self.early_exit_layer is not None else self.draft_model
        assisted = assistant is not None or self.prompt_lookup_tokens is not None
        steps: list[StepRecord] = []
        device = input_device(self.model)
        streamer = None if assisted else _TokenTimes(device)
        start = clock(device)
        with ExitStack() as hooks:
            hooks.enter_context(_seeded(generator, device))
            if assistant is not None:
                hooks.enter_context(_assistant_settings(assistant, self.num_assistant_tokens,
                                                        self.confidence_threshold))
            if assisted:
                threshold = self.confidence_threshold if assistant is not None else 0.0
                hooks.enter_context(_recording_steps(self.model, steps, threshold))
            ids = torch.tensor([prompt], device=device)
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), streamer=streamer,
                                      **self._generate_kwargs())
            new_tokens = out[0, len(prompt):].tolist()
        elapsed_s = clock(device) - start
        prefill_s = 0.0
        if streamer is not None:  # times[0]: the prompt, [1]: the prefill's token, then one per forward
            prefill_s = streamer.times[1] - start
            steps = [StepRecord(drafted=0, accepted=0, emitted=1, threshold=0.0, draft_s=0.0, verify_s=b - a)
                     for a, b in zip(streamer.times[1:], streamer.times[2:])]
        finish = "stop" if new_tokens and new_tokens[-1] in self.options.end_ids else "length"
        return GenerationResult(new_tokens=new_tokens, elapsed_s=elapsed_s, prefill_s=prefill_s, steps=steps,
                                finish_reason=finish)

    def _generate_kwargs(self) -> dict:
        s, end_ids = self.options.sampling, self.options.end_ids
        pad = self.model.generation_config.pad_token_id
        kwargs = dict(max_new_tokens=s.max_new_tokens, eos_token_id=list(end_ids) or None,
                      pad_token_id=pad if pad is not None else (end_ids or (0,))[0],
                      do_sample=not s.greedy, repetition_penalty=s.repetition_penalty)
        if not s.greedy:
            kwargs.update(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)
        if self.prompt_lookup_tokens is not None:
            kwargs["prompt_lookup_num_tokens"] = self.prompt_lookup_tokens
        if self.early_exit_layer is not None:
            kwargs["assistant_early_exit"] = self.early_exit_layer
        elif self.draft_model is not None:
            kwargs["assistant_model"] = self.draft_model
        return kwargs


def make_hf_strategy(name: str, model, options: GenerationOptions, draft_model=None,
                     early_exit_layer: int | None = None, num_assistant_tokens: int | None = None,
                     confidence_threshold: float | None = None) -> HFStrategy:
    """One of HF_STRATEGIES; early_exit_layer None means 3/4 of the model's layers, num_assistant_tokens and
    confidence_threshold None the config's (its `hf` block)."""
    if name not in HF_STRATEGIES:
        raise SelfspecError(f"strategy {name!r} is unknown; allowed HF baselines: {', '.join(HF_STRATEGIES)}")
    if num_assistant_tokens is None or confidence_threshold is None:
        hf = default_settings().hf
        num_assistant_tokens = hf.num_assistant_tokens if num_assistant_tokens is None else num_assistant_tokens
        confidence_threshold = hf.confidence_threshold if confidence_threshold is None else confidence_threshold
    if num_assistant_tokens < 1:
        raise SelfspecError(f"num_assistant_tokens={num_assistant_tokens} must be >= 1")
    if not 0 <= confidence_threshold < 1:
        raise SelfspecError(f"confidence_threshold={confidence_threshold} is outside [0, 1); 0 drafts a fixed length")
    common = dict(num_assistant_tokens=num_assistant_tokens, confidence_threshold=confidence_threshold)
    if name == "hf_generate":
        return HFStrategy(name, model, options, **common)
    if name == "hf_generate_stock":  # a copy with dense linears, made once per strategy; `model` stays packed
        return HFStrategy(name, unpacked_copy(model), options, **common)
    if name == "hf_prompt_lookup":
        return HFStrategy(name, model, options, prompt_lookup_tokens=PROMPT_LOOKUP_TOKENS, **common)
    if name in ("hf_early_exit", "hf_assistant"):
        require_hf_assisted(model, name)
    if name == "hf_early_exit":
        layers = num_layers(model)
        layer = early_exit_layer if early_exit_layer is not None else max(1, 3 * layers // 4)
        if not 1 <= layer <= layers:
            raise SelfspecError(f"early_exit_layer={layer} is outside 1..{layers} (the model's layers)")
        return HFStrategy(name, model, options, early_exit_layer=layer, **common)
    if draft_model is None:
        raise SelfspecError("strategy hf_assistant needs a draft model: set draft_model=<option>, "
                            "e.g. draft_model=smollm2")
    return HFStrategy(name, model, options, draft_model=draft_model, **common)


def build_hf_strategy(name: str, inputs: StrategyInputs) -> HFStrategy:
    return make_hf_strategy(name, inputs.model, inputs.options, inputs.draft_model,
                            **(vars(inputs.hf) if inputs.hf else {}))


STRATEGIES = tuple(StrategySpec(name, description, partial(build_hf_strategy, name), hf_baseline=True)
                   for name, description in zip(HF_STRATEGIES, (
                       "HF model.generate without drafts",
                       "HF model.generate without drafts on the stock model (nn.Linear, not packed): a user's baseline",
                       f"HF generate with prompt lookup ({PROMPT_LOOKUP_TOKENS} tokens)",
                       "HF generate drafting with the model's first layers (assistant_early_exit, hf.early_exit_layer)",
                       "HF generate with a separate draft model (assistant_model, draft_model)")))


class _TokenTimes(BaseStreamer):
    """Records when HF hands over tokens: first the prompt, then each forward's new token(s)."""

    def __init__(self, device: torch.device):
        self.device, self.times = device, []

    def put(self, value):
        self.times.append(clock(self.device))

    def end(self):
        pass


@contextmanager
def _recording_steps(model, steps: list[StepRecord], threshold: float):
    """Append a StepRecord per assisted step by timing the candidate generator HF builds for this call:
    drafted = candidates returned, accepted = HF's n_matches (after its EOS/length cut), emitted = accepted + 1."""
    build = model._get_candidate_generator  # bound method; the instance attribute below shadows it for one call

    def build_and_record(*args, **kwargs):
        candidates = build(*args, **kwargs)
        get_candidates, update = candidates.get_candidates, candidates.update_candidate_strategy
        last = {}

        def timed_get_candidates(input_ids, **kw):
            t0 = clock(input_ids.device)
            candidate_ids, candidate_logits = get_candidates(input_ids, **kw)
            t1 = clock(input_ids.device)
            last.update(drafted=candidate_ids.shape[1] - input_ids.shape[1], draft_s=t1 - t0, t1=t1)
            return candidate_ids, candidate_logits

        def recorded_update(input_ids, scores, num_matches):
            accepted = int(num_matches)
            steps.append(StepRecord(drafted=last["drafted"], accepted=accepted, emitted=accepted + 1,
                                    threshold=threshold, draft_s=last["draft_s"],
                                    verify_s=clock(input_ids.device) - last["t1"]))
            return update(input_ids, scores, num_matches)

        candidates.get_candidates, candidates.update_candidate_strategy = timed_get_candidates, recorded_update
        return candidates

    model._get_candidate_generator = build_and_record
    try:
        yield
    finally:
        del model._get_candidate_generator


@contextmanager
def _assistant_settings(assistant, num_tokens: int, threshold: float):
    """Draft length (constant schedule) and confidence threshold on the assistant's generation_config,
    restored afterwards."""
    config = assistant.generation_config
    keys = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
    saved = {key: getattr(config, key, None) for key in keys}
    config.num_assistant_tokens, config.num_assistant_tokens_schedule = num_tokens, "constant"
    config.assistant_confidence_threshold = threshold
    try:
        yield
    finally:
        for key, value in saved.items():
            setattr(config, key, value)


@contextmanager
def _seeded(generator: torch.Generator | None, device: torch.device):
    """HF samples from the global RNG: seed it from `generator` inside a fork, so the caller's RNG is untouched."""
    if generator is None:
        yield
        return
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(generator.initial_seed())
        yield
