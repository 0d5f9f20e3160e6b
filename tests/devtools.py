"""Drive headless Chromium through the DevTools protocol over a pipe (standard library only).

``--remote-debugging-pipe`` makes Chromium read JSON commands from file descriptor 3 and
write replies and events to 4, each message ending in a NUL byte. Key presses and mouse
clicks sent with ``Input.dispatch*`` are trusted input, as a person's: a focused slider
moves on an arrow key, a focused menu changes, a click lands where the element is drawn.
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import subprocess
import time
from pathlib import Path
from typing import Any

KEYS = {  # key -> (code, Windows virtual key code), as Chromium expects them
    "ArrowLeft": ("ArrowLeft", 37),
    "ArrowUp": ("ArrowUp", 38),
    "ArrowRight": ("ArrowRight", 39),
    "ArrowDown": ("ArrowDown", 40),
    "Enter": ("Enter", 13),
    "Tab": ("Tab", 9),
    " ": ("Space", 32),
}


class Browser:
    """A headless Chromium showing one page, driven by DevTools commands."""

    def __init__(self, chromium: str, flags: list[str], url: str, profile: Path) -> None:
        command_read, command_write = os.pipe()
        reply_read, reply_write = os.pipe()
        # Out of the way of descriptors 3 and 4, which the child gets them as.
        fds = [
            fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
            for fd in (command_read, command_write, reply_read, reply_write)
        ]
        for fd in (command_read, command_write, reply_read, reply_write):
            os.close(fd)
        command_read, command_write, reply_read, reply_write = fds

        def as_3_and_4() -> None:
            os.dup2(command_read, 3)
            os.dup2(reply_write, 4)

        self.process = subprocess.Popen(
            [chromium, *flags, "--remote-debugging-pipe", f"--user-data-dir={profile}", url],
            pass_fds=(3, 4),
            preexec_fn=as_3_and_4,  # noqa: PLW1509 (no threads in the test process here)
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(command_read)
        os.close(reply_write)
        self._write, self._read = command_write, reply_read
        self._id, self._buffer, self._session = 0, b"", ""
        targets = self.call("Target.getTargets")["targetInfos"]
        page = next(t for t in targets if t["type"] == "page")
        attached = self.call("Target.attachToTarget", targetId=page["targetId"], flatten=True)
        self._session = attached["sessionId"]

    def call(self, method: str, **params: Any) -> Any:
        """Send one command and return its result (events in between are dropped)."""
        self._id += 1
        message: dict[str, Any] = {"id": self._id, "method": method, "params": params}
        if self._session and not method.startswith(("Target.", "Browser.")):
            message["sessionId"] = self._session
        os.write(self._write, json.dumps(message).encode() + b"\0")
        while True:
            while b"\0" not in self._buffer:
                ready, _, _ = select.select([self._read], [], [], 60)
                chunk = os.read(self._read, 1 << 16) if ready else b""
                if not chunk:
                    msg = f"Chromium gave no reply to {method}"
                    raise RuntimeError(msg)
                self._buffer += chunk
            raw, self._buffer = self._buffer.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self._id:
                if "error" in reply:
                    msg = f"{method}: {reply['error']}"
                    raise RuntimeError(msg)
                return reply["result"]

    def evaluate(self, expression: str) -> Any:
        """Evaluate JavaScript in the page and return its value (JSON-like)."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            msg = f"{expression!r} raised {result['exceptionDetails']}"
            raise RuntimeError(msg)
        return result["result"].get("value")

    def wait_for(self, expression: str, seconds: float = 30) -> None:
        """Poll until `expression` is true in the page."""
        deadline = time.monotonic() + seconds
        while not self.evaluate(expression):
            if time.monotonic() > deadline:
                msg = f"the page never had {expression}"
                raise TimeoutError(msg)
            time.sleep(0.05)

    def press(self, key: str, times: int = 1) -> None:
        """Press and release a key `times` times, on whatever has the focus."""
        code, virtual = KEYS[key]
        for _ in range(times):
            self.call(
                "Input.dispatchKeyEvent",
                type="keyDown",
                key=key,
                code=code,
                windowsVirtualKeyCode=virtual,
            )
            self.call(
                "Input.dispatchKeyEvent",
                type="keyUp",
                key=key,
                code=code,
                windowsVirtualKeyCode=virtual,
            )

    def click(self, selector: str, index: int = 0) -> None:
        """Click with the mouse in the middle of the `index`-th element matching `selector`."""
        x, y = self.evaluate(
            f"(function () {{ var box = document.querySelectorAll({json.dumps(selector)})"
            f"[{index}].getBoundingClientRect(); "
            "return [box.x + box.width / 2, box.y + box.height / 2]; })()"
        )
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    def close(self) -> None:
        """Close the browser (killing it if it does not go)."""
        try:
            self.call("Browser.close")
            self.process.wait(timeout=30)
        except (RuntimeError, subprocess.TimeoutExpired, OSError):
            self.process.kill()
            self.process.wait()
        finally:
            os.close(self._write)
            os.close(self._read)
