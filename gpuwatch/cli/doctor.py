"""``gpuwatch explain`` (what an OOM message means) and ``gpuwatch fit`` (VRAM arithmetic).

Both are top-level commands. Exit codes: 0 success; 2 ``explain`` with no input at a
terminal (a one-line hint instead of waiting on the keyboard); 3 bad option value,
unreadable input file or empty input; 5 ``fit --gpu local`` with no agent answering; 6
``explain`` input is not an OOM message (``--json`` still prints
``{"recognized": false, ...}``). ``fit`` prints its report and then exits with its
verdict: 0 fits (or fits, tight) on at least one GPU asked about, 10 does not fit on
any, 11 cannot tell (the answer depends on the model's shape: give ``--config``).
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import typer

from gpuwatch.doctor import DEFAULT_AGENT_URL

if TYPE_CHECKING:
    from gpuwatch.doctor.history import PastEvent
    from gpuwatch.snapshot import HostSnapshot

# A 10 MB log is normal; past this the input is not a log a person pasted.
MAX_INPUT_BYTES = 256 * 2**20
USAGE_EXIT = 2  # the CLI framework's code for a usage error (gpuwatch.errors.EXIT_CODES)
EMPTY_INPUT = "nothing to explain: the input is empty"
NO_INPUT_HINT = (
    "gpuwatch explain: no message given; use `gpuwatch explain FILE`, "
    "`gpuwatch explain --text '...'`, or pipe it: `python train.py 2>&1 | gpuwatch explain`"
)


def register(app: typer.Typer) -> None:
    app.command()(explain)
    app.command()(fit)


def explain(
    source: str | None = typer.Argument(
        None,
        metavar="[FILE|-]",
        help="File holding the message or log; '-' or absent reads stdin; the message itself, in quotes, also works.",
    ),
    text: str | None = typer.Option(None, "--text", help="The message itself, instead of a file."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (the explanation)."),
    agent: str = typer.Option(
        DEFAULT_AGENT_URL, "--agent", metavar="URL", help="Local gpuwatch agent."
    ),
    no_live: bool = typer.Option(
        False, "--no-live", help="Do not ask the agent who is on the GPU now."
    ),
    server: str | None = typer.Option(
        None,
        "--server",
        metavar="URL",
        help="Central server for the GPU's last hour (default: the agent's server_url setting).",
    ),
) -> None:
    """Explain a GPU out-of-memory message: the numbers, the likely cause, the exact fix."""
    from gpuwatch.doctor.explain import Explanation
    from gpuwatch.doctor.explain import explain as explain_text
    from gpuwatch.doctor.live import agent_url_problem, fetch_local_snapshot, same_host
    from gpuwatch.doctor.parse import NOT_RECOGNISED
    from gpuwatch.doctor.report import render
    from gpuwatch.errors import NotRecognized

    if text is None and source is None and sys.stdin.isatty():
        # Nothing piped and nothing named: reading the keyboard would look like a hang.
        print(NO_INPUT_HINT, file=sys.stderr)
        raise typer.Exit(USAGE_EXIT)
    if text is None and source == "-" and sys.stdin.isatty():
        print(
            "gpuwatch explain: reading the message from the terminal; end with Ctrl-D",
            file=sys.stderr,
        )
    problem = None if no_live else agent_url_problem(agent)
    if problem is not None:
        from gpuwatch.errors import ConfigError

        # An absent agent is a normal case; a URL that can be nobody's is a typo to report.
        raise ConfigError(f"--agent {agent!r}: {problem}")
    message = text if text is not None else _read_input(source)
    if not message.strip():
        from gpuwatch.errors import ConfigError

        # Empty input is no message at all, however it came (a file, stdin, --text).
        raise ConfigError(EMPTY_INPUT)
    snapshot = None if no_live else fetch_local_snapshot(agent)
    try:
        explanation = explain_text(message, snapshot=snapshot)
    except NotRecognized:
        if not as_json:
            raise
        typer.echo(Explanation.not_recognized().model_dump_json())
        print(f"gpuwatch: error: {NOT_RECOGNISED}", file=sys.stderr)
        raise typer.Exit(NotRecognized.exit_code) from None
    if explanation.live is not None:
        # The GPU the live view matched (by size, it may not be the message's index).
        device: str | None = f"cuda:{explanation.live.index}"
    elif explanation.live_note is not None:
        device = None  # a card of another size: this host's history is not its history
    else:
        device = explanation.device
    printed_host = explanation.printed.host if explanation.printed else None
    if printed_host is not None and not same_host(printed_host, _local_hostname(snapshot)):
        device = None  # another host's GPU: this host's history is not its history
    explanation.history = _server_history(server, device, snapshot)
    if as_json:
        typer.echo(explanation.model_dump_json(indent=2))
    else:
        typer.echo(render(explanation), nl=False)


def _server_history(
    server: str | None, device: str | None, snapshot: HostSnapshot | None
) -> list[PastEvent] | None:
    """The server's last hour on this GPU, when a server is configured; else None."""
    import time

    from gpuwatch.doctor.history import fetch_gpu_history
    from gpuwatch.settings import AgentSettings, load

    url = server or load(AgentSettings).server_url
    if url is None or device is None or not device.startswith("cuda:"):
        return None
    index = device.removeprefix("cuda:")
    if not index.isdigit():
        return None
    return fetch_gpu_history(
        url, hostname=_local_hostname(snapshot), gpu_index=int(index), now=time.time()
    )


