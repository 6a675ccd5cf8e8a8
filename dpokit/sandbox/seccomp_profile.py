"""The seccomp profile the kit's image runs under Docker with: Docker's own default profile, plus the few calls
bubblewrap needs to give model-written code namespaces of its own (sandbox.py's bwrap mode).

    python seccomp_profile.py DOCKER_DEFAULT.json -o seccomp.json    # what the Dockerfile does (below)
    python seccomp_profile.py --added seccomp.json DOCKER_DEFAULT.json  # what one allows that the other does not

Docker's default profile lets a container create namespaces (clone with CLONE_NEW* flags, unshare, setns) and
mount (mount, umount2, pivot_root) only when it holds CAP_SYS_ADMIN, which a `docker run` without --privileged does
not. Without them bubblewrap cannot start, and the sandbox falls to `limits` mode: model-written code then runs
without a mount namespace, and the checker cannot score an answer that names a host path (watch.py). This profile
allows exactly those six calls to any process of the container (and Landlock's three, where an older distribution's
copy of the default lacks them: confine.py needs them in every mode), and changes nothing else. The kernel still checks
every one of them: an unprivileged process gets the capabilities to mount only inside a user namespace of its own,
over its own mounts (user_namespaces(7)); the container's capabilities and Docker's other rules are unchanged.

The default profile is not copied into this repository: the image's build takes it from the distribution's own
package of Docker's source (golang-github-docker-docker-dev, profiles/seccomp/default.json; the version Ubuntu or
Debian ships) and runs this script on it, so the image carries /opt/kit/seccomp.json and launcher.py passes it to
`docker run --security-opt seccomp=...` (docs/container.md). Standard library only.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

BWRAP = ("clone", "unshare", "setns", "mount", "umount2", "pivot_root")  # what bubblewrap calls to set up its sandbox
# confine.py's Landlock: in Docker's default since 2022 (moby#43199), added here where an older distribution's is not
LANDLOCK = ("landlock_create_ruleset", "landlock_add_rule", "landlock_restrict_self")
IN_IMAGE = "/opt/kit/seccomp.json"
COMMENT = ("dpo-kit: bubblewrap's namespaces and mounts for model-written code (sandbox.py), without CAP_SYS_ADMIN; "
           "the kernel checks each (user_namespaces(7))")


def unconditional(rule: dict) -> bool:
    """A rule that applies to every container: no argument filter, no capability, architecture or kernel
    condition."""
    return not rule.get("args") and not any(rule.get("includes") or {}) and not any(rule.get("excludes") or {})


def allowed(profile: dict) -> set[str]:
    """The calls a profile allows any container to make, whatever their arguments."""
    return {n for r in profile.get("syscalls", []) if r.get("action") == "SCMP_ACT_ALLOW" and unconditional(r)
            for n in r.get("names", [])}


def kit_profile(default: dict) -> dict:
    """Docker's default profile, with BWRAP allowed to every container. Docker's rules that allow `clone` only for
    some flags (a filter on its first argument) go: the new rule allows every clone, and libseccomp refuses two
    rules of one action for one call where one has a filter and the other none."""
    if default.get("defaultAction") != "SCMP_ACT_ERRNO" or not isinstance(default.get("syscalls"), list):
        raise ValueError("not Docker's default profile: it allows by default, or lists no syscalls")
    out = copy.deepcopy(default)
    out["syscalls"] = [r for r in out["syscalls"]
                       if not (r.get("action") == "SCMP_ACT_ALLOW" and r.get("args") and set(r.get("names", [])) <= {"clone"})]
    names = list(BWRAP) + [n for n in LANDLOCK if n not in allowed(default)]
    out["syscalls"].append({"names": names, "action": "SCMP_ACT_ALLOW", "args": [], "comment": COMMENT,
                            "includes": {}, "excludes": {}})
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("default", help="Docker's default profile (profiles/seccomp/default.json)")
    parser.add_argument("-o", "--output", help="write the kit's profile here")
    parser.add_argument("--added", metavar="PROFILE", help="print what PROFILE allows any container that the default "
                                                          "does not (JSON), and exit")
    args = parser.parse_args(argv)
    try:
        default = json.loads(Path(args.default).read_text())
        if args.added:
            print(json.dumps(sorted(allowed(json.loads(Path(args.added).read_text())) - allowed(default))))
            return 0
        profile = kit_profile(default)
    except (OSError, ValueError) as e:
        print(f"{args.default}: {e}", file=sys.stderr)
        return 2
    text = json.dumps(profile, indent=1) + "\n"
    if args.output:
        tmp = Path(args.output + ".partial")
        tmp.write_text(text)
        tmp.replace(args.output)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
