"""``python -m calibrate task=… backbone=… adapter=…``: the Hydra entry point.

User mistakes end in one line on stderr and exit code 2: a config Hydra cannot compose (an
unknown group option or key, a value of the wrong type), a run directory Hydra cannot create,
and the pipeline's own :data:`calibrate.errors.UserError`. Bugs still raise with their traceback.

Hydra itself only creates the run directory (conf/config.yaml turns off its ``.hydra/`` record
and its log file); the run writes both once it holds the directory's lock
(:func:`record_job`), so a second run on the same directory, or one that cannot use it,
changes nothing there.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from calibrate.config import register
from calibrate.rundir_access import RunDirError, make_run_dir
from serve_bridge.command_line import fail
from serve_bridge.safe_write import own_file, write_atomic

register()
_composed = False  # set once Hydra composed a config: later errors are not config errors


@hydra.main(version_base=None, config_path="pkg://conf", config_name="config")
def main(cfg: DictConfig) -> None:
    global _composed
    _composed = True
    from calibrate.context import Context
    from calibrate.errors import UserError
    from calibrate.pipeline import format_final, run_pipeline
    from calibrate.rundir import RunDir

    run = RunDir(HydraConfig.get().runtime.output_dir)
    print(f"run directory: {run.root}", flush=True)
    try:
        summaries = run_pipeline(Context(cfg, run), on_locked=lambda: record_job(cfg, run.root))
    except UserError as e:
        fail(str(e))
    table = format_final(summaries)
    if table:
        print("\n" + table, flush=True)


LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"  # Hydra's default job log format


def record_job(cfg: DictConfig, root: Path) -> None:
    """What Hydra would have written into the run directory: ``.hydra/{config,hydra,overrides}.yaml``
    and the job's log file ``<job name>.log``, which receives the root logger's records."""
    hydra_cfg = HydraConfig.instance().cfg
    for name, node in (("config", cfg), ("hydra", hydra_cfg), ("overrides", hydra_cfg.hydra.overrides.task)):
        write_atomic(root / ".hydra" / f"{name}.yaml", OmegaConf.to_yaml(node))
    log = root / f"{HydraConfig.get().job.name}.log"
    own_file(log)  # a copy made with `cp -al` shares it with the original: appending must not reach that
    handler = logging.FileHandler(log)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    logging.getLogger().addHandler(handler)


def config_error(err: Exception) -> str:
    """One line for a composition error: Hydra's message and its cause's first line."""
    parts = [str(e).strip().splitlines()[0].rstrip(".") for e in (err, err.__cause__) if e is not None and str(e).strip()]
    text = ": ".join(parts)
    lines = str(err).splitlines()
    if any(line.startswith("Available options") for line in lines):  # an unknown group option
        start = next(i for i, line in enumerate(lines) if line.startswith("Available options"))
        known = []
        for line in lines[start + 1:]:
            if not line.startswith("\t"):
                break
            if not line.strip().startswith("base"):
                known.append(line.strip())
        text += f"; available: {', '.join(known)}"
    if "not in 'AutoOptions'" in text:
        text += " (engine=auto has only `progress`; engine options need engine=hf or engine=vllm)"
    return text


def cli() -> None:
    """Run :func:`main`, with composition errors as one line and exit code 2."""
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")  # let them reach us instead of Hydra's report
    try:
        main()
    except (HydraException, OmegaConfBaseException) as err:
        if _composed:
            raise
        fail(config_error(err))
    except OSError as err:  # Hydra could not create the run directory
        if _composed or not err.filename:
            raise
        try:
            make_run_dir(Path(os.fsdecode(err.filename)))
        except RunDirError as why:
            fail(str(why))
        raise


if __name__ == "__main__":
    cli()
