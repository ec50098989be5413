"""User-facing errors: printed as one line by ``python -m calibrate`` (exit code 2)."""
from calibrate.rundir_access import RunDirError
from labeling.adapters import AdapterError
from labeling.backbone import BackboneError
from labeling.tasks import TaskError
from serve_bridge.bundle import BundleError


class ConfigError(ValueError):
    """A config value the pipeline cannot use (unknown stage, unavailable engine...)."""


UserError = (AdapterError, BackboneError, TaskError, BundleError, ConfigError, RunDirError)
