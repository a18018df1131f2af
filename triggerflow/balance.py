"""When live peers serving the same queues hold uneven shares, and how many triggers the
overloaded one hands back (after a rolling restart, say). One definition for the consumer,
which sheds, and the store, which reads the peers on every renewal while a shed is due."""

from __future__ import annotations

OVER = 1.25  # a share above 125% of the fair one is too much ...
MIN_OVER = 20  # ... once it is at least this many triggers over the target
TARGET = 1.1  # shedding stops at 110% of the fair share


def _over_target(mine: int, live_peers: int, peers_running: int) -> int:
    """Triggers held over the target share; 0 while the shares count as even (no churn on
    small differences)."""
    if live_peers < 2:
        return 0
    fair = peers_running / live_peers
    over = int(mine - fair * TARGET)
    return over if mine > fair * OVER and over >= MIN_OVER else 0


def uneven(mine: int, live_peers: int, peers_running: int) -> bool:
    """This holder has triggers to shed."""
    return _over_target(mine, live_peers, peers_running) > 0


def excess(mine: int, live_peers: int, peers_running: int, max_shed: int) -> int:
    """Triggers to hand back: none unless we hold over 125% of the fair share and at least
    20 too many; then down to 110%, at most ``max_shed``."""
    return min(_over_target(mine, live_peers, peers_running), max_shed)