def _local_hostname(snapshot: HostSnapshot | None) -> str:
    """This host's name as the agent reports it (the server knows it so), else the OS's."""
    import socket

    return snapshot.hostname if snapshot is not None else socket.gethostname()


def _is_message(argument: str) -> bool:
    """True when the argument is the message itself, pasted in quotes, not a file name:
    it names no existing file and reads like a sentence, or holds one of the words every
    recognised message has (people paste the error line straight after ``explain``, short
    ones too: ``CUDA_ERROR_OUT_OF_MEMORY: out of memory``; ``--text`` says so explicitly)."""
    from gpuwatch.doctor.text import ANCHORS

    # os.path.exists, not Path.exists: a long message is "File name too long", not False.
    if os.path.exists(argument):
        return False
    if "\n" in argument or len(argument.split()) >= 4:
        return True
    # A name like a path ("logs/oom.txt", "cudnn.log") stays a missing file.
    lowered = argument.lower()
    return not _PATH_LIKE.search(argument) and any(anchor in lowered for anchor in ANCHORS)


_PATH_LIKE = re.compile(r"[/\\]|\.\w{1,5}$")


def _read_input(source: str | None) -> str:
    from gpuwatch.errors import ConfigError

    if source == "":
        raise ConfigError(f"{EMPTY_INPUT} (give a file, a message or --text, or - for stdin)")
    if source not in (None, "-") and _is_message(source):
        return source[-MAX_INPUT_BYTES:]
    try:
        if source in (None, "-"):
            raw, cut = _tail(sys.stdin.buffer)
        else:
            with Path(source).open("rb") as handle:
                raw, cut = _tail(handle)
    except FileNotFoundError as err:
        raise ConfigError(
            f"cannot read {source}: {err.strerror or err} (to explain this text itself, use --text)"
        ) from err
    except OSError as err:
        raise ConfigError(f"cannot read {source}: {err.strerror or err}") from err
    if cut:
        from gpuwatch.doctor.units import format_size

        typer.echo(
            f"note: the input is {format_size(cut + len(raw))}; only its last "
            f"{format_size(MAX_INPUT_BYTES)} were read (a crash's message is at the end)",
            err=True,
        )
    # Logs are not always UTF-8 (Windows consoles, binary junk): decode at the boundary.
    return raw.decode("utf-8", errors="replace")


