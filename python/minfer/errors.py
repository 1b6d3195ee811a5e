"""The one exception family users see. Every bad input ends here with a message that
says what is wrong and where; never a segfault, never a silent fallback."""


class MinferError(Exception):
    """Base class of every error minfer reports to a user."""


class GGUFError(MinferError):
    """A GGUF file is malformed, truncated, or uses something we do not support."""


class UnsupportedModelError(MinferError):
    """The architecture or a tensor type is not one minfer runs."""


class BackendError(MinferError):
    """A backend name is unknown, not compiled in, or not usable here; or a node has no backend."""


class ContextError(MinferError):
    """The prompt (plus the tokens to generate) does not fit in the context."""


class KvPoolFull(ContextError):
    """A pooled context has no room for a new sequence while the running ones hold
    theirs (a server waits for one to end)."""


class ModelFetchError(MinferError):
    """The default model could not be fetched or failed verification."""


class NumericsError(MinferError):
    """The model produced NaN or Inf where a number was needed (a broken or lying file)."""
