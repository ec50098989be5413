"""``python -m calibrate task=… backbone=… adapter=…``: the Hydra entry point."""
from __future__ import annotations

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from calibrate.resolvers import register

register()


@hydra.main(version_base=None, config_path="pkg://conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from calibrate.context import Context
    from calibrate.errors import UserError
    from calibrate.pipeline import format_final, run_pipeline
    from calibrate.rundir import RunDir

    run = RunDir(HydraConfig.get().runtime.output_dir)
    print(f"run directory: {run.root}", flush=True)
    try:
        summaries = run_pipeline(Context(cfg, run))
    except UserError as e:
        print("error: " + " ".join(str(e).split("\n")), file=sys.stderr, flush=True)  # one line
        sys.exit(2)
    table = format_final(summaries)
    if table:
        print("\n" + table, flush=True)


if __name__ == "__main__":
    main()
