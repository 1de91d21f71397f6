"""selfspec entry point: `python run.py [group=option ...]` (see conf/config.yaml and the README)."""

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf.errors import MissingMandatoryValue

from selfspec.errors import SelfspecError


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg) -> None:
    from selfspec.app import run  # after Hydra parsed the command line: `--help` stays fast
    from selfspec.kangaroo_train import train_from_config

    tasks = {"evaluate": run, "kangaroo_train": train_from_config}
    try:
        if cfg.task not in tasks:
            raise SelfspecError(f"task={cfg.task!r} is unknown; allowed: {', '.join(tasks)}")
        tasks[cfg.task](cfg, Path(HydraConfig.get().runtime.output_dir))
    except (SelfspecError, MissingMandatoryValue) as error:
        print(f"selfspec: error: {str(error).splitlines()[0]}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
