"""`python -m selfspec.gpu_check [--device cuda] [--quick] [--out outputs/gpu_check]` (make gpu-check): what a CUDA
machine with no network and no weights can tell us, in under 8 minutes on one H200.

1. Losslessness: every registered strategy decodes the tiny random Llama and Gemma-2 in float32 on the device, with
   every part a strategy may need built on the spot (an untrained feature head and Kangaroo adapter, a token store of
   the model's own outputs, a second tiny model, a searched skip set with a reduced draft vocabulary), and its greedy
   tokens must equal plain decoding's.
2. Costs, per model shape (SmolLM2-135M, Llama-2-7B, Llama-2-13B) with random weights in bfloat16, built on the device
   from the config (timing only): c(q)/c(1), a verification of q tokens against a one-token step, and d/c(1), a
   draft token with a share of the sublayers skipped at Draft & Verify's ratios for Llama-2-13B (0.45 and 0.5 of its
   attention and MLP sublayers), both measured by the cost meter (decoding/costs.py) after a 200-token context.

`--quick` checks the tiny Llama alone over fewer tokens, cuts every shape to 2 layers and the 7B and 13B widths to 1/8
(head size kept), and times fewer repeats, so a CPU runs it in seconds. Writes gpu_check.json and gpu_check.md under --out and prints the tables.
"""

import argparse
import json
import sys
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from selfspec.decoding.costs import DraftCosts, measure_draft_ms, measure_verify_ms
from selfspec.decoding.options import GenerationOptions
from selfspec.decoding.speculative import generate
from selfspec.decoding.strategies import REGISTRY, make_strategy
from selfspec.errors import SelfspecError, print_warnings_as_lines
from selfspec.models.draft_vocabulary import make_draft_vocabulary
from selfspec.models.feature_head import new_feature_head, save_feature_head
from selfspec.models.kangaroo_adapter import new_adapter, save_adapter
from selfspec.models.tiny import byte_tokenizer, tiny_model
from selfspec.models.token_store import save_token_store
from selfspec.settings import default_settings, make_skip_set
from selfspec.timing import clock

TEXTS = ["def fib(n):\n    return fib(n - 1) + fib(n - 2)\n\ndef fib", "The cat sat on the mat. The cat sat on",
         "Translate to French: good morning, my friend. Bonjour"]
SKIP_RATIOS = (0.45, 0.5)  # Draft & Verify skips about half of Llama-2-13B's attention and MLP sublayers
MAX_Q = 8  # c(1..8): up to 7 draft tokens and the bonus


@dataclass(frozen=True)
class Shape:
    """A model shape of a real checkpoint, built with random weights (LlamaConfig)."""
    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    quick_width: int = 1  # --quick divides the widths (and heads) by this

    def config(self, quick: bool) -> LlamaConfig:
        w = self.quick_width if quick else 1
        return LlamaConfig(hidden_size=self.hidden // w, intermediate_size=self.intermediate // w,
                           num_hidden_layers=2 if quick else self.layers, num_attention_heads=self.heads // w,
                           num_key_value_heads=self.kv_heads // w, head_dim=self.hidden // self.heads,
                           vocab_size=self.vocab, max_position_embeddings=4096)


SHAPES = (Shape("SmolLM2-135M", 30, 576, 1536, 9, 3, 49152),
          Shape("Llama-2-7B", 32, 4096, 11008, 32, 32, 32000, quick_width=8),
          Shape("Llama-2-13B", 40, 5120, 13824, 40, 40, 32000, quick_width=8))


@dataclass
class LosslessRow:
    strategy: str
    model: str  # the tiny model's family
    prompts: int
    equal: int  # prompts whose greedy tokens equal plain decoding's
    drafted: int  # draft tokens over the prompts (0: the strategy decoded plainly)


@dataclass
class ShapeCosts:
    shape: str
    layers: int
    hidden: int
    verify_ms: list[float]  # c(q), q = 1..MAX_Q
    verify_ratio: list[float]  # c(q) / c(1)
    draft_ratio: dict[str, float]  # skip ratio -> d / c(1)
    seconds: float  # building and timing this shape