def _tail(stream: BinaryIO) -> tuple[bytes, int]:
    """The last :data:`MAX_INPUT_BYTES` of ``stream``, and how many bytes before them
    were skipped: a long log's OOM is at its end, not its start."""
    if stream.seekable():
        size = stream.seek(0, os.SEEK_END)
        skipped = max(0, size - MAX_INPUT_BYTES)
        stream.seek(skipped)
        return stream.read(MAX_INPUT_BYTES), skipped
    kept: deque[bytes] = deque()
    held = skipped = 0
    while chunk := stream.read(1 << 20):
        kept.append(chunk)
        held += len(chunk)
        while held - len(kept[0]) >= MAX_INPUT_BYTES:
            held -= len(kept[0])
            skipped += len(kept.popleft())
    raw = b"".join(kept)
    extra = max(0, len(raw) - MAX_INPUT_BYTES)
    return raw[extra:], skipped + extra


def fit(
    params: str | None = typer.Option(
        None, "--params", help="Parameter count, e.g. 8B, 70B, 350M."
    ),
    config: Path | None = typer.Option(
        None, "--config", help="Hugging Face config.json of the model."
    ),
    dtype: str | None = typer.Option(
        None,
        "--dtype",
        help="fp32, bf16, fp16, fp8, int8, int4 or nf4, any case; bfloat16, float16 and"
        " float32 too (default: nf4 for qlora; as a quantised --config stores its weights;"
        " else bf16).",
    ),
    mode: str = typer.Option("inference", "--mode", help="inference, full, lora or qlora."),
    context: int = typer.Option(4096, "--context", min=1, help="Tokens per sequence."),
    batch: int = typer.Option(1, "--batch", min=1, help="Sequences per step."),
    gpu: list[str] = typer.Option(
        ["local"],
        "--gpu",
        help=(
            "H100-80GB, A100-40GB, RTX4090, a size, or local; repeat it (or separate with "
            "commas) to compare cards. In a size GB means GiB, as cards are sold: "
            "24GB = 24GiB."
        ),
    ),
    agent: str = typer.Option(
        DEFAULT_AGENT_URL, "--agent", metavar="URL", help="Agent for --gpu local."
    ),
    gpus: int = typer.Option(
        1,
        "--gpus",
        min=1,
        help="GPUs the model is split over: tensor parallel for inference, FSDP/ZeRO-3 for"
        " training; figures are then per GPU.",
    ),
    gradient_checkpointing: bool | None = typer.Option(
        None,
        "--gradient-checkpointing/--no-gradient-checkpointing",
        help="Training: activations with or without checkpointing (default: on for qlora,"
        " as PEFT turns it on; off for full and lora).",
    ),
    lora_rank: int | None = typer.Option(
        None, "--lora-rank", min=1, max=65536, help="LoRA/QLoRA adapter rank (default 16)."
    ),
    kv_cache_dtype: str | None = typer.Option(
        None,
        "--kv-cache-dtype",
        help="Inference: the KV cache's element type, auto (16-bit; fp32 for an fp32 model),"
        " bf16, fp16, fp32 or fp8 (vLLM --kv-cache-dtype fp8, fp8_e4m3, fp8_e5m2).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Will this model fit on this GPU? Weights, KV cache, gradients, optimizer, activations.

    Exits 0 when it fits on at least one GPU asked about (tightly or not), 10 when it fits
    on none, 11 when it cannot tell without --config, 5 when --gpu local finds no agent.
    """
    from gpuwatch.doctor.fit_report import run_fit
    from gpuwatch.errors import EXIT_CANNOT_TELL, EXIT_DOES_NOT_FIT

    result = run_fit(
        params=params,
        config=config,
        dtype=dtype,
        mode=mode,
        context=context,
        batch=batch,
        gpu=gpu,
        agent=agent,
        gpus=gpus,
        checkpointing=gradient_checkpointing,
        lora_rank=lora_rank,
        kv_cache_dtype=kv_cache_dtype,
    )
    if as_json:
        typer.echo(json.dumps(result.to_json(), indent=2))
    else:
        typer.echo(result.render(), nl=False)
    exit_code = {"does_not_fit": EXIT_DOES_NOT_FIT, "unknown": EXIT_CANNOT_TELL}.get(result.verdict)
    if exit_code is not None:
        raise typer.Exit(exit_code)
