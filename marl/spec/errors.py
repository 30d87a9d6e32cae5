"""Errors a user can fix, shared by every layer that talks to one."""

from __future__ import annotations


class UserError(Exception):
    """Something the user can fix; printed without a traceback, exit 2."""
