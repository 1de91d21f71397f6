"""Ship a trained draft part with the package: `selfspec/models/heads/<name>.pt` (float16) and `<name>.json` (kind,
model signature, sha256, and the command, data settings and commit that made it), so `draft.head=shipped` (a
model's default where its config says `feature_head: shipped`) finds it by the loaded model's signature.

    python experiments/ship_head.py outputs/train_draft/smollm2-feature/head.pt smollm2-feature
    python experiments/ship_head.py outputs/train_draft/smollm2-feature/store.pt smollm2-store  # draft.store=shipped
"""

import argparse
from pathlib import Path

from selfspec.models.trained_parts import SHIPPED_DIR, ship_part

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", type=Path, help="head.pt (or adapter.pt, store.pt) of an experiment=train_draft run")
    parser.add_argument("name", help="file stem under selfspec/models/heads/, e.g. smollm2-feature")
    args = parser.parse_args()
    SHIPPED_DIR.mkdir(exist_ok=True)
    print(f"shipped: {ship_part(args.part, args.name)}")
