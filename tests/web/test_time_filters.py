"""The events page's time filters take only times a calendar can print: ``inf``,
``nan`` and 1e308 were a 500 with a traceback; now they are reported on the page, as
every filter that does not parse is (views.events), and the rest of it still shows."""

from __future__ import annotations

import pytest

from gpuwatch.server.web.templates.events import parse_utc
from web.conftest import Site


@pytest.mark.parametrize(
    "query",
    [
        "since=inf",
        "since=nan",
        "since=1e308",
        "until=1e308",
        "since=-1e308",
        "since=99999999999999999999999999999999",
        "until=-inf",
    ],
)
def test_an_out_of_range_time_is_reported_on_the_page_not_a_500(site: Site, query: str) -> None:
    page = site.client.get(f"/events?{query}")
    assert page.status_code == 200, page.text[:300]
    assert "Ignored a filter: out of range" in page.text


def test_times_a_calendar_can_print_still_parse() -> None:
    assert parse_utc("") is None
    assert parse_utc("1800000000") == 1_800_000_000.0
    assert parse_utc("1970-01-02") == 86400.0
    assert parse_utc(str(2.0**33)) == 2.0**33
    for bad in ("inf", "nan", "1e308", "-1", str(2.0**33 + 1)):
        with pytest.raises(ValueError, match="out of range"):
            parse_utc(bad)