class PayingCosts:
    """Fixed costs under which drafting pays (a draft token 1 ms, c(q) = 10 + 0.5 (q - 1) ms): the cost-aware
    policies then draft on a tiny model too, whose measured costs say drafting never pays."""
    rows = 1

    def costs(self, skip, head=None, alone=False) -> DraftCosts:
        return DraftCosts(tuple(10.0 + 0.5 * q for q in range(16)), 0.0 if skip is None else 1.0)

    def costs_of(self, key, measure_draft_ms) -> DraftCosts:
        return self.costs(key)

    def for_batch(self, rows: int) -> "PayingCosts":
        return self


def check_lossless(device: torch.device, family: str, max_new_tokens: int) -> list[LosslessRow]:
    """Every registered strategy against plain greedy decoding on the tiny `family` model in float32."""
    defaults = default_settings()
    greedy = replace(defaults.sampling, max_new_tokens=max_new_tokens)
    model = tiny_model(family, num_layers=6).to(device)
    tokenizer = byte_tokenizer()
    prompts = [tokenizer(text).input_ids for text in TEXTS]
    plain = [generate(model, ids, GenerationOptions(greedy)).new_tokens for ids in prompts]
    rows = []
    with tempfile.TemporaryDirectory() as parts:
        inputs = strategy_inputs(model, tokenizer, plain, Path(parts), defaults, device)
        for spec in REGISTRY.values():
            strategy = make_strategy(spec.name, model, GenerationOptions(greedy), **inputs)
            results = [strategy.generate(ids) for ids in prompts]
            rows.append(LosslessRow(spec.name, family, len(prompts),
                                    sum(r.new_tokens == p for r, p in zip(results, plain)),
                                    sum(r.drafted for r in results)))
    return rows


def strategy_inputs(model, tokenizer, plain: list[list[int]], folder: Path, defaults, device) -> dict:
    """What any strategy may need, made now: untrained head and adapter, a token store of the plain outputs, a second
    tiny model, a searched skip set with a 64-token draft vocabulary, and costs under which drafting pays."""
    head, adapter, store = folder / "head.pt", folder / "adapter.pt", folder / "store.pt"
    save_feature_head(head, new_feature_head(model), model)
    save_adapter(adapter, new_adapter(model, 3), model, 3)
    save_token_store(store, plain, model)
    draft = replace(defaults.draft, policy="adaptive", max_tokens=4, ngram_size=2, ngram_tokens=6, tree_nodes=6,
                    tree_depth=4, head=str(head), store=str(store))
    return dict(skip=make_skip_set([1], [2], 6), draft=draft, hf=replace(defaults.hf, early_exit_layer=3),
                draft_model=tiny_model("llama", num_layers=2, seed=1).to(device),
                kangaroo=replace(defaults.kangaroo, adapter_path=str(adapter)),
                searched=(make_skip_set([2, 4], [3], 6), make_draft_vocabulary(model, tokenizer, 64, TEXTS)),
                costs=PayingCosts())


