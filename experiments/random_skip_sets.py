"""Print the seeded random skip sets of conf/experiment/skip_ratio.yaml for one model (YAML, paste under
`random_skip_sets`): `python experiments/random_skip_sets.py NAME NUM_LAYERS [--seed 0]`.

Set `p<percent><draw>` skips round(percent% of the 2 x NUM_LAYERS sublayers), drawn uniformly from all
attention and MLP sublayers; draws `a`, `b` differ by seed.
"""

import argparse
import random

PERCENTS = (10, 20, 30, 40, 50)
DRAWS = "ab"


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name")
    parser.add_argument("num_layers", type=int)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"  {args.name}:\n    layers: {args.num_layers}")
    for name, skip in random_skip_sets(args.num_layers, args.seed).items():
        print(f"    {name}: {{attn: {skip['attn']}, mlp: {skip['mlp']}}}")


if __name__ == "__main__":
    main()
