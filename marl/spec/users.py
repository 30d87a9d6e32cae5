"""Who calls a marl service: the services themselves, or a user of a shared deployment.

The services share one token (`$MARL_AUTH_TOKEN`, `marl.spec.services.auth_token`)
and talk to each other with it. Users each have a token of their own, listed in the
file `$MARL_AUTH_TOKENS_FILE` names, in Kubernetes' static token file format
(`--token-auth-file`): one user a line, `token,user,uid` and optionally the user's
groups as a fourth, quoted column, `"group1,group2"`. Blank lines and lines that
start with `#` are skipped. Members of `marl:admins` see and cancel every run, as the
services do; any other user sees only the runs it submitted.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

USERS_FILE_ENV = "MARL_AUTH_TOKENS_FILE"
ADMINS_GROUP = "marl:admins"
SERVICE_USER = "marl:service"
"""The owner the service identity's runs get (`marl demo`, `marl up` and the launcher
submit with the service token)."""
ANONYMOUS_USER = "anonymous"
"""The owner of a run submitted while authentication is off."""
RESERVED_PREFIX = "marl:"
MAX_FILE_BYTES = 1 << 20
MAX_USERS = 10_000
MAX_NAME = 256
MAX_TOKEN = 4096


@dataclass(frozen=True)
class Identity:
    """A caller: its user name (a run's owner), uid and groups, and whether it is the
    service identity."""

    user: str
    uid: str = ""
    groups: tuple[str, ...] = ()
    service: bool = False

    @property
    def admin(self) -> bool:
        """Sees every run and every adapter: the services and the `marl:admins` group."""
        return self.service or ADMINS_GROUP in self.groups

    def may_see(self, owner: str) -> bool:
        """Whether this caller may see (and act on) what `owner` owns."""
        return self.admin or owner == self.user


SERVICE = Identity(SERVICE_USER, service=True)
OPEN = Identity(ANONYMOUS_USER, service=True)
"""Every caller while authentication is off: anyone who reaches a service may do
anything, as a single-user deployment needs."""


def valid_token(value: str) -> bool:
    return (0 < len(value) <= MAX_TOKEN and value.isprintable()
            and not any(c.isspace() for c in value))


def _name_problem(value: str, what: str) -> str | None:
    if not value or len(value) > MAX_NAME or not value.isprintable():
        return f"the {what} must be 1-{MAX_NAME} printable characters"
    return None


def parse_token_file(text: str, where: str) -> dict[str, Identity]:
    """Token -> its user, from a static token file's text; a ValueError names `where`, the
    line and what is wrong (never the token)."""
    users: dict[str, Identity] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        at = f"{where}, line {number}"
        row = next(csv.reader([line]))
        if not 3 <= len(row) <= 4:
            raise ValueError(f"{at}: expected token,user,uid and optionally \"group1,group2\"; "
                             f"got {len(row)} columns")
        token, user, uid = (c.strip() for c in row[:3])
        groups = tuple(g.strip() for g in row[3].split(",") if g.strip()) if len(row) == 4 else ()
        if not valid_token(token):
            raise ValueError(f"{at}: the token must be 1-{MAX_TOKEN} printable characters "
                             "without spaces")
        for value, what in ((user, "user name"), (uid or "-", "uid"),
                            *((g, "group name") for g in groups)):
            problem = _name_problem(value, what)
            if problem:
                raise ValueError(f"{at}: {problem}")
        if user.startswith(RESERVED_PREFIX) or user == ANONYMOUS_USER:
            raise ValueError(f"{at}: the user name {user[:60]!r} is reserved (names starting "
                             f"with {RESERVED_PREFIX!r} and {ANONYMOUS_USER!r}); rename the user")
        if token in users:
            raise ValueError(f"{at}: this token is also the token of user "
                             f"{users[token].user[:60]!r}; give every user a token of its own")
        users[token] = Identity(user, uid, groups)
        if len(users) > MAX_USERS:
            raise ValueError(f"{where}: more than {MAX_USERS} users")
    return users


def read_token_file(path: str, where: str = USERS_FILE_ENV) -> dict[str, Identity]:
    """`parse_token_file` of the file at `path`; one that cannot be read is a ValueError."""
    label = f"{where} ({path[:200]})"
    try:
        with open(Path(path), "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise ValueError(f"{label}: cannot read the users' token file: {e.strerror}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise ValueError(f"{label}: the users' token file is over {MAX_FILE_BYTES} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{label}: the users' token file is not UTF-8 text") from None
    return parse_token_file(text, label)
