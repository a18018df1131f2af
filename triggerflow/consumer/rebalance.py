"""How many triggers to shed so live peers even out (after a rolling restart, say)."""

from __future__ import annotations


def excess(mine: int, live_peers: int, peers_running: int, max_shed: int) -> int:
    """Triggers to hand back: none unless we hold over 125% of the fair share and at least
    20 too many (no churn on small differences); then down to 110%, at most ``max_shed``."""
    if live_peers < 2:
        return 0
    fair = peers_running / live_peers
    over = int(mine - fair * 1.1)
    if mine > fair * 1.25 and over >= 20:
        return min(over, max_shed)
    return 0
