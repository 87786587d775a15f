"""Click options shared by several edgellm commands (cli.py, cli_chat.py, cli_serve.py)."""
from __future__ import annotations

import functools

import click



def prompt_cache_options(fn=None, *, default_on: bool = False):
    """--prompt-cache DIR / --prompt-cache-gb (and --no-prompt-cache where it is on by default): computed prompt
    blocks kept on disk across runs. The command gets prompt_cache (a directory or None) and prompt_cache_gb."""
    if fn is None:
        return functools.partial(prompt_cache_options, default_on=default_on)
    where = "default: the user cache dir" if default_on else "default: off"
    opts = [click.option("--prompt-cache", "prompt_cache", default=None, metavar="DIR",
                         type=click.Path(file_okay=False), help=f"Keep computed prompts on disk here ({where})."),
            click.option("--prompt-cache-gb", type=click.FloatRange(min=0, min_open=True), default=None,
                         help="Largest size of the prompt cache directory, least recently used blocks evicted "
                              "(default 1 GB).")]
    if default_on:
        opts.append(click.option("--no-prompt-cache", is_flag=True, help="Do not keep prompts on disk."))

    @functools.wraps(fn)
    def wrapper(*args, prompt_cache=None, no_prompt_cache=False, **kw):
        if default_on and prompt_cache is None and not no_prompt_cache:
            from edgellm.model_path import cache_dir

            prompt_cache = str(cache_dir() / "prompt_cache")
        return fn(*args, prompt_cache=None if no_prompt_cache else prompt_cache, **kw)

    for o in reversed(opts):
        wrapper = o(wrapper)
    return wrapper
