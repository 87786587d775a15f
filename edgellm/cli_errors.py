"""The CLI's error policy, shared by every subcommand module: EdgeLLMError -> one line on stderr, exit 2."""
from __future__ import annotations

import sys
from functools import wraps

import click

from edgellm.errors import EdgeLLMError


def friendly_errors(fn):
    """Turn EdgeLLMError into a one-line message and exit code 2 (no traceback)."""

    @wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except EdgeLLMError as e:
            click.echo(f"edgellm: error: {e}", err=True)
            sys.exit(2)
        except KeyboardInterrupt:
            click.echo("", err=True)
            sys.exit(130)
        except BrokenPipeError:
            sys.exit(0)

    return wrapper
