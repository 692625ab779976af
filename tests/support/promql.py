"""PromQL text patterns the deployment-file tests share (rules, dashboards, labels)."""

from __future__ import annotations

import re

# A quoted string: a label value or template text, never a metric or label name.
STRING = r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`'
# A grouping or matching clause; group 1 is its label list.
GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)")
