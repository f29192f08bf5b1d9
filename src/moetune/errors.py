"""The one family of errors a user can cause (bad config, data, paths, checkpoints, exports).

The CLI prints a `MoetuneError` as one line and exits non-zero; any other exception is a bug in moetune and
keeps its traceback. Raise a subclass with a message that names the file, line, key or tensor at fault.
"""

from __future__ import annotations


class MoetuneError(Exception):
    """A problem the user can fix; the message is printed as is (no traceback)."""

    exit_code = 1


class ConfigError(MoetuneError):
    """A configuration problem (unknown key, bad value, missing path named by the config)."""

    exit_code = 2


class DataError(MoetuneError):
    """A problem with the training data; the message starts with ``path:line: `` when one line is at fault."""


class CheckpointError(MoetuneError):
    """A checkpoint (HF weights, adapter or training checkpoint) that cannot be read or does not fit."""


class CheckpointWriteError(CheckpointError):
    """A save failed (disk full, permission denied...): the run stops, the previous checkpoint is untouched."""


class NumericalFault(MoetuneError):
    """checkpoint.max_bad_steps consecutive steps had a non-finite loss, gradient norm or update, or a write would
    have stored a non-finite trainable value."""


class OutputError(MoetuneError):
    """Writing one of the run's outputs (metrics, tracker files, adapter, export) failed: disk full, permissions."""


class RunDirInUse(ConfigError):
    """Another trainer holds the run directory's lock."""


class ExportError(MoetuneError):
    """An export that cannot be made from what it was given."""


class TrackerError(MoetuneError):
    """A tracker was asked for and cannot be used; the message says how to fix it."""


class UsageError(ConfigError):
    """A command line that does not parse (unknown flag, missing argument, a value of the wrong kind)."""


class VerificationError(ExportError):
    """--verify found the export's logits beyond the tolerance: the export must not be used."""


class RunContentsError(MoetuneError):
    """A run directory (or a file a command reads from it) lacks what the command needs: no metrics yet, no adapter
    or checkpoint yet."""


class MissingDependency(MoetuneError):
    """An optional dependency a command needs is not installed; the message names the extra that installs it."""


class DeviceError(ConfigError):
    """A device that this machine does not have (cuda without a GPU, cuda:3 on a machine with two)."""


class TextError(MoetuneError):
    """Text that cannot be encoded as UTF-8 (lone surrogates, from bytes that are not UTF-8)."""
