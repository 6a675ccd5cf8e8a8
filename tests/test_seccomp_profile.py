"""seccomp_profile.py: the kit's profile is Docker's default plus bubblewrap's six calls, nothing else. On a worked
profile of Docker's shape, and (where Debian's or Ubuntu's package of Docker's source downloads, as the image's
build takes it) on Docker's own. The container smoke (.ci/container-smoke.sh) runs the image under both."""
import json
import shutil
import subprocess

import pytest

from dpokit.sandbox import seccomp_profile

# Docker's shape, small: what every container may call, what only CAP_SYS_ADMIN may, and clone for some flags only.
DOCKERISH = {
    "defaultAction": "SCMP_ACT_ERRNO",
    "archMap": [{"architecture": "SCMP_ARCH_X86_64", "subArchitectures": ["SCMP_ARCH_X86"]}],
    "syscalls": [
        {"names": ["read", "write", "openat", "landlock_create_ruleset"], "action": "SCMP_ACT_ALLOW", "args": []},
        {"names": ["personality"], "action": "SCMP_ACT_ALLOW", "args": [{"index": 0, "value": 8, "op": "SCMP_CMP_EQ"}]},
        {"names": ["mount", "umount2", "unshare", "setns", "clone", "bpf"], "action": "SCMP_ACT_ALLOW", "args": [],
         "includes": {"caps": ["CAP_SYS_ADMIN"]}},
        {"names": ["clone"], "action": "SCMP_ACT_ALLOW",
         "args": [{"index": 0, "value": 2114060288, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ"}],
         "excludes": {"caps": ["CAP_SYS_ADMIN"]}},
        {"names": ["kexec_load"], "action": "SCMP_ACT_ERRNO", "args": []},
    ],
}


def test_the_kit_adds_bubblewraps_calls_to_dockers_default_and_nothing_else():
    kit = seccomp_profile.kit_profile(DOCKERISH)
    assert seccomp_profile.allowed(DOCKERISH) == {"read", "write", "openat", "landlock_create_ruleset"}
    assert seccomp_profile.allowed(kit) - seccomp_profile.allowed(DOCKERISH) == set(seccomp_profile.BWRAP) | {
        "landlock_add_rule", "landlock_restrict_self"}  # an old default with Landlock's first call only
    assert kit["defaultAction"] == "SCMP_ACT_ERRNO" and kit["archMap"] == DOCKERISH["archMap"]
    kept = [r for r in kit["syscalls"] if r.get("comment") != seccomp_profile.COMMENT]
    assert kept == [r for r in DOCKERISH["syscalls"] if r["names"] != ["clone"]]  # only clone's flag filter goes
    assert "bpf" not in seccomp_profile.allowed(kit)  # the rest of CAP_SYS_ADMIN's calls stay its own
    assert DOCKERISH["syscalls"][3]["names"] == ["clone"]  # the input is not changed


def test_a_profile_that_allows_by_default_is_not_taken_for_dockers(tmp_path):
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({"defaultAction": "SCMP_ACT_ALLOW", "syscalls": []}))
    assert seccomp_profile.main([str(bad), "-o", str(tmp_path / "o.json")]) == 2
    assert not (tmp_path / "o.json").exists()


def test_on_dockers_own_default_from_the_distributions_package(tmp_path):
    """The profile the image's build makes, from the same package (Debian's golang-github-docker-docker-dev)."""
    if not shutil.which("apt-get") or not shutil.which("dpkg-deb"):
        pytest.skip("needs apt-get and dpkg-deb (Debian or Ubuntu)")
    got = subprocess.run(["apt-get", "download", "golang-github-docker-docker-dev"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    debs = list(tmp_path.glob("golang-github-docker-docker-dev_*.deb"))
    if got.returncode or not debs:
        pytest.skip(f"apt-get download golang-github-docker-docker-dev failed: {got.stderr.strip()[-200:]}")
    default = subprocess.run(f"dpkg-deb --fsys-tarfile {debs[0]} | tar -xO --wildcards '*/profiles/seccomp/default.json'",
                             shell=True, capture_output=True, check=True).stdout
    (tmp_path / "default.json").write_bytes(default)
    assert seccomp_profile.main([str(tmp_path / "default.json"), "-o", str(tmp_path / "kit.json")]) == 0
    docker, kit = json.loads(default), json.loads((tmp_path / "kit.json").read_text())
    assert not set(seccomp_profile.BWRAP) & seccomp_profile.allowed(docker)  # Docker's keeps them from containers
    assert seccomp_profile.allowed(kit) - seccomp_profile.allowed(docker) <= set(seccomp_profile.BWRAP) | set(
        seccomp_profile.LANDLOCK)
    assert set(seccomp_profile.BWRAP) <= seccomp_profile.allowed(kit)
    assert {"landlock_create_ruleset", "seccomp", "prctl"} <= seccomp_profile.allowed(kit)  # confine.py's calls
