"""The exception types that the command line turns into a one-line error and a non-zero exit."""


class ConversionError(Exception):
    """Bad input or an impossible request: the message names the file, tensor or flag at fault."""


class MissingDependency(ConversionError):
    """A package the command needs is not installed, or too old: the message names it and what to install.
    A usage error (exit 2), as argparse's are: nothing was tried."""
