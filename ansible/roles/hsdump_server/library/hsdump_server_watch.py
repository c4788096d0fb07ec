#!/usr/bin/python
"""Ansible module: watch the hsdump server container for one round (read-only).

Polls ``docker inspect`` (and, on node rank 0, the server's /ready) every ``delay_s`` for up
to ``round_s`` seconds and returns as soon as the container is ready or has failed: exited,
restarting or restarted (a crash loop under ``restart_policy: unless-stopped``), OOM-killed,
or gone. The caller (tasks/wait.yml) runs rounds on every node of a replica at once, so a
failure on any node ends the wait of all of them within a round.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
module: hsdump_server_watch
short_description: Watch the hsdump server container and its /ready endpoint for one round
description:
  - Returns status C(ready), C(waiting) or C(failed), what was found, a hint naming the
    setting to change, and (when failed or I(collect_logs)) the container's last log lines.
options:
  container: {description: Container name., type: str, required: true}
  url: {description: Readiness URL; empty on worker nodes (they have no HTTP server)., type: str, default: ""}
  round_s: {description: Seconds to poll before returning C(waiting)., type: float, default: 15}
  delay_s: {description: Seconds between polls., type: float, default: 2}
  log_lines: {description: Log lines returned., type: int, default: 60}
  collect_logs: {description: Return the log tail whatever the status., type: bool, default: false}
  hints: {description: "List of {pattern, hint}: the first pattern found in the logs or state names the fix.", type: list, elements: dict, default: []}
author: hsdump
"""

RETURN = r"""
status: {description: ready, waiting or failed., type: str, returned: always}
found: {description: What the container and /ready showed, in words., type: str, returned: always}
hint: {description: The setting to change (from I(hints)); empty when none matched., type: str, returned: always}
logs: {description: The last I(log_lines) lines of docker logs., type: str, returned: when failed or collect_logs}
state: {description: The container's State from docker inspect, with RestartCount., type: dict, returned: always}
"""


def inspect(module: AnsibleModule, name: str) -> dict | None:
    """The container's State plus RestartCount, or None when there is no such container."""
    rc, out, _ = module.run_command(
        ["docker", "inspect", "--format", "{{json .State}}|{{.RestartCount}}", name])
    if rc != 0:
        return None
    state_json, _, restarts = out.strip().rpartition("|")
    state = json.loads(state_json)
    state["RestartCount"] = int(restarts or 0)
    return state


def failure(state: dict | None) -> str:
    """Why the container counts as failed, or "" while it may still come up."""
    if state is None:
        return "no such container"
    code = state.get("ExitCode")
    if state.get("OOMKilled"):
        return f"OOM-killed (exit code {code}): the host ran out of memory"
    if state.get("Restarting") or state.get("RestartCount", 0) > 0:
        return (f"crash-looping: restarted {state.get('RestartCount', 0)} time(s), "
                f"last exit code {code}")
    if state.get("Status") in ("exited", "dead"):
        return f"{state.get('Status')} with exit code {code}"
    return ""


def probe(url: str) -> str:
    """"" when /ready answered 200, else the answer in words."""
    try:
        with urllib.request.urlopen(url, timeout=5) as r:  # noqa: S310 - operator's URL
            return "" if r.status == 200 else f"HTTP {r.status}"
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code}"
    except (OSError, ValueError) as e:
        return str(getattr(e, "reason", e))


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "container": {"type": "str", "required": True},
            "url": {"type": "str", "default": ""},
            "round_s": {"type": "float", "default": 15},
            "delay_s": {"type": "float", "default": 2},
            "log_lines": {"type": "int", "default": 60},
            "collect_logs": {"type": "bool", "default": False},
            "hints": {"type": "list", "elements": "dict", "default": []},
        },
        supports_check_mode=True,
    )
    p = module.params
    deadline = time.monotonic() + p["round_s"]
    while True:
        state = inspect(module, p["container"])
        answer = probe(p["url"]) if p["url"] and state and state.get("Running") else "not probed"
        if p["url"] and answer == "":
            status, found = "ready", f"{p['url']} answered 200"
            break
        why = failure(state)
        if why:
            status, found = "failed", f"container {p['container']} {why}"
            break
        found = (f"container {p['container']} {state.get('Status')}"
                 + (f", {p['url']}: {answer}" if p["url"] else " (worker node: no /ready)"))
        status = "waiting"
        if time.monotonic() + p["delay_s"] > deadline:
            break
        time.sleep(p["delay_s"])
    result = {"changed": False, "status": status, "found": found, "hint": "", "state": state or {}}
    if status == "failed" or p["collect_logs"]:
        _, out, err = module.run_command(
            ["docker", "logs", "--tail", str(p["log_lines"]), p["container"]])
        logs = (out + err).rstrip()
        result["logs"] = logs
        haystack = f"{found}\n{logs}"
        result["hint"] = next((h["hint"] for h in p["hints"]
                               if re.search(h["pattern"], haystack, re.IGNORECASE)), "")
    module.exit_json(**result)


if __name__ == "__main__":
    main()
