"""The alert engine: rules over the detection verdicts and the fleet's state, with
Alertmanager's life cycle (pending, firing, resolved), grouping, silences and a
notification log in the database.

    config.py    [server.alerts]: rules, thresholds, grouping, routes, the team map
    rules.py     pure: fleet facts -> the alerts whose condition holds now
    lifecycle.py pure: previous alert states + what holds now -> new states
    dispatch.py  pure: alerts, groups, silences, routes -> notifications due now
    models.py    alerts, alert groups, notifications (the log), silences
    facts.py     what the rules read from the database, in a few queries
    engine.py    one evaluation: facts -> rules -> life cycle -> dispatch -> delivery
    silences.py  create, list and expire silences
    views.py     GET /api/v1/alerts, silences, receivers and their test
"""
