from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class RunEpisodeRequest(_message.Message):
    __slots__ = ("task_json",)
    TASK_JSON_FIELD_NUMBER: _ClassVar[int]
    task_json: str
    def __init__(self, task_json: _Optional[str] = ...) -> None: ...

class RunEpisodeResponse(_message.Message):
    __slots__ = ("rollout_json",)
    ROLLOUT_JSON_FIELD_NUMBER: _ClassVar[int]
    rollout_json: str
    def __init__(self, rollout_json: _Optional[str] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("episodes_done", "episodes_failed", "in_flight", "mean_episode_seconds", "worker_id", "episodes_withdrawn")
    EPISODES_DONE_FIELD_NUMBER: _ClassVar[int]
    EPISODES_FAILED_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    MEAN_EPISODE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPISODES_WITHDRAWN_FIELD_NUMBER: _ClassVar[int]
    episodes_done: int
    episodes_failed: int
    in_flight: int
    mean_episode_seconds: float
    worker_id: str
    episodes_withdrawn: int
    def __init__(self, episodes_done: _Optional[int] = ..., episodes_failed: _Optional[int] = ..., in_flight: _Optional[int] = ..., mean_episode_seconds: _Optional[float] = ..., worker_id: _Optional[str] = ..., episodes_withdrawn: _Optional[int] = ...) -> None: ...
