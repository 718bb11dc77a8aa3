"""final: an in-process inference wrapper on veRL's rollout contract."""

__version__ = "0.1.0"

from final.compat import check_lane as _check_lane

_check_lane()  # an untested veRL/transformers mix fails here, naming the two lanes, not deep in a call
