"""Write the seeded random skip sets of the skip_ratio experiment for one model to
conf/experiment/random_skip_sets/NAME.yaml: `python experiments/random_skip_sets.py NAME NUM_LAYERS [--seed 0]`.
A new model's file also goes into the list of files in conf/experiment/skip_ratio.yaml's defaults.

Set `p<percent><draw>` skips round(percent% of the 2 x NUM_LAYERS sublayers), drawn uniformly from all
attention and MLP sublayers; draws `a`, `b` differ by seed.
"""

import argparse
import random
from pathlib import Path

import yaml

PERCENTS = (10, 20, 30, 40, 50)
DRAWS = "ab"
CONF = Path(__file__).resolve().parents[1] / "conf"
SETS_DIR = CONF / "experiment" / "random_skip_sets"


def random_skip_sets(num_layers: int, seed: int = 0) -> dict:
    """{name: {"attn": [...], "mlp": [...]}} for every percent and draw; never skips nothing or everything."""
    sublayers = [(kind, i) for kind in ("attn", "mlp") for i in range(num_layers)]
    sets = {}
    for percent in PERCENTS:
        size = min(max(1, round(percent / 100 * len(sublayers))), len(sublayers) - 1)
        for index, draw in enumerate(DRAWS):
            chosen = random.Random(f"{seed}-{num_layers}-{percent}-{index}").sample(sublayers, size)
            sets[f"p{percent}{draw}"] = {kind: sorted(i for k, i in chosen if k == kind) for kind in ("attn", "mlp")}
    return sets


def has_searched_skip(name: str) -> bool:
    """Whether conf/model/<name>.yaml ships a searched skip set (model.searched_skip): written there, or a skip group's
    file that its defaults list places there (/skip@searched_skip)."""
    path = CONF / "model" / f"{name}.yaml"
    written = (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}
    placed = any(isinstance(entry, dict) and "/skip@searched_skip" in entry for entry in written.get("defaults", []))
    return placed or bool(written.get("searched_skip"))


def skip_sets_yaml(name: str, num_layers: int, seed: int = 0) -> str:
    """The text of conf/experiment/random_skip_sets/<name>.yaml: the sets under the model's name, as
    conf/experiment/skip_ratio.yaml merges every model's file into `random_skip_sets`; `searched` (the model's
    model.searched_skip) only where the model ships one."""
    command = f"python experiments/random_skip_sets.py {name} {num_layers}" + (f" --seed {seed}" if seed else "")
    lines = [f"# Random skip sets of experiment=skip_ratio for model={name} ({num_layers} layers), written by",
             f"# `{command}`.",
             f"{name}:",
             f"  layers: {num_layers}"]
    if has_searched_skip(name):
        lines.append("  searched: ${oc.select:model.searched_skip,null}  # skip_set=searched: model.searched_skip")
    lines += [f"  {set_name}: {{attn: {skip['attn']}, mlp: {skip['mlp']}}}"
              for set_name, skip in random_skip_sets(num_layers, seed).items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", help="the model option (conf/model/<name>.yaml)")
    parser.add_argument("num_layers", type=int)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    path = SETS_DIR / f"{args.name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(skip_sets_yaml(args.name, args.num_layers, args.seed))
    print(path)


if __name__ == "__main__":
    main()
