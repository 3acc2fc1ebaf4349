"""The gateway's HTTP listener, on a real aiohttp server with a toy API: the caller is resolved from the API's
own credential (401 in the API's shape without one), per-caller limits hold (429), bodies are bounded (413),
an RpcError becomes its HTTP status with its message, anything else one clean 500 line, and an unknown route
answers in the API's shape."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
from aiohttp import web

from rlserve.gateway.http import PRINCIPAL, HttpConfig, start_http
from rlserve.rpc import invalid_argument, not_found
from rlserve.security.identity import TokenStore
from rlserve.security.principal import Role
from rlserve.tenancy.policy import CallerLimits

TOKEN, ADMIN = "user-token-" + "0" * 32, "admin-token-" + "1" * 32


class Toy:
    prefix = "/toy"
    max_request_bytes = 1024
    liveness_paths = frozenset({"/beat"})

    def __init__(self):
        self.release = asyncio.Event()

    def routes(self) -> list[web.RouteDef]:
        return [web.get("/whoami", self.whoami), web.post("/echo", self.echo), web.get("/missing", self.missing),
                web.get("/bad", self.bad), web.get("/broken", self.broken), web.get("/hold", self.hold),
                web.get("/beat", self.whoami)]

    def token(self, request: web.Request) -> str | None:
        return request.headers.get("X-Toy-Key")

    def error(self, status: int, message: str, field: str | None = None) -> web.Response:
        return web.json_response({"toy_error": {"message": message, "field": field}}, status=status)

    async def whoami(self, request: web.Request) -> web.Response:
        return web.json_response({"name": request[PRINCIPAL].name})

    async def echo(self, request: web.Request) -> web.Response:
        return web.Response(body=await request.read())

    async def missing(self, request: web.Request) -> web.Response:
        raise not_found("run 'x'")

    async def bad(self, request: web.Request) -> web.Response:
        raise invalid_argument("temperature", "must be >= 0")

    async def broken(self, request: web.Request) -> web.Response:
        raise KeyError("secret internals")

    async def hold(self, request: web.Request) -> web.Response:
        await self.release.wait()
        return web.json_response({})


def token_store(tmp_path: Path) -> TokenStore:
    files = {}
    for role, token in ((Role.USER, TOKEN), (Role.ADMIN, ADMIN)):
        files[role] = tmp_path / f"{role.name.lower()}.token"
        files[role].write_text(token + "\n")
        files[role].chmod(0o600)
    return TokenStore(files)


def test_the_listener_resolves_limits_bounds_and_maps_errors_in_the_apis_shape(tmp_path):
    async def scenario():
        toy = Toy()
        runner = await start_http(HttpConfig("127.0.0.1", 0, token_store(tmp_path),
                                             CallerLimits(max_calls_in_flight=2)), [toy])
        port = runner.addresses[0][1]
        url = f"http://127.0.0.1:{port}/toy"
        key = {"X-Toy-Key": TOKEN}
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{url}/whoami") as resp:
                assert resp.status == 401 and "API key" in (await resp.json())["toy_error"]["message"]
            async with http.get(f"{url}/whoami", headers={"X-Toy-Key": "wrong"}) as resp:
                assert resp.status == 401
            async with http.get(f"{url}/whoami", headers=key) as resp:
                assert resp.status == 200 and await resp.json() == {"name": "user"}
            async with http.post(f"{url}/echo", headers=key, data=b"x" * 1025) as resp:
                assert resp.status == 413 and "at most 1024" in (await resp.json())["toy_error"]["message"]
            async with http.post(f"{url}/echo", headers=key, data=b"x" * 10) as resp:
                assert await resp.read() == b"x" * 10
            async with http.get(f"{url}/missing", headers=key) as resp:
                assert resp.status == 404 and (await resp.json())["toy_error"]["message"] == "run 'x'"
            async with http.get(f"{url}/bad", headers=key) as resp:
                assert resp.status == 400 and "temperature" in (await resp.json())["toy_error"]["message"]
            async with http.get(f"{url}/broken", headers=key) as resp:
                body = json.dumps(await resp.json())
                assert resp.status == 500 and "KeyError" in body and "secret internals" not in body
            async with http.get(f"{url}/nowhere", headers=key) as resp:
                assert resp.status == 404 and "not a route" in (await resp.json())["toy_error"]["message"]
            # Two calls in flight take the caller's slots; a third is refused, another caller is not.
            held = [asyncio.create_task(http.get(f"{url}/hold", headers=key)) for _ in range(2)]
            await asyncio.sleep(0.2)
            async with http.get(f"{url}/whoami", headers=key) as resp:
                assert resp.status == 429 and "max_calls_in_flight" in (await resp.json())["toy_error"]["message"]
            async with http.get(f"{url}/whoami", headers={"X-Toy-Key": ADMIN}) as resp:
                assert resp.status == 200 and await resp.json() == {"name": "admin"}
            async with http.get(f"{url}/beat", headers=key) as resp:  # liveness takes no slot
                assert resp.status == 200
            toy.release.set()
            for task in held:
                (await task).release()
            async with http.get(f"{url}/whoami", headers=key) as resp:
                assert resp.status == 200
        await runner.cleanup()

    asyncio.run(scenario())


def test_the_listener_binds_the_host_it_is_given():
    async def scenario():
        runner = await start_http(HttpConfig("127.0.0.1", 0, None, CallerLimits()), [Toy()])
        host, _ = runner.addresses[0][:2]
        assert host == "127.0.0.1"
        await runner.cleanup()

    asyncio.run(scenario())


def test_without_authentication_every_caller_is_the_system_principal():
    async def scenario():
        runner = await start_http(HttpConfig("127.0.0.1", 0, None, CallerLimits()), [Toy()])
        port = runner.addresses[0][1]
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/toy/whoami") as resp:
                assert await resp.json() == {"name": "system"}
        await runner.cleanup()

    asyncio.run(scenario())


def test_a_liveness_route_takes_no_slot_but_counts_against_the_rate(tmp_path):
    async def scenario():
        toy = Toy()
        runner = await start_http(HttpConfig("127.0.0.1", 0, token_store(tmp_path),
                                             CallerLimits(max_calls_in_flight=1, calls_per_s=0.01, call_burst=3)),
                                  [toy])
        url = f"http://127.0.0.1:{runner.addresses[0][1]}/toy"
        key = {"X-Toy-Key": TOKEN}
        async with aiohttp.ClientSession() as http:
            held = asyncio.create_task(http.get(f"{url}/hold", headers=key))
            await asyncio.sleep(0.2)
            statuses = []
            for _ in range(3):
                async with http.get(f"{url}/beat", headers=key) as resp:
                    statuses.append((resp.status, (await resp.json()).get("toy_error", {}).get("message", "")))
            assert [s for s, _ in statuses] == [200, 200, 429] and "calls_per_s" in statuses[2][1]
            toy.release.set()
            (await held).release()
        await runner.cleanup()

    asyncio.run(scenario())
