"""The one exception type that the command line turns into a one-line error and a non-zero exit."""


class ConversionError(Exception):
    """Bad input or an impossible request: the message names the file, tensor or flag at fault."""