def spread_skip(ratio: float, layers: int):
    """round(ratio x layers) attention and as many MLP sublayers, spread evenly over the layers after the first."""
    count = max(1, round(ratio * layers))
    chosen = sorted({1 + (i * (layers - 1)) // count for i in range(count)} if layers > 1 else {0})
    return make_skip_set(chosen, chosen, layers)


def measure_shape(shape: Shape, device: torch.device, quick: bool) -> ShapeCosts:
    """c(q)/c(1) and d/c(1) at SKIP_RATIOS of `shape` with random bfloat16 weights on `device`."""
    start = clock(device)
    config = shape.config(quick)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16).eval()
    repeats = 3 if quick else 10
    verify = measure_verify_ms(model, MAX_Q, repeats)
    drafts = {str(r): measure_draft_ms(model, spread_skip(r, config.num_hidden_layers), None, repeats, verify[0])
              / verify[0] for r in SKIP_RATIOS}
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return ShapeCosts(shape.name, config.num_hidden_layers, config.hidden_size, verify,
                      [ms / verify[0] for ms in verify], drafts, clock(device) - start)


def lossless_table(rows: list[LosslessRow]) -> str:
    lines = ["| strategy | model | equal plain | draft tokens |", "|---|---|:---:|:---:|"]
    lines += [f"| {r.strategy} | {r.model} | {r.equal}/{r.prompts} | {r.drafted} |" for r in rows]
    return "\n".join(lines)


def costs_table(rows: list[ShapeCosts]) -> str:
    qs = range(2, MAX_Q + 1)
    columns = ["c(1) ms", *(f"c({q})/c(1)" for q in qs), *(f"d/c(1) at {r}" for r in SKIP_RATIOS)]
    lines = ["| shape (bf16) | " + " | ".join(columns) + " |", "|---" + "|:---:" * len(columns) + "|"]
    for r in rows:
        cells = [f"{r.verify_ms[0]:.2f}", *(f"{x:.2f}" for x in r.verify_ratio[1:]),
                 *(f"{r.draft_ratio[str(x)]:.2f}" for x in SKIP_RATIOS)]
        lines.append(f"| {r.shape} ({r.layers} layers, hidden {r.hidden}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def check_device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SelfspecError(f"--device {name}: CUDA is not available here; run on a CUDA machine, or pass "
                            f"--device cpu --quick")
    return device


def run_check(device: torch.device, quick: bool, out: Path, log=print) -> dict:
    """Both stages, timed; the report as a dict (what gpu_check.json holds), also written as gpu_check.md."""
    stages = {}
    start = clock(device)
    families = ("llama",) if quick else ("llama", "gemma2")
    lossless = [row for family in families for row in check_lossless(device, family, 12 if quick else 32)]
    stages["lossless"] = clock(device) - start
    log(f"lossless: {stages['lossless']:.0f} s\n{lossless_table(lossless)}\n")
    costs = []
    for shape in SHAPES:
        costs.append(measure_shape(shape, device, quick))
        log(f"{shape.name}: {costs[-1].seconds:.0f} s")
    table = costs_table(costs)
    log(f"\n{table}")
    report = {"device": str(device), "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
              else "cpu", "quick": quick, "skip_ratios": list(SKIP_RATIOS), "stage_seconds": stages,
              "lossless": [asdict(r) for r in lossless], "costs": [asdict(c) for c in costs]}
    write(out, report, f"# gpu_check on {report['device_name']}{' (quick)' if quick else ''}\n\n"
                       f"## Every strategy against plain decoding (float32)\n\n{lossless_table(lossless)}\n\n"
                       f"## Step costs (random weights, bfloat16)\n\n{table}\n")
    failed = [f"{r.strategy} on {r.model}" for r in lossless if r.equal < r.prompts]
    if failed:
        raise SelfspecError(f"outputs differ from plain decoding's: {', '.join(failed)} (report: {out})")
    return report


def write(out: Path, report: dict, markdown: str) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
        (out / "gpu_check.md").write_text(markdown)
    except OSError as err:
        raise SelfspecError(f"cannot write the report under {out}: {err.strerror}; pass another --out") from None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m selfspec.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    parser.add_argument("--quick", action="store_true", help="the tiny Llama alone, 2-layer shapes, 7B/13B widths / 8, "
                        "fewer repeats")
    parser.add_argument("--out", type=Path, default=Path("outputs/gpu_check"), help="default: outputs/gpu_check")
    args = parser.parse_args(argv)
    print_warnings_as_lines()
    try:
        start = clock()
        run_check(check_device(args.device), args.quick, args.out)
        print(f"\ngpu_check: {clock() - start:.0f} s; report: {args.out}/gpu_check.md, gpu_check.json")
    except SelfspecError as error:
        print(f"selfspec: error: {str(error).splitlines()[0]}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
