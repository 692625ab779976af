"""The OOM doctor: out-of-memory messages explained, and VRAM arithmetic (docs/doctor.md).

Data flows one way::

    text.windows -> families/* -> parse.parse_oom (OomFacts, as printed)
        -> figures.read_figures (trusted numbers) -> diagnosis.diagnose (ordered fixes)
        -> explain.Explanation (the JSON contract) -> report.render (for people)

    architecture (shape, parameters) -> fit (bytes per component, verdict, options)
        -> fit_report (per GPU; gpus for the catalogue and --gpu local)

``live`` fetches the local agent's snapshot for both. Nothing here imports torch.
"""

# The agent's default --listen address. Defined here, not in ``live``, so the CLI can
# show it as an option default without importing httpx (and ssl) on every command.
DEFAULT_AGENT_URL = "http://127.0.0.1:9402"
