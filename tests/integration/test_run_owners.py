"""Users and owners on a shared deployment: each user sees, watches and cancels its own runs
only, generates only with its own runs' adapters, and may not call the services' own RPCs.

A real local cluster (learner, inference, workflow, sandbox, Redis) runs with the services'
token in `$MARL_AUTH_TOKEN` and three users in `$MARL_AUTH_TOKENS_FILE`: alice and bob,
and root in `marl:admins`. The learner trains one run at a time, so alice's first run
trains (its adapter is on the inference replica) while the others stay queued. Every
call goes through a plain gRPC channel with the caller's bearer token, and each refusal
is checked for its exact status code; another user's run must look exactly like a run
that does not exist.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import requests
import yaml

import marl
from marl.cli import main as cli
from marl.clients.runs import RunsClient
from marl.local.demo import DEMO_SPEC
from marl.local.launcher import Cluster
from marl.protocol.v1 import (
    common_pb2,
    inference_pb2,
    inference_pb2_grpc,
    learner_pb2,
    learner_pb2_grpc,
    sandbox_pb2,
    workflow_pb2,
)
from marl.runtime.auth import USER_METHODS
from marl.spec.run import apply_overrides
from tests.support.raw_grpc import call_raw

pytestmark = pytest.mark.timeout(900)

SERVICE = "service-token-0123"
TOKENS = {"alice": "alice-token-4567", "bob": "bob-token-89ab", "root": "root-token-cdef"}
USERS_FILE = (f'{TOKENS["alice"]},alice,1001\n'
              f'{TOKENS["bob"]},bob,1002,"team-b"\n'
              f'{TOKENS["root"]},root,0,"marl:admins,ops"\n')
SERVICES = {
    "inference": inference_pb2.DESCRIPTOR.services_by_name["Inference"],
    "workflow": workflow_pb2.DESCRIPTOR.services_by_name["Workflow"],
    "learner": learner_pb2.DESCRIPTOR.services_by_name["Learner"],
    "sandbox": sandbox_pb2.DESCRIPTOR.services_by_name["Sandbox"],
}
NOT_FOUND = grpc.StatusCode.NOT_FOUND


def meta(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def spec_yaml(name: str, steps: int) -> str:
    data = apply_overrides(DEMO_SPEC, [
        f"name={name}", f"train.steps={steps}", "train.problems_per_step=2",
        "grpo.group_size=2", "grpo.mini_batch_size=4", "train.val_problems=2",
        "train.val_interval=1000", "train.checkpoint_interval=1000", "lora.rank=4",
        "lora.alpha=8", "train.step_timeout_s=300"])
    data["model"] = {"path": str(Path(marl.__file__).parent / "assets" / "demo-model")}
    return yaml.safe_dump(data)


@contextmanager
def environ(**values: str) -> Iterator[None]:
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@dataclass
class Shared:
    endpoints: dict[str, Any]
    users_file: Path
    learner: learner_pb2_grpc.LearnerStub
    inference: inference_pb2_grpc.InferenceStub
    channels: list[grpc.Channel]
    alice_training: str
    """alice's run that trains (its adapter is loaded on the replica)."""
    alice_queued: str
    bob_queued: str
    adapter: common_pb2.AdapterRef
    """The adapter version alice's training run pushed."""


def submit(learner: learner_pb2_grpc.LearnerStub, user: str, name: str, steps: int) -> str:
    request = learner_pb2.SubmitRunRequest(spec_yaml=spec_yaml(name, steps))
    return str(learner.SubmitRun(request, metadata=meta(TOKENS[user]), timeout=120).run_id)


