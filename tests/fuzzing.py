"""What the protocol's fuzz tests share: hypothesis settings and the msgpack values they draw."""

from __future__ import annotations

import struct

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

LEN = struct.Struct("<I")  # a frame's length prefix (protocol.py)
FUZZ = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])

values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False)
    | st.text(max_size=12) | st.binary(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8)
