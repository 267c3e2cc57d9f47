"""Moved to :mod:`vitrel.layout.tokens`; this alias stays for one release."""

import sys

from vitrel.layout import tokens

sys.modules[__name__] = tokens
