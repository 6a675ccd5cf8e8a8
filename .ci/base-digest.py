#!/usr/bin/env python3
"""Pin the Dockerfile's base image to the digest its tag points at now, and say what changed.

    python3 .ci/base-digest.py [Dockerfile]        # or: make base-digest

Reads `ARG BASE_IMAGE=name:tag[@sha256:...]`, asks the registry for the tag's current digest with the first of
these found: `docker buildx imagetools inspect`, `skopeo inspect --raw` (the digest is the sha256 of those exact
bytes) or `crane digest`. It is the digest of the multi-platform index, so the pin holds on every platform. (`docker
manifest inspect` is not used: it prints the manifest re-formatted, whose sha256 is not the digest.) Then rewrites
the line as `name:tag@sha256:...`: the tag stays for readers, the digest decides what is pulled.

Prints the digest before and after and, when it moved, what changed in linux/amd64's image: NVIDIA_REQUIRE_CUDA
(the driver floor `docker run` enforces: NVIDIA has re-pushed tags with higher ones), CUDA_VERSION and the creation
date. Exit status 0 when the line is pinned (changed or not), 2 when no tool is here, the registry does not answer,
or the Dockerfile has no such line. Standard library only.
"""

import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

ARG_LINE = re.compile(r"^ARG BASE_IMAGE=(?P<name>[^\s@]+)(?:@(?P<digest>sha256:[0-9a-f]{64}))?\s*$", re.MULTILINE)
WATCHED = ("NVIDIA_REQUIRE_CUDA", "CUDA_VERSION", "NV_CUDA_CUDART_VERSION")  # the image's env worth naming
TIMEOUT = 120


class Failure(Exception):
    """One sentence on why no digest could be had; exit status 2."""


# ---------------------------------------------------------------------------------------------
# Pure: the Dockerfile's line, and what changed.
# ---------------------------------------------------------------------------------------------

def base_line(dockerfile: str) -> tuple[str, str | None]:
    """(name:tag, its pinned digest or None) from the Dockerfile's `ARG BASE_IMAGE=` line."""
    m = ARG_LINE.search(dockerfile)
    if not m:
        raise Failure("the Dockerfile has no `ARG BASE_IMAGE=name:tag[@sha256:...]` line to pin")
    return m["name"], m["digest"]


def pinned(dockerfile: str, digest: str) -> str:
    """The Dockerfile with its BASE_IMAGE line pinned to digest (everything else as it was)."""
    return ARG_LINE.sub(lambda m: f"ARG BASE_IMAGE={m['name']}@{digest}", dockerfile, count=1)


def image_env(config: dict) -> dict[str, str]:
    """The watched env of an image config (OCI: {"config": {"Env": [...]}}), and its creation date."""
    env = dict(e.split("=", 1) for e in (config.get("config") or {}).get("Env") or [] if "=" in e)
    out = {k: env[k] for k in WATCHED if k in env}
    if config.get("created"):
        out["created"] = config["created"]
    return out


def repository(name: str) -> str:
    """name:tag without the tag (a registry's :port stays): what a digest is appended to."""
    head, _, last = name.rpartition("/")
    return (head + "/" if head else "") + last.split(":")[0]


def changes(name: str, tool: str, old: str | None, new: str, before: dict, after: dict) -> list[str]:
    """What `make base-digest` prints: the digest, then what the new image says (first pin) or what moved."""
    if old == new:
        return [f"{name}: unchanged, {new} ({tool})"]
    lines = [f"{name} ({tool}): {old or 'pinned by tag only'} -> {new}"]
    for key in sorted(set(before) | set(after), key=lambda k: (k == "created", k)):
        if not old:
            lines.append(f"  {key}: {after[key]}")
        elif before.get(key) != after.get(key):
            lines.append(f"  {key}: {before.get(key, '(not set)')} -> {after.get(key, '(not set)')}")
    return lines


# ---------------------------------------------------------------------------------------------
# Edges: the registry, through whichever client is here.
# ---------------------------------------------------------------------------------------------

def run(cmd: list[str]) -> bytes:
    try:
        done = subprocess.run(cmd, capture_output=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        raise Failure(f"{cmd[0]} did not answer in {TIMEOUT} s: check the network and try again") from None
    if done.returncode != 0:
        lines = [x for x in done.stderr.decode(errors="replace").splitlines() if x.strip()]
        said = lines[0] if lines else f"exit status {done.returncode}"
        raise Failure(f"{' '.join(cmd[:3])} could not read {cmd[-1]} ({said.strip()[:200]}): check the network, "
                      "the name and the tag")
    return done.stdout


def client() -> str:
    """The first registry client here that can answer."""
    if shutil.which("docker") and subprocess.run(["docker", "buildx", "version"], capture_output=True).returncode == 0:
        return "docker buildx"
    for tool in ("skopeo", "crane"):
        if shutil.which(tool):
            return tool
    raise Failure("make base-digest needs docker buildx, skopeo or crane to ask the registry: install one "
                  "(apt-get install skopeo)")


def digest_of(tool: str, ref: str) -> str:
    if tool == "docker buildx":
        index = run(["docker", "buildx", "imagetools", "inspect", "--format", "{{json .Manifest}}", ref])
        return json.loads(index)["digest"]
    if tool == "skopeo":
        return "sha256:" + hashlib.sha256(run(["skopeo", "inspect", "--raw", f"docker://{ref}"])).hexdigest()
    return run(["crane", "digest", ref]).decode().strip()


def config_of(tool: str, ref: str) -> dict:
    """linux/amd64's image config ({} when the client cannot say): only to name what changed."""
    try:
        if tool == "docker buildx":
            out = json.loads(run(["docker", "buildx", "imagetools", "inspect", "--format", "{{json .Image}}", ref]))
            return out.get("linux/amd64", out) if "config" not in out else out
        if tool == "skopeo":
            return json.loads(run(["skopeo", "inspect", "--override-os", "linux", "--override-arch", "amd64",
                                   "--config", f"docker://{ref}"]))
        return json.loads(run(["crane", "config", "--platform", "linux/amd64", ref]))
    except (Failure, ValueError, AttributeError):
        return {}


def main(argv: list[str]) -> int:
    path = Path(argv[0] if argv else "Dockerfile")
    try:
        text = path.read_text()
        name, old = base_line(text)
        tool = client()
        new = digest_of(tool, name)
        if not re.fullmatch(r"sha256:[0-9a-f]{64}", new):
            raise Failure(f"{tool} answered {new[:80]!r} for {name}, not a digest")
        before = image_env(config_of(tool, f"{repository(name)}@{old}")) if old and old != new else {}
        after = image_env(config_of(tool, f"{repository(name)}@{new}")) if old != new else {}
    except Failure as e:
        print(f"error: {e}.", file=sys.stderr)
        return 2
    print("\n".join(changes(name, tool, old, new, before, after)))
    if old != new:
        path.write_text(pinned(text, new))
        print(f"{path}: ARG BASE_IMAGE={name}@{new}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
