"""argp's reading of an optional argument, on top of click's.

nvidia-container-cli parses with GNU argp, where an option whose argument is optional
(``-u, --user[=UID[:GID]]``) takes one only when it is attached: ``--user=0:0`` or ``-u0:0``.
``--user info`` is the option without a value and then the command ``info``. Click instead
takes the next word as the value unless it looks like an option, so the same line would read
``info`` as the user and find no command. Scripts written for NVIDIA's cli rely on argp's
reading, so before click sees the arguments every bare optional-value option is rewritten to
its attached, empty form (``--user=``), which click reads as "given without a value".

Which options are optional-valued comes from the click declarations themselves (click's
``is_flag=False, flag_value=...``), through every group down to the command, so a new option
of that kind anywhere gets argp's reading without being listed here.
"""

from __future__ import annotations

import click


def optional_valued(option: click.Parameter) -> bool:
    """Whether ``option`` takes a value that may be left out (click's ``flag_value`` on a
    non-flag option)."""
    return isinstance(option, click.Option) and bool(getattr(option, "_flag_needs_value", False))


def _takes_value(option: click.Parameter) -> bool:
    return isinstance(option, click.Option) and not option.is_flag and not option.count


def _names(command: click.Command) -> dict[str, click.Option]:
    return {name: p for p in command.params if isinstance(p, click.Option) for name in p.opts}


def _bare(option: click.Option) -> str:
    """The attached empty form, ``--long=``: click has no attached form for an empty short value."""
    long = [name for name in option.opts if name.startswith("--")]
    return f"{long[0]}=" if long else option.opts[0]


def attached_only(command: click.Command, args: list[str]) -> list[str]:
    """``args`` with every optional-valued option that has no attached value rewritten to
    ``--long=``, so that the next word stays a word (argp's ``ARGP_IN_ORDER`` reading).
    Anything it does not recognise is passed on unchanged, for click to judge."""
    out: list[str] = []
    options = _names(command)
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if arg == "--":
            out += args[i - 1:]
            break
        if arg.startswith("--"):
            name, eq, _ = arg.partition("=")
            option = options.get(name)
            if option is not None and optional_valued(option) and not eq:
                out.append(_bare(option))
                continue
            out.append(arg)
            if option is not None and _takes_value(option) and not eq and i < len(args):
                out.append(args[i])
                i += 1
            continue
        if arg.startswith("-") and len(arg) > 1:
            tokens, takes_next = _short_group(options, arg)
            out += tokens
            if takes_next and i < len(args):
                out.append(args[i])
                i += 1
            continue
        out.append(arg)
        if isinstance(command, click.Group):
            sub = command.commands.get(arg)
            if sub is None:
                out += args[i:]
                break
            command, options = sub, _names(sub)
    return out


def _short_group(options: dict[str, click.Option], arg: str) -> tuple[list[str], bool]:
    """``-abc`` read as argp reads it: a value-taking option ends the group (the rest is its
    value, else the next word is); an optional-valued one with nothing after it is bare.
    Returns the words to pass on and whether the next word is a value."""
    for k in range(1, len(arg)):
        option = options.get("-" + arg[k])
        if option is None:
            return [arg], False
        attached = k + 1 < len(arg)
        if optional_valued(option):
            return ([arg] if attached else [arg[:k]] * (k > 1) + [_bare(option)]), False
        if _takes_value(option):
            return [arg], not attached
    return [arg], False
