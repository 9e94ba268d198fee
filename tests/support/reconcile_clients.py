"""A scripted desktop client speaking the real desktop protocol (DESIGN.md §6), with the failure
modes the reconciler must repair: killed mid-task (socket dropped, no more calls), ignoring
interrupts, or connected without ever leasing.

The full-featured simulator is tools/desktop_sim; this one exists so the reconcile scenarios can
misbehave on cue, which a well-behaved simulator should not do.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import aiohttp


@dataclass
class Posted:
    task_id: str
    monitor_task_id: int
    status: int


@dataclass
class ScriptedClient:
    hub_url: str
    client_id: uuid.UUID
    token: str
    work_seconds: float = 0.3
    ignore_interrupts: bool = False
    lease: bool = True
    heartbeat_interval: float = 0.5
    leased: list[dict[str, Any]] = field(default_factory=list)
    posted: list[Posted] = field(default_factory=list)
    yielded: list[str] = field(default_factory=list)
    controls: list[dict[str, Any]] = field(default_factory=list)
    _session: aiohttp.ClientSession | None = None
    _ws: aiohttp.ClientWebSocketResponse | None = None
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _interrupts: set[str] = field(default_factory=set)
    _revoked: set[str] = field(default_factory=set)
    current_task: str | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    @property
    def connected(self) -> bool:
        return self._ws is not None and not self._ws.closed

    async def start(self) -> ScriptedClient:
        self._session = aiohttp.ClientSession(headers=self.headers)
        self._ws = await self._session.ws_connect(self.hub_url + "/api/desktop/ws", heartbeat=None)
        self._tasks = [asyncio.create_task(self._guard(self._read())),
                       asyncio.create_task(self._guard(self._heartbeat()))]
        if self.lease:
            self._tasks.append(asyncio.create_task(self._guard(self._work())))
        return self

    async def _guard(self, loop: Coroutine[Any, Any, None]) -> None:
        """A loop ends quietly when the hub goes away (the client is as good as dead then)."""
        with contextlib.suppress(aiohttp.ClientError, ConnectionError, RuntimeError):
            await loop

    async def kill(self) -> None:
        """Die abruptly: every loop stops mid-step, the socket is dropped without a goodbye."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
        if self._session is not None:
            await self._session.close()  # closes the socket's transport
        self._session = None
        self._ws = None

    async def _read(self) -> None:
        assert self._ws is not None
        async for msg in self._ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                continue
            event = msg.json()
            if event.get("type") == "task_available":
                self._wake.set()
            elif event.get("type") == "task_control":
                self.controls.append(event)
                if event["control"] == "interrupt_requested":
                    self._interrupts.add(event["task_id"])
                else:
                    self._revoked.add(event["task_id"])

    async def _heartbeat(self) -> None:
        assert self._ws is not None
        while True:
            await self._ws.send_json({"type": "heartbeat", "sent_at": datetime.now(UTC).isoformat()})
            await asyncio.sleep(self.heartbeat_interval)

    async def _post(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        assert self._session is not None
        async with self._session.post(self.hub_url + path, json=body) as resp:
            return resp.status, await resp.json()

    async def _work(self) -> None:
        while True:
            status, body = await self._post("/api/desktop/monitor/lease", {"max_tasks": 1})
            tasks = body.get("tasks", []) if status == 200 else []
            if not tasks:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), 0.3)
                continue
            for task in tasks:
                self.leased.append(task)
                self.current_task = str(task["task_id"])
                try:
                    await self._run(task)
                finally:
                    self.current_task = None

    async def _run(self, task: dict[str, Any]) -> None:
        """Serial execution with an extend (safe point) every 0.2 s until the work time is spent."""
        task_id = str(task["task_id"])
        token = task["lease_token"]
        started = datetime.now(UTC)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.work_seconds
        phases = ("NAVIGATING", "INPUTTING", "WAITING", "PARSING")
        step = 0
        while loop.time() < deadline:
            await asyncio.sleep(min(0.2, max(deadline - loop.time(), 0)))
            status, body = await self._post(f"/api/desktop/tasks/{task_id}/extend",
                                            {"lease_token": token, "execution_phase": phases[step % len(phases)]})
            step += 1
            if status != 200 or task_id in self._revoked:
                return  # fenced off: the lease is no longer ours
            interrupted = body.get("interrupt_requested") or task_id in self._interrupts
            if interrupted and not self.ignore_interrupts:
                status, _ = await self._post(f"/api/desktop/tasks/{task_id}/cancel", {
                    "lease_token": token, "reason": "collect_now_preempt",
                    "interrupt_generation": int(body.get("interrupt_generation") or task["interrupt_generation"])})
                self.yielded.append(task_id)
                return
        status, _ = await self._post(f"/api/desktop/tasks/{task_id}/result", {
            "lease_token": token, "status": "succeeded",
            "answer_text": f"{task['brand']['name']} is mentioned among the options.",
            "citations": [{"url": f"https://example.com/{task['monitor_task_id']}", "title": "source", "position": 1}],
            "brand_mentioned": True, "started_at": started.isoformat(), "finished_at": datetime.now(UTC).isoformat()})
        self.posted.append(Posted(task_id=task_id, monitor_task_id=int(task["monitor_task_id"]), status=status))
