"""The users' token file (Kubernetes' static token file format) and the book of tokens the
services check callers against: parsing with errors naming the line, the services' token
apart, and the file read again when it changes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from marl.runtime.auth import TokenBook
from marl.spec.services import auth_users
from marl.spec.users import OPEN, SERVICE, Identity, parse_token_file

GOOD = """# marl users
alice-token,alice,1001

bob-token, bob ,1002,"team-b"
root-token,root,0,"marl:admins,ops"
"""


def test_parse_the_static_token_file_format() -> None:
    assert parse_token_file(GOOD, "users.csv") == {
        "alice-token": Identity("alice", "1001"),
        "bob-token": Identity("bob", "1002", ("team-b",)),
        "root-token": Identity("root", "0", ("marl:admins", "ops")),
    }


@pytest.mark.parametrize(("text", "message"), [
    ("a-token,alice\n", "users.csv, line 1: expected token,user,uid"),
    ("x,alice,1\n\nbad token,bob,2\n", "users.csv, line 3: the token must be"),
    ("a,alice,1\nb,,2\n", "users.csv, line 2: the user name must be"),
    ("a,marl:service,1\n", "users.csv, line 1: the user name 'marl:service' is reserved"),
    ("a,anonymous,1\n", "users.csv, line 1: the user name 'anonymous' is reserved"),
    ("a,alice,1\na,bob,2\n", "users.csv, line 2: this token is also the token of user 'alice'"),
    ('a,alice,1,"x,,y",z\n', "users.csv, line 1: expected token,user,uid"),
])
def test_refuse_a_bad_file_naming_the_line(text: str, message: str) -> None:
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(")) as err:
        parse_token_file(text, "users.csv")
    assert "bad token" not in str(err.value)  # never the token itself


def test_admins_and_services_see_everything_users_their_own() -> None:
    alice, root = Identity("alice"), Identity("root", groups=("marl:admins",))
    assert alice.may_see("alice") and not alice.may_see("bob") and not alice.admin
    assert root.may_see("bob") and root.admin
    assert SERVICE.may_see("bob") and OPEN.may_see("bob")


def test_users_need_the_services_token_which_no_user_may_have(tmp_path: Path) -> None:
    users = tmp_path / "users.csv"
    users.write_text(GOOD)
    with pytest.raises(ValueError, match="^MARL_AUTH_TOKENS_FILE: users need the services' own"):
        auth_users({"MARL_AUTH_TOKENS_FILE": str(users)})
    env = {"MARL_AUTH_TOKENS_FILE": str(users), "MARL_AUTH_TOKEN": "svc"}
    assert set(auth_users(env)) == {"alice-token", "bob-token", "root-token"}
    with pytest.raises(ValueError, match="user 'bob' has the services' token"):
        auth_users({**env, "MARL_AUTH_TOKEN": "bob-token"})
    with pytest.raises(ValueError, match="cannot read the users' token file"):
        auth_users({**env, "MARL_AUTH_TOKENS_FILE": str(tmp_path / "missing.csv")})


def test_book_knows_the_services_and_the_users(tmp_path: Path) -> None:
    users = tmp_path / "users.csv"
    users.write_text(GOOD)
    book = TokenBook("svc", str(users))
    assert book.identify("Bearer svc") == SERVICE
    assert book.identify(b"Bearer alice-token") == Identity("alice", "1001")
    for wrong in (None, "svc", "Bearer svc2", "Bearer alice-toke", "alice-token",
                  "Bearer alice-token ", "Bearer \udcff"):
        assert book.identify(wrong) is None, wrong
    assert TokenBook("svc", None).identify("Bearer alice-token") is None


def test_book_reads_the_file_again_when_it_changes(tmp_path: Path) -> None:
    users = tmp_path / "users.csv"
    users.write_text("alice-token,alice,1\n")
    book = TokenBook("svc", str(users))
    assert book.identify("Bearer alice-token") == Identity("alice", "1")
    new = tmp_path / "users.new"
    new.write_text("carol-token,carol,3\n")
    os.replace(new, users)  # a Secret's update: a new file in its place
    assert book.identify("Bearer alice-token") is None
    assert book.identify("Bearer carol-token") == Identity("carol", "3")
    users.write_text("carol-token,carol\n")  # broken: no user is let in, the services are
    assert book.identify("Bearer carol-token") is None
    assert book.identify("Bearer svc") == SERVICE
    users.write_text("carol-token,carol,3\nsvc,mallory,4\n")  # the services' token: not hers
    assert book.identify("Bearer carol-token") == Identity("carol", "3")
    assert book.identify("Bearer svc") == SERVICE
    users.unlink()
    assert book.identify("Bearer carol-token") is None
