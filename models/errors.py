"""The error every loader raises for a model it cannot serve."""


class ModelLoadError(RuntimeError):
    """A model file is missing, unreadable or of an unsupported kind; the message names
    the file and the fix."""
