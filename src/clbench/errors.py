"""User-facing errors: the CLI prints their message as one paragraph and exits non-zero, without a traceback."""


class ClbenchError(Exception):
    """A problem the user can fix (bad config value, missing data or weights)."""


class ConfigError(ClbenchError):
    """An invalid or unknown configuration value."""


class DataError(ClbenchError):
    """A dataset that is missing, corrupt or cannot be downloaded."""


class WeightsError(ClbenchError):
    """Pretrained weights that are missing, unreachable or do not fit the model."""


class GraphCaptureError(ClbenchError):
    """The training step could not be captured as a CUDA graph; the message names the setting that avoids it."""


class Diverged(ClbenchError, FloatingPointError):  # noqa: N818 (reads as what happened to the run)
    """The training loss became NaN or Inf; the message names task, phase, epoch and step."""


class Interrupted(ClbenchError):  # noqa: N818 (reads as what happened to the run)
    """SIGINT or SIGTERM outside the training loop (which checkpoints and stops cleanly on its own)."""


class Preempted(Exception):  # noqa: N818 (not an error: the run stopped on request and can resume)
    """A stop signal arrived (``signum``); a checkpoint of the last finished step was written."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum
