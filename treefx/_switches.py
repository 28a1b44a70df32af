"""treefx's on/off environment switches (``TREEFX_*``), read one way: the value stripped and
lower-cased, ``0``/``off``/``false``/``no`` turn a switch off, ``1``/``on``/``true``/``yes``
turn it on."""

from __future__ import annotations

import os

__all__ = ["switched_off", "switched_on"]

_OFF = ("0", "off", "false", "no")
_ON = ("1", "on", "true", "yes")


def _value(name: str) -> str:
    return os.environ.get(name, "").strip().lower()


def switched_off(name: str) -> bool:
    """Whether the environment turns ``name`` off (a switch that is on unless turned off)."""
    return _value(name) in _OFF


def switched_on(name: str) -> bool:
    """Whether the environment turns ``name`` on (a switch that is off unless turned on)."""
    return _value(name) in _ON
