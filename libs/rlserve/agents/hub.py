"""The coordinator's side of the Agents RPCs: each call acts for its caller on one of the caller's runs.

A run is found through the run manager (`find_run`), so another user's run answers NOT_FOUND in the
words of a missing one, and an episode is looked up only in runs the caller may see. A run serves calls
while an attempt of it runs (its session, `agents.session`); before that (queued, between attempts) a
call is UNAVAILABLE and may be retried, after it FAILED_PRECONDITION. Each RPC here is one function the
coordinator's deployment calls; the gateway serves them as gRPC and, in OpenAI's shape, over HTTP.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from rlserve.agents.session import AgentSession
from rlserve.agents.table import AgentSessions
from rlserve.rpc import RpcError, failed_precondition, invalid_argument, not_found, unavailable
from rlserve.runs.record import STATE_NAMES, TERMINAL, Run
from rlserve.security.principal import Principal
from rlserve.v1 import agents_pb2
from rlserve.v1 import coordinator_pb2 as pb

FindRun = Callable[[str, Principal], Run]
MAX_WAIT_S = 60.0


def _messages(messages: list[dict]) -> list[agents_pb2.AgentMessage]:
    return [agents_pb2.AgentMessage(role=m["role"], content=m["content"]) for m in messages]


class AgentHub:
    def __init__(self, sessions: AgentSessions, find_run: FindRun):
        self.sessions, self.find_run = sessions, find_run

    def _run(self, run_id: str, caller: Principal) -> Run:
        if not run_id:
            raise invalid_argument("model", "required: the id of one of your runs")
        run = self.find_run(run_id, caller)
        if not run.spec.env.external_agent:
            raise failed_precondition(f"model: run {run_id!r} plays no external agent's episodes (its env.name is "
                                      f"not external_agent)")
        return run

    async def _session(self, run_id: str, caller: Principal, wait_s: float = 0.0) -> AgentSession | None:
        """The run's session; None when it has none yet (within `wait_s`) and may still get one."""
        run = self._run(run_id, caller)
        if run.state in TERMINAL or run.state == pb.RUN_STATE_CANCELLING:
            raise failed_precondition(f"model: run {run_id!r} has ended ({STATE_NAMES[run.state]})")
        session = await self.sessions.wait(run_id, min(max(wait_s, 0.0), MAX_WAIT_S))
        return session if isinstance(session, AgentSession) and not session.closed else None

    async def _serving(self, run_id: str, caller: Principal) -> AgentSession:
        session = await self._session(run_id, caller)
        if session is None:
            state = STATE_NAMES[self.find_run(run_id, caller).state]
            raise unavailable(f"model: run {run_id!r} is {state} and serves its agents' calls once its episodes "
                              f"are played; try again")
        return session

    async def next_episode(self, req: agents_pb2.NextEpisodeRequest, caller: Principal
                           ) -> agents_pb2.NextEpisodeResponse:
        if req.wait_s != req.wait_s or req.wait_s < 0:
            raise invalid_argument("wait_s", f"must be a number of seconds >= 0, got {req.wait_s}")
        session = await self._session(req.run_id, caller, req.wait_s)
        ep = await session.next(min(req.wait_s, MAX_WAIT_S)) if session is not None else None
        if ep is None:
            return agents_pb2.NextEpisodeResponse()
        ex = ep.example
        tok = session.inputs.tok
        messages = tok.messages(ex) if tok.prompt_format == "chat" else [{"role": "user", "content": ex.prompt}]
        return agents_pb2.NextEpisodeResponse(
            episode_id=ep.id, task_id=ep.task_id, validation=ep.validation, prompt=ex.prompt,
            messages=_messages(messages), answer=ex.answer, metadata_json=json.dumps(ex.metadata),
            env_args_json=json.dumps(ex.env_args), timeout_s=session.spec.env.timeout_s)

    async def start_episode(self, req: agents_pb2.StartEpisodeRequest, caller: Principal
                            ) -> agents_pb2.StartEpisodeResponse:
        session = await self._serving(req.run_id, caller)
        ep = session.start(req.task_id, req.answer)
        return agents_pb2.StartEpisodeResponse(episode_id=ep.id, timeout_s=session.spec.env.timeout_s)

    async def chat(self, req: agents_pb2.ChatRequest, caller: Principal) -> agents_pb2.ChatResponse:
        session = await self._serving(req.run_id, caller)
        return await session.chat(req, caller.name)

    async def end_episode(self, req: agents_pb2.EndEpisodeRequest, caller: Principal) -> agents_pb2.EndEpisodeResponse:
        if not req.episode_id:
            raise invalid_argument("episode_id", "required")
        if req.run_id:
            return await (await self._serving(req.run_id, caller)).end(req)
        return await self._owner_of(req.episode_id, caller).end(req)

    def _owner_of(self, episode_id: str, caller: Principal) -> AgentSession:
        """The session of the caller's run that knows `episode_id`."""
        found = []
        for run_id, session in self.sessions.items():
            if not isinstance(session, AgentSession) or not session.knows(episode_id):
                continue
            try:
                self.find_run(run_id, caller)
            except RpcError:  # a run the caller may not see is no candidate
                continue
            found.append(session)
        if not found:
            raise not_found(f"episode_id: no episode {episode_id!r} in your running runs")
        if len(found) > 1:
            raise invalid_argument("model", f"episode {episode_id!r} is in several of your runs: name the run")
        return found[0]
