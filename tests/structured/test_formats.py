"""The JSON formats llmserve enforces itself (llguidance's "date" takes 02-29 of any year)."""

import datetime
import re

import pytest

from llmserve.structured.llguidance_backend import DATE, DATE_TIME, strict_date_formats


@pytest.mark.parametrize("year", [1, 400, 1900, 1996, 2000, 2023, 2024, 2100])
def test_date_pattern_matches_exactly_the_calendar_dates(year):
    for month in range(1, 13):
        for day in range(1, 32):
            text = f"{year:04d}-{month:02d}-{day:02d}"
            try:
                datetime.date(year, month, day)
                valid = True
            except ValueError:
                valid = False
            assert bool(re.fullmatch(DATE, text)) == valid, text


@pytest.mark.parametrize("text,valid", [
    ("2024-02-29T12:00:00Z", True), ("2023-02-29T12:00:00Z", False),
    ("2024-01-01T23:59:59.123+05:30", True), ("2024-01-01T24:00:00Z", False),
    ("2024-01-01 12:00:00Z", False),
])
def test_date_time_pattern(text, valid):
    assert bool(re.fullmatch(DATE_TIME, text)) == valid


def test_only_date_formats_become_patterns():
    schema = {"type": "object", "properties": {
        "d": {"type": "string", "format": "date"},
        "t": {"type": "string", "format": "date-time", "pattern": "^2"},  # the user's wins
        "format": {"type": "string", "format": "email"},  # a property called "format"
        "e": {"enum": [{"format": "date"}]},  # values are not schemas
    }}
    out = strict_date_formats(schema)["properties"]
    assert "format" not in out["d"] and out["d"]["pattern"] == f"^{DATE}$"
    assert out["t"] == schema["properties"]["t"]
    assert out["format"] == {"type": "string", "format": "email"}
    assert out["e"] == {"enum": [{"format": "date"}]}
