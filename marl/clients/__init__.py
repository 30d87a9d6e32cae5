"""gRPC clients for marl's services, for marl itself and for other projects."""

from marl.clients.runs import AsyncRunsClient, RunEvent, RunInfo, RunNotFound, RunsClient
from marl.clients.sandbox import AsyncSandboxClient, ExecuteResult, SandboxClient, TestResult

__all__ = [
    "AsyncRunsClient",
    "AsyncSandboxClient",
    "ExecuteResult",
    "RunEvent",
    "RunInfo",
    "RunNotFound",
    "RunsClient",
    "SandboxClient",
    "TestResult",
]
