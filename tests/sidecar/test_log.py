"""The sidecar process's log (tba/sidecar/jsonlog.py): once installed, whatever reaches stderr is a
JSON line, from tba, from asyncio, from Python warnings and from uncaught exceptions."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from ._support import REPO, env

PROGRAM = textwrap.dedent(
    """
    import asyncio, logging, threading, warnings
    from tba.sidecar.jsonlog import event, install, loop_exception
    install("INFO")
    event(logging.INFO, "hello", n=1)
    logging.getLogger("asyncio").error("from asyncio", exc_info=ValueError("inner"))
    warnings.warn("a warning", UserWarning)

    async def main():
        asyncio.get_running_loop().set_exception_handler(loop_exception)
        async def boom():
            raise KeyError("in a task")
        task = asyncio.ensure_future(boom())
        await asyncio.sleep(0.01)
        del task  # never awaited: the loop reports its exception when it is collected

    asyncio.run(main())
    t = threading.Thread(target=lambda: 1 / 0, name="worker")
    t.start()
    t.join()
    raise RuntimeError("uncaught in main")
    """
)


def test_everything_on_stderr_is_a_json_line():
    proc = subprocess.run(
        [sys.executable, "-c", PROGRAM], capture_output=True, text=True, env=env(), cwd=REPO
    )
    assert proc.returncode == 1
    records = [json.loads(line) for line in proc.stderr.splitlines()]  # ValueError if not JSON
    by_event = {r["event"]: r for r in records}
    assert by_event["hello"]["n"] == 1
    assert by_event["from asyncio"]["logger"] == "asyncio"
    assert "ValueError: inner" in by_event["from asyncio"]["exception"]
    assert any("a warning" in r["event"] and r["logger"] == "py.warnings" for r in records)
    assert "KeyError: 'in a task'" in by_event["asyncio_error"]["traceback"]
    uncaught = [r for r in records if r["event"] == "uncaught_exception"]
    assert [(r["thread"], r["error"]) for r in uncaught] == [
        ("worker", "ZeroDivisionError('division by zero')"),
        ("MainThread", "RuntimeError('uncaught in main')"),
    ]
    assert all(r["level"] == "critical" for r in uncaught)
