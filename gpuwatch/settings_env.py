"""Refuse, at start, a ``GPUWATCH_AGENT_*`` or ``GPUWATCH_SERVER_*`` variable that
names no setting, as an unknown key of the config file is refused.

Why: the environment is where the deploy docs put secrets, and a misspelt one was
ignored without a word: the server's read token spelt without its underscore started
a server with its reads open, where the same key in the file is exit 3. :func:`gpuwatch.settings.load`
calls :func:`refuse_unknown_variables` before it reads the environment.

Names under those prefixes that are set on purpose but are not settings are let
through (:data:`NOT_SETTINGS`, :data:`_SERVICE_LINK`). Stdlib only, and difflib only
when there is something to refuse: the agent imports this module.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping

from gpuwatch.errors import ConfigError

# Read by gpuwatch.torch inside users' training processes (its AGENT_URL_ENV): a job's
# environment points the OOM reporter at the agent, and `gpuwatch status` run in that
# job must not refuse it.
NOT_SETTINGS = frozenset({"GPUWATCH_AGENT_URL"})

# What Kubernetes sets, unasked, in every pod of a namespace holding a Service named
# gpuwatch-server or gpuwatch-agent (docker's legacy links set the same shapes):
# SERVICE_HOST, SERVICE_PORT, SERVICE_PORT_<NAME>, PORT, PORT_<N>_<PROTO>[_PROTO|_PORT|
# _ADDR]. Our manifests turn them off (enableServiceLinks: false); others may not, and
# a refused one would be a crash loop.
_SERVICE_LINK = re.compile(
    r"SERVICE_HOST|SERVICE_PORT(_[A-Z0-9_]+)?|PORT(_[0-9]+_(TCP|UDP|SCTP)(_PROTO|_PORT|_ADDR)?)?"
)


def unknown_variables(
    prefix: str, known: Iterable[str], environ: Mapping[str, str] | None = None
) -> list[str]:
    """The variables of ``environ`` (default: this process's) under ``prefix`` that are
    none of ``known`` and not set on purpose by something else. Any case, as the
    settings read them."""
    names = {name.upper() for name in known}
    found = []
    for name in sorted(os.environ if environ is None else environ):
        upper = name.upper()
        if not upper.startswith(prefix) or upper in names or upper in NOT_SETTINGS:
            continue
        if _SERVICE_LINK.fullmatch(upper[len(prefix) :]):
            continue
        found.append(name)
    return found


def refuse_unknown_variables(
    prefix: str, known: Iterable[str], environ: Mapping[str, str] | None = None
) -> None:
    """Raise :class:`ConfigError` (exit 3, one line) naming the first variable under
    ``prefix`` that is none of ``known``, with the likeliest one meant."""
    names = sorted({name.upper() for name in known})
    unknown = unknown_variables(prefix, names, environ)
    if not unknown:
        return
    from difflib import get_close_matches

    name = unknown[0]
    # Compared without the prefix, which every name shares and would make any alike.
    alike = get_close_matches(
        name.upper()[len(prefix) :], [other[len(prefix) :] for other in names], n=1, cutoff=0.7
    )
    hint = f" (did you mean {prefix}{alike[0]}?)" if alike else ""
    more = f"; {len(unknown) - 1} more unknown" if len(unknown) > 1 else ""
    raise ConfigError(
        f"unknown environment variable {name}: no setting has that name{hint}{more}; "
        "docs/configuration.md lists them"
    )
