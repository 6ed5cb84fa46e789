"""The one error every conversion step raises."""


class ConversionError(ValueError):
    """The source cannot be converted; the message says why and what to do."""
