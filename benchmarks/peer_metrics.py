"""What a local peer's Prometheus endpoint says, for benchmarks that read it at the end of a run."""

from __future__ import annotations

import re
import urllib.request

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


def scrape_peer(log: str) -> list[Sample] | None:
    """Every sample of the metrics endpoint a peer's log names ("metrics on URL"); None if it
    cannot be read."""
    match = re.search(r"metrics on (http://\S+/metrics)", log)
    if not match:
        return None
    try:
        with urllib.request.urlopen(match.group(1), timeout=10) as response:
            text = response.read().decode()
    except OSError:
        return None
    return [s for family in text_string_to_metric_families(text) for s in family.samples]
