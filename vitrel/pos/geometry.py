"""Moved to :mod:`vitrel.layout.geometry`; this alias stays for one release."""

import sys

from vitrel.layout import geometry

sys.modules[__name__] = geometry