def pushed_adapter(inference: inference_pb2_grpc.InferenceStub, run_id: str,
                   timeout_s: float = 300.0) -> common_pb2.AdapterRef:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        listed = inference.ListAdapters(inference_pb2.ListAdaptersRequest(),
                                        metadata=meta(SERVICE), timeout=10)
        for a in listed.adapters:
            if a.ref.name.startswith(f"{run_id}/"):
                return a.ref
        time.sleep(0.5)
    raise AssertionError(f"run {run_id} pushed no adapter in {timeout_s}s")


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shared]:
    work = tmp_path_factory.mktemp("owners-cluster")
    users_file = work / "users.csv"
    users_file.write_text(USERS_FILE)
    with environ(MARL_AUTH_TOKEN=SERVICE, MARL_AUTH_TOKENS_FILE=str(users_file)):
        model = Path(marl.__file__).parent / "assets" / "demo-model"
        cluster = Cluster(work, str(model), max_concurrent_runs=1)
        try:
            endpoints = cluster.start()
            learner_ch = grpc.insecure_channel(endpoints["learner"])
            inference_ch = grpc.insecure_channel(endpoints["inference"][0])
            learner = learner_pb2_grpc.LearnerStub(learner_ch)
            inference = inference_pb2_grpc.InferenceStub(inference_ch)
            alice_training = submit(learner, "alice", "alice-a", 10_000)
            adapter = pushed_adapter(inference, alice_training)
            bob_queued = submit(learner, "bob", "bob-b", 1)
            alice_queued = submit(learner, "alice", "alice-c", 1)
            yield Shared(endpoints, users_file, learner, inference, [learner_ch, inference_ch],
                         alice_training, alice_queued, bob_queued, adapter)
            for ch in (learner_ch, inference_ch):
                ch.close()
        finally:
            cluster.stop()


def listed(shared: Shared, token: str, page_size: int = 0) -> list[learner_pb2.Run]:
    runs: list[learner_pb2.Run] = []
    page_token = ""
    while True:
        resp = shared.learner.ListRuns(
            learner_pb2.ListRunsRequest(page_size=page_size, page_token=page_token),
            metadata=meta(token), timeout=30)
        runs += resp.runs
        page_token = resp.next_page_token
        if not page_token:
            return runs


def code_of(call: Any, *args: Any, **kwargs: Any) -> tuple[grpc.StatusCode, str]:
    try:
        reply = call(*args, timeout=30, **kwargs)
        if hasattr(reply, "__next__"):
            next(reply)
    except grpc.RpcError as err:
        return err.code(), err.details() or ""
    return grpc.StatusCode.OK, ""


def test_allow_users_list_their_own_runs_and_admins_all(shared: Shared) -> None:
    mine = {r.run_id: r.owner for r in listed(shared, TOKENS["alice"])}
    assert mine == {shared.alice_training: "alice", shared.alice_queued: "alice"}
    assert {r.run_id: r.owner for r in listed(shared, TOKENS["bob"])} == {
        shared.bob_queued: "bob"}
    everyone = {shared.alice_training, shared.alice_queued, shared.bob_queued}
    assert {r.run_id for r in listed(shared, TOKENS["root"])} == everyone
    assert {r.run_id for r in listed(shared, SERVICE)} == everyone


def test_deny_another_users_run_as_if_it_did_not_exist(shared: Shared) -> None:
    bob = meta(TOKENS["bob"])
    target, ghost = shared.alice_training, "alice-a-000000"
    for rpc, request in (
        (shared.learner.GetRun, learner_pb2.GetRunRequest),
        (shared.learner.CancelRun, learner_pb2.CancelRunRequest),
        (shared.learner.WatchRun, learner_pb2.WatchRunRequest),
    ):
        code, details = code_of(rpc, request(run_id=target), metadata=bob)
        ghost_code, ghost_details = code_of(rpc, request(run_id=ghost), metadata=bob)
        assert (code, ghost_code) == (NOT_FOUND, NOT_FOUND), rpc
        assert details.replace(target, ghost) == ghost_details  # no existence leak
    run = shared.learner.GetRun(learner_pb2.GetRunRequest(run_id=target),
                                metadata=meta(TOKENS["alice"]), timeout=30)
    assert run.state == "RUNNING" and run.owner == "alice"  # bob's cancel did nothing
    assert code_of(shared.learner.GetRun, learner_pb2.GetRunRequest(run_id=target),
                   metadata=meta(TOKENS["root"]))[0] == grpc.StatusCode.OK


