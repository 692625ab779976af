"""Which command lines are Jupyter kernels and Jupyter servers.

A kernel whose server is gone is orphaned more readily than other processes
(:mod:`gpuwatch.agent.procinfo`), so recognition asks for the launch's own marks (the
kernel module or program, or the connection file jupyter_client wrote), never a word
that a training script's arguments could also hold.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

# colab_kernel_launcher is Google Colab's (and Colab-like runtimes') ipykernel wrapper.
_KERNEL_MODULES = frozenset(
    {"ipykernel_launcher", "ipykernel", "ipykernel.kernelapp", "colab_kernel_launcher"}
)
# Every kernel spec's argv carries the connection file that jupyter_client wrote, as
# ``-f {connection_file}`` (``--f=`` from VS Code); its name is ``kernel-<id>.json``. Both
# the option and the name are required: a training script's ``-f kernel-sizes.json`` alone
# would otherwise make it a "kernel", and kernels are judged orphaned more readily.
_CONNECTION_FILE_OPTIONS = ("-f", "--f", "--connection-file", "--connection_file")
# jupyter_client names it kernel-<uuid4>.json; VS Code kernel-v2-<pid><hex>.json.
_CONNECTION_FILE = re.compile(r"kernel-(?:v2-)?[0-9a-f][0-9a-f-]{3,63}\.json")
_KERNEL_PROGRAMS = frozenset({"ipykernel_launcher.py", "jupyter-kernel"})
_KERNEL_ARG_MARKERS = ("IRkernel::main", "IJulia/src/kernel.jl")
_SERVER_MODULES = frozenset(
    {
        "jupyterlab",
        "notebook",
        "jupyter_server",
        "nbclassic",
        "jupyterhub.singleuser",
        "voila",
        "kernel_gateway",
        "enterprise_gateway",
    }
)
_SERVER_PROGRAMS = frozenset(
    {
        "jupyter-lab",
        "jupyter-notebook",
        "jupyter-server",
        "jupyter-nbclassic",
        "jupyter-labhub",
        "jupyterhub-singleuser",
        "voila",
        "jupyter-kernelgateway",
        "jupyter-enterprisegateway",
    }
)
_SERVER_SUBCOMMANDS = frozenset(
    {"lab", "notebook", "server", "nbclassic", "kernelgateway", "enterprisegateway"}
)
# Python options that take a separate value: skipping them finds the script or -m module.
_PYTHON_OPTIONS_WITH_VALUE = frozenset({"-W", "-X", "-Q"})


def _entry_point(argv: Sequence[str]) -> tuple[str, str | None, Sequence[str]]:
    """``(program, module, rest)``: the program's basename (the script's for an interpreter),
    the ``-m`` module if any, and the arguments after it."""
    program = os.path.basename(argv[0]) if argv else ""
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg == "-m" and i + 1 < len(argv):
            return program, argv[i + 1], argv[i + 2 :]
        if arg.startswith("-m") and len(arg) > 2:
            return program, arg[2:], argv[i + 1 :]
        if arg in ("-c", "--"):
            break
        if arg in _PYTHON_OPTIONS_WITH_VALUE:
            i += 2
            continue
        if arg.startswith("-"):
            i += 1
            continue
        if program.startswith("python"):
            return os.path.basename(arg), None, argv[i + 1 :]
        break
    return program, None, argv[1:]


def is_jupyter_kernel(argv: Sequence[str]) -> bool:
    program, module, rest = _entry_point(argv)
    if module in _KERNEL_MODULES or program in _KERNEL_PROGRAMS:
        return True
    if program == "jupyter" and len(rest) > 0 and rest[0] == "kernel":
        return True
    if any(marker in arg for arg in argv for marker in _KERNEL_ARG_MARKERS):
        return True
    return _has_connection_file(argv)


def _has_connection_file(argv: Sequence[str]) -> bool:
    """``-f kernel-<id>.json`` or ``--f=.../kernel-<id>.json``: any kernel spec's launch."""
    for i, arg in enumerate(argv[1:], start=1):
        option, equals, value = arg.partition("=")
        if option not in _CONNECTION_FILE_OPTIONS:
            continue
        if not equals:
            value = argv[i + 1] if i + 1 < len(argv) else ""
        if _CONNECTION_FILE.fullmatch(os.path.basename(value)):
            return True
    return False


def is_jupyter_server(argv: Sequence[str]) -> bool:
    program, module, rest = _entry_point(argv)
    if module in _SERVER_MODULES or program in _SERVER_PROGRAMS:
        return True
    return program == "jupyter" and len(rest) > 0 and rest[0] in _SERVER_SUBCOMMANDS
