"""The `selfspec` console command (pyproject [project.scripts]) and run.py: compose the Hydra config, build the typed
settings, run the task. The configs ship inside the package (selfspec/conf, a link to the checkout's conf/ that
a wheel copies), so the command finds them from any directory."""

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from selfspec.errors import SelfspecError

CONF = Path(__file__).resolve().parent / "conf"


@hydra.main(version_base="1.3", config_path=str(CONF), config_name="config")
def main(cfg) -> None:
    # imported after Hydra parsed the command line: `--help` stays fast
    from selfspec.app import run
    from selfspec.kangaroo_train import train
    from selfspec.serve import serve
    from selfspec.settings import from_config, launch_settings

    tasks = {"evaluate": run, "kangaroo_train": train, "serve": serve}
    try:
        settings = from_config(cfg)
        settings.launch = launch_settings(HydraConfig.get())
        print(OmegaConf.to_yaml(cfg, resolve=True))
        tasks[settings.task](settings, Path(HydraConfig.get().runtime.output_dir))
    except SelfspecError as error:
        print(f"selfspec: error: {str(error).splitlines()[0]}", file=sys.stderr)
        sys.exit(2)