def test_deny_user_tokens_on_the_services_own_rpcs(shared: Shared) -> None:
    refused = []
    for kind, service in SERVICES.items():
        address = shared.endpoints[kind]
        address = address if isinstance(address, str) else address[0]
        with grpc.insecure_channel(address) as channel:
            for method in service.methods:
                path = f"/{service.full_name}/{method.name}"
                if path in USER_METHODS:
                    continue
                code = call_raw(channel, service, method, meta(TOKENS["root"]))
                if kind == "sandbox":  # it knows its own token only: no user, no service
                    assert code == grpc.StatusCode.UNAUTHENTICATED, path
                    continue
                assert code == grpc.StatusCode.PERMISSION_DENIED, path  # admins too
                refused.append(path)
    assert {"/marl.v1.Inference/PushAdapter", "/marl.v1.Inference/UnloadAdapter",
            "/marl.v1.Workflow/RunEpisode"} <= set(refused)
    # alice may not unload her own adapter either: replicas' adapters are the learner's
    request = inference_pb2.UnloadAdapterRequest(ref=alices_current(shared))
    code, _ = code_of(shared.inference.UnloadAdapter, request, metadata=meta(TOKENS["alice"]))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    (sandbox_http,) = shared.endpoints["sandbox_http"]
    r = requests.post(f"http://{sandbox_http}/run_code", json={"code": "print(1)",
                      "language": "python"}, headers={"Authorization": f"Bearer {TOKENS['bob']}"},
                      timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthenticated"


def generate(shared: Shared, token: str, ref: common_pb2.AdapterRef
             ) -> tuple[grpc.StatusCode, str]:
    request = inference_pb2.GenerateRequest(
        prompt_token_ids=[1, 2, 3], adapter=ref,
        sampling=inference_pb2.SamplingParams(max_tokens=2, temperature=0))
    return code_of(shared.inference.Generate, request, metadata=meta(token))


def alices_current(shared: Shared) -> common_pb2.AdapterRef:
    """The newest version of alice's training adapter, as alice lists it."""
    mine = shared.inference.ListAdapters(inference_pb2.ListAdaptersRequest(),
                                         metadata=meta(TOKENS["alice"]), timeout=10)
    return max((a.ref for a in mine.adapters if a.ref.name == shared.adapter.name),
               key=lambda ref: ref.version)


def refused_then_served(shared: Shared, refuse: Any, serve: Any, tries: int = 20) -> None:
    """`refuse(ref)` (bob) and then `serve(ref)` (alice) on alice's newest version. alice
    served after bob's refusal means the version was loaded when bob asked (a version is
    pushed once, and once retired it never comes back), so bob was refused for whose it
    is. alice's run trains on and retires versions: a version retired in between is tried
    again with the next one."""
    for _ in range(tries):
        ref = alices_current(shared)
        refuse(ref)
        if serve(ref):
            return
    raise AssertionError(f"alice was not served in {tries} tries")


def test_deny_generate_with_another_users_adapter(shared: Shared) -> None:
    policy = shared.adapter.name.split("/", 1)[1]

    def bob_refused(ref: common_pb2.AdapterRef) -> None:
        ghost = common_pb2.AdapterRef(name=f"nobody-000000/{policy}", version=ref.version)
        code, details = generate(shared, TOKENS["bob"], ref)
        ghost_code, ghost_details = generate(shared, TOKENS["bob"], ghost)
        assert code == ghost_code == grpc.StatusCode.FAILED_PRECONDITION
        assert details.replace(ref.name, ghost.name) == ghost_details  # as if never pushed
        many = shared.inference.GenerateMany(
            inference_pb2.GenerateManyRequest(requests=[inference_pb2.GenerateRequest(
                prompt_token_ids=[1, 2], adapter=ref,
                sampling=inference_pb2.SamplingParams(max_tokens=1))]),
            metadata=meta(TOKENS["bob"]), timeout=30)
        (outcome,) = [o for reply in many for o in reply.outcomes]
        assert outcome.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
        bobs = shared.inference.ListAdapters(inference_pb2.ListAdaptersRequest(),
                                             metadata=meta(TOKENS["bob"]), timeout=10)
        assert not [a for a in bobs.adapters if a.ref.name == ref.name]

    def served(ref: common_pb2.AdapterRef) -> bool:
        alice = generate(shared, TOKENS["alice"], ref)[0]
        if alice != grpc.StatusCode.OK:
            return False
        assert generate(shared, TOKENS["root"], ref)[0] == grpc.StatusCode.OK  # an admin
        return True

    refused_then_served(shared, bob_refused, served)

    (http,) = shared.endpoints["inference_http"]

    def http_as(user: str, method: str, path: str, **kwargs: Any) -> requests.Response:
        return requests.request(method, f"http://{http}{path}", timeout=60, headers={
            "Authorization": f"Bearer {TOKENS[user]}"}, **kwargs)

    def complete(user: str, ref: common_pb2.AdapterRef) -> int:
        body = {"model": f"{ref.name}@{ref.version}", "prompt": "1 + 1 =", "max_tokens": 2}
        return http_as(user, "POST", "/v1/completions", json=body).status_code

    def bob_refused_http(ref: common_pb2.AdapterRef) -> None:
        assert complete("bob", ref) == 404
        models = http_as("bob", "GET", "/v1/models").json()["data"]
        assert not [m for m in models if m["id"].startswith(ref.name)]

    refused_then_served(shared, bob_refused_http, lambda ref: complete("alice", ref) == 200)


def test_deny_unknown_tokens(shared: Shared) -> None:
    for token in ("nobody", TOKENS["alice"] + "x", TOKENS["alice"][:-1]):
        code, _ = code_of(shared.learner.ListRuns, learner_pb2.ListRunsRequest(),
                          metadata=meta(token))
        assert code == grpc.StatusCode.UNAUTHENTICATED, token
        assert generate(shared, token, shared.adapter)[0] == grpc.StatusCode.UNAUTHENTICATED
    code, _ = code_of(shared.learner.ListRuns, learner_pb2.ListRunsRequest(),
                      metadata=[("authorization", TOKENS["alice"])])  # no "Bearer "
    assert code == grpc.StatusCode.UNAUTHENTICATED


def test_list_runs_pages(shared: Shared, capsys: pytest.CaptureFixture[str]) -> None:
    everyone = [r.run_id for r in listed(shared, TOKENS["root"])]
    pages = []
    token = ""
    while True:
        resp = shared.learner.ListRuns(learner_pb2.ListRunsRequest(page_size=1,
                                                                   page_token=token),
                                       metadata=meta(TOKENS["root"]), timeout=30)
        pages.append([r.run_id for r in resp.runs])
        token = resp.next_page_token
        if not token:
            break
    assert pages == [[run_id] for run_id in everyone]  # one a page, no empty last page
    # alice's pages skip bob's run, which lies between hers
    assert [r.run_id for r in listed(shared, TOKENS["alice"], page_size=1)] == [
        shared.alice_training, shared.alice_queued]
    for bad in (learner_pb2.ListRunsRequest(page_size=-1),
                learner_pb2.ListRunsRequest(page_token="not-a-token")):
        code, details = code_of(shared.learner.ListRuns, bad, metadata=meta(TOKENS["bob"]))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert details.startswith(("page_size:", "page_token:"))
    with environ(MARL_AUTH_TOKEN=TOKENS["alice"]):  # a user's client, as marl's CLI runs
        with RunsClient(shared.endpoints["learner"]) as runs:
            assert [r.run_id for r in runs.list(page_size=1)] == [
                shared.alice_training, shared.alice_queued]
        assert cli.main(["runs", "--learner", shared.endpoints["learner"],
                         "--page-size", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == [shared.alice_training, shared.alice_queued]
    assert all("alice" in line.split() for line in lines)


def test_allow_users_cancel_their_own_runs_and_admins_any(shared: Shared) -> None:
    def cancel(user: str, run_id: str) -> learner_pb2.Run:
        return shared.learner.CancelRun(learner_pb2.CancelRunRequest(run_id=run_id),
                                        metadata=meta(TOKENS[user]), timeout=30)

    assert cancel("bob", shared.bob_queued).state == "CANCELLED"
    code, _ = code_of(shared.learner.CancelRun,
                      learner_pb2.CancelRunRequest(run_id=shared.alice_queued),
                      metadata=meta(TOKENS["bob"]))
    assert code == NOT_FOUND
    assert cancel("root", shared.alice_queued).state == "CANCELLED"
    cancel("alice", shared.alice_training)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        run = shared.learner.GetRun(learner_pb2.GetRunRequest(run_id=shared.alice_training),
                                    metadata=meta(TOKENS["alice"]), timeout=30)
        if run.state == "CANCELLED":
            break
        time.sleep(0.5)
    assert run.state == "CANCELLED"


def test_token_file_is_read_again_when_it_changes(shared: Shared) -> None:
    carol = "carol-token-7777"
    new = shared.users_file.with_suffix(".new")
    new.write_text(f'{TOKENS["alice"]},alice,1001\n{carol},carol,1003\n')
    os.replace(new, shared.users_file)  # as a Secret's update swaps the file
    assert listed(shared, carol) == []  # a new user, no restart; it owns nothing
    code, _ = code_of(shared.learner.ListRuns, learner_pb2.ListRunsRequest(),
                      metadata=meta(TOKENS["bob"]))
    assert code == grpc.StatusCode.UNAUTHENTICATED  # bob left the file
    assert {r.run_id for r in listed(shared, SERVICE)} >= {shared.bob_queued}
