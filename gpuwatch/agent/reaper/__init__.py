"""The reaper: free GPU memory held by idle processes, safely (docs/reaper.md).

Data flows one way::

    polls -> history (runs per process and GPU, bounded)          history.py
    live snapshot + history -> candidates + idle evidence -> plan   plan.py
    candidates + protections + filters -> decisions (pure)         policy.py
    plan -> audit rows -> pidfd, re-check, SIGTERM, wait, SIGKILL   execute.py, audit.py, killer.py
         -> NVML verification -> outcome row + ``reaped`` event     execute.py, events.py

``gpuwatch reap`` (``gpuwatch/cli/reap.py``) runs a plan once; the agent's automatic
policy (``auto.py``, off by default) runs one on its own history every
``check_interval``, with a warning step, rate caps and a contention check.
``procfs.py`` reads ``/proc`` afresh for identity checks; ``settings.py`` is
``[agent.reap]``; ``errors.py`` holds the refusal and the exit codes.
"""
