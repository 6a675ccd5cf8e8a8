"""kit.py (config parsing, user errors, atomic writes) and runs.py's reproducible tarballs and handoff check.

The handoff tests start from a tarball that verifies, then change one thing, so each refusal can
only come from the check it is named for.
"""
import contextlib
import dataclasses
import hashlib
import io
import json
import sys
import tarfile

import pytest

from dpokit.core import kit
from dpokit.core import runs
from dpokit.core.kit import UserError, field
from dpokit.core.runs import file_hashes, make_tarball, unsafe_member, verify_tarball  # the handoff's code under test


@dataclasses.dataclass
class Cfg:
    name: str = field("x", "a name")
    steps: int = field(3, "steps")
    rate: float = field(0.5, "rate")
    flag: bool = field(True, "a flag")
    mode: str = field("a", "mode", choices=("a", "b"))

    def problems(self):
        return [f"--steps must be positive (got {self.steps})"] * (self.steps < 1) + \
               [f"--rate must be below 1 (got {self.rate})"] * (self.rate >= 1)


def test_defaults_come_from_the_dataclass():
    assert kit.parse_config(Cfg, [], "d") == Cfg()


def test_flags_override_config_file_which_overrides_defaults(tmp_path):
    conf = tmp_path / "run.yaml"
    conf.write_text("steps: 7\nrate: 0.25\nflag: false\n")
    cfg = kit.parse_config(Cfg, ["--config", str(conf), "--steps", "9"], "d")
    assert (cfg.steps, cfg.rate, cfg.flag) == (9, 0.25, False)


@pytest.mark.parametrize("argv,expected", [(["--flag"], True), (["--flag", "false"], False),
                                           (["--no_flag"], False), (["--flag", "yes"], True)])
def test_bool_flags(argv, expected):
    assert kit.parse_config(Cfg, argv, "d").flag is expected


def test_unknown_flag_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        kit.parse_config(Cfg, ["--stepz", "3"], "d")
    assert e.value.code == 2
    assert "--stepz" in capsys.readouterr().err


def test_unknown_key_in_config_file_names_the_file(tmp_path):
    conf = tmp_path / "run.yaml"
    conf.write_text("stepz: 3\n")
    with pytest.raises(UserError, match="unknown option.*stepz") as e:
        kit.parse_config(Cfg, ["--config", str(conf)], "d")
    assert str(e.value).startswith(f"{conf}:")


def test_bad_yaml_reports_the_line(tmp_path):
    conf = tmp_path / "run.yaml"
    conf.write_text("steps: 3\nrate: [1,\n")
    with pytest.raises(UserError) as e:
        kit.parse_config(Cfg, ["--config", str(conf)], "d")
    assert e.value.path == str(conf) and e.value.line is not None


def test_all_problems_are_reported_at_once():
    with pytest.raises(UserError) as e:
        kit.parse_config(Cfg, ["--steps", "0", "--rate", "2"], "d")
    assert "--steps must be positive" in str(e.value) and "--rate must be below 1" in str(e.value)


def test_choices_are_enforced_in_files_too(tmp_path):
    conf = tmp_path / "run.yaml"
    conf.write_text("mode: c\n")
    with pytest.raises(UserError, match="not one of a, b"):
        kit.parse_config(Cfg, ["--config", str(conf)], "d")


def test_run_cli_turns_user_error_into_exit_2(capsys):
    def main(argv):
        raise UserError("chosen is identical to rejected", "pairs.jsonl", 7)

    assert kit.run_cli(main, []) == 2
    assert capsys.readouterr().err.strip() == "pairs.jsonl:7: chosen is identical to rejected"


def test_atomic_write_leaves_no_temp_files_and_normal_mode(tmp_path):
    target = tmp_path / "sub" / "out.json"
    kit.atomic_write_json(target, {"a": 1})
    assert target.read_text() == '{\n  "a": 1\n}\n'
    assert [p.name for p in target.parent.iterdir()] == ["out.json"]
    assert target.stat().st_mode & 0o044  # readable by others, like open() would make it


def test_tarball_is_reproducible_and_carries_a_checksum(tmp_path):
    run = tmp_path / "run1"
    (run / "d").mkdir(parents=True)
    (run / "a.txt").write_text("alpha")
    (run / "d" / "b.bin").write_bytes(b"\x00\x01")
    d1 = make_tarball(run, tmp_path / "one.tar.gz")
    (run / "a.txt").touch()  # a new mtime must not change the bytes
    d2 = make_tarball(run, tmp_path / "two.tar.gz")
    assert d1 == d2 == hashlib.sha256((tmp_path / "one.tar.gz").read_bytes()).hexdigest()
    assert (tmp_path / "one.tar.gz.sha256").read_text() == f"{d1}  one.tar.gz\n"
    with tarfile.open(tmp_path / "one.tar.gz") as tar:
        assert tar.getnames() == ["run1", "run1/a.txt", "run1/d", "run1/d/b.bin"]
        assert {m.uid for m in tar.getmembers()} == {0}


def test_file_hashes_skip_the_manifest(tmp_path):
    (tmp_path / "x").write_text("x")
    (tmp_path / "manifest.json").write_text("{}")
    assert file_hashes(tmp_path) == {"x": hashlib.sha256(b"x").hexdigest()}


# ---------------------------------------------------------------------------------------------
# The handoff: a tarball that verifies, then one thing wrong with it at a time.
# ---------------------------------------------------------------------------------------------

ADAPTER_CONFIG = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def fake_run(tmp_path, adapter_config=ADAPTER_CONFIG, **manifest):
    """A run directory shaped like train_dpo's output, its manifest listing every file; no model needed."""
    run = tmp_path / "src" / "run1"
    run.mkdir(parents=True)
    (run / "adapter_model.safetensors").write_bytes(bytes(range(256)) * 4)  # any bytes: verify only hashes them
    (run / "README.md").write_text("# run1\n")
    if adapter_config is not None:
        (run / "adapter_config.json").write_text(json.dumps(adapter_config))
    manifest = {"run_name": "run1", "steps": 2, "seed": 1, "base_model": {"name_or_path": "m"},
                "data": {"sha256": "ab", "format": "openai", "pairs": 3}, "lora_target_modules_requested": "auto",
                **manifest, "files": file_hashes(run)}
    (run / "manifest.json").write_text(json.dumps(manifest))
    return run


def valid_tarball(tmp_path, **kw):
    """fake_run packed by make_tarball, .sha256 beside it: what a finished training run hands off."""
    make_tarball(fake_run(tmp_path, **kw), tmp_path / "run1.tar.gz")
    return tmp_path / "run1.tar.gz"


def repack(good, dest, add=(), drop=()):
    """good's members but those named in drop, then the (TarInfo, bytes) pairs in add; no .sha256 file."""
    with tarfile.open(good) as src, tarfile.open(dest, "w:gz") as out:
        for m in src.getmembers():
            if m.name not in drop:
                out.addfile(m, src.extractfile(m) if m.isfile() else None)
        for info, data in add:
            out.addfile(info, None if data is None else io.BytesIO(data))
    return dest


def member(name, type=tarfile.REGTYPE, data=b"pwned", **attrs):
    info = tarfile.TarInfo(name)
    info.type = type
    for k, v in attrs.items():
        setattr(info, k, v)
    info.size = len(data) if info.isfile() else 0
    return info, data if info.isfile() else None


def refusal(path, **kw) -> str:
    with pytest.raises(UserError) as e:
        verify_tarball(path, **kw)
    return e.value.message


def snapshot(root):
    """Every path below root, with its bytes (files) or its target (links): to show nothing changed."""
    return sorted((str(p.relative_to(root)), p.is_symlink() and str(p.readlink()),
                   p.is_file() and not p.is_symlink() and p.read_bytes()) for p in root.rglob("*"))


def test_a_valid_tarball_verifies_and_describes_itself(tmp_path):
    good = valid_tarball(tmp_path)
    manifest = verify_tarball(good, extract_to=tmp_path / "x")
    assert sorted(manifest["files"]) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    assert file_hashes(tmp_path / "x" / "run1") == manifest["files"] and manifest["serving_warnings"] == []
    text = runs.describe_run(manifest)
    assert "LoRA r=4 alpha=8 on q_proj, v_proj" in text and "3 pairs, openai, sha256 ab" in text
    verify_tarball(repack(good, tmp_path / "same.tar.gz"))  # repacking alone changes nothing verify cares about


@pytest.mark.parametrize("name,type,expected", [
    ("run1/adapter_model.safetensors", tarfile.REGTYPE, None),
    ("run1/sub", tarfile.DIRTYPE, None),
    ("run1/./a", tarfile.REGTYPE, None),
    ("/etc/passwd", tarfile.REGTYPE, "absolute path '/etc/passwd'"),
    ("\\evil", tarfile.REGTYPE, "absolute path '\\\\evil'"),
    ("C:/evil", tarfile.REGTYPE, "absolute path 'C:/evil'"),
    ("run1/a/../../b", tarfile.REGTYPE, "path with '..' 'run1/a/../../b'"),
    ("run1/a\x00b", tarfile.REGTYPE, "NUL byte in the name 'run1/a\\x00b'"),  # open() raised ValueError
    (".", tarfile.DIRTYPE, None), ("./", tarfile.DIRTYPE, None),  # the top of an archive packed from inside
    ("run1/l", tarfile.SYMTYPE, "link 'run1/l' -> 'target'"),
    ("run1/l", tarfile.LNKTYPE, "link 'run1/l' -> 'target'"),
    ("run1/d", tarfile.CHRTYPE, "special file 'run1/d'"),
    ("run1/d", tarfile.BLKTYPE, "special file 'run1/d'"),
    ("run1/d", tarfile.FIFOTYPE, "special file 'run1/d'"),
    ("run2/a", tarfile.REGTYPE, "'run2/a' is outside the run directory 'run1'"),
    ("run1x/a", tarfile.REGTYPE, "'run1x/a' is outside the run directory 'run1'"),
])
def test_unsafe_member_names_the_reason(name, type, expected):
    info, _ = member(name, type, linkname="target")
    assert unsafe_member(info, "run1") == expected


BAD_MEMBERS = ["absolute path", "dotdot", "symlink", "hardlink", "chardev", "blockdev", "fifo", "outside"]


def bad_members(kind, tmp):
    """Entries to append to a valid archive, the reason verify must give, and where the bad member
    would land if it were extracted as written into tmp/x."""
    x = tmp / "x"
    if kind == "absolute path":
        return [member(str(tmp / "abs-escape.txt"))], "absolute path", tmp / "abs-escape.txt"
    if kind == "dotdot":  # starts inside the run directory, so only the '..' check can stop it
        return [member("run1/../../escape.txt")], "path with '..'", tmp / "escape.txt"
    if kind == "symlink":  # a link out, then a file written through it
        return ([member("run1/sub", tarfile.SYMTYPE, linkname=str(tmp / "outside")), member("run1/sub/escape.txt")],
                "link 'run1/sub'", tmp / "outside" / "escape.txt")
    if kind == "hardlink":  # a link to a file outside, then bytes written over it
        (tmp / "secret.txt").write_bytes(b"secret")  # snapshot() shows it unchanged afterwards
        return ([member("run1/hard", tarfile.LNKTYPE, linkname=str(tmp / "secret.txt")), member("run1/hard")],
                "link 'run1/hard'", x / "run1" / "hard")
    if kind in ("chardev", "blockdev", "fifo"):
        type = {"chardev": tarfile.CHRTYPE, "blockdev": tarfile.BLKTYPE, "fifo": tarfile.FIFOTYPE}[kind]
        return [member("run1/dev", type, devmajor=1, devminor=3)], "special file 'run1/dev'", x / "run1" / "dev"
    assert kind == "outside"
    return ([member("other/escape.txt")], "'other/escape.txt' is outside the run directory 'run1'",
            x / "other" / "escape.txt")


@pytest.mark.parametrize("kind", BAD_MEMBERS)
def test_verify_refuses_an_unsafe_member_and_writes_nothing(tmp_path, kind):
    entries, reason, landing = bad_members(kind, tmp_path)
    evil = repack(valid_tarball(tmp_path), tmp_path / "evil.tar.gz", add=entries)
    before = snapshot(tmp_path)
    message = refusal(evil, extract_to=tmp_path / "x")
    assert message.startswith("refused: ") and reason in message
    assert not landing.exists() and not landing.is_symlink()
    assert not (tmp_path / "x").exists() and snapshot(tmp_path) == before


@pytest.mark.parametrize("kind", ["absolute path", "dotdot", "outside"])
def test_with_the_member_check_off_the_escape_lands_where_the_test_looks(tmp_path, monkeypatch, kind):
    """Proves the test above looks in the right place: without unsafe_member, the bytes land there."""
    monkeypatch.setattr(sys.modules[verify_tarball.__module__], "unsafe_member", lambda m, top: None)
    entries, _, landing = bad_members(kind, tmp_path)
    evil = repack(valid_tarball(tmp_path), tmp_path / "evil.tar.gz", add=entries)
    with contextlib.suppress(UserError):  # whether verify then refuses does not matter here
        verify_tarball(evil, extract_to=tmp_path / "x")
    assert landing.read_bytes() == b"pwned"


def test_verify_refuses_an_archive_without_a_run_directory(tmp_path):
    good = valid_tarball(tmp_path)
    with tarfile.open(good) as tar:
        empty = repack(good, tmp_path / "empty.tar.gz", drop=set(tar.getnames()))
    assert refusal(empty) == "refused: the archive does not start with the run's directory"


@pytest.mark.parametrize("arcname", [".", "./", ""])
def test_a_tarball_packed_from_inside_its_folder_verifies(tmp_path, arcname):
    """`tar -C run1 -czf dot.tar.gz .` (first member '.', then './manifest.json', ...): what a receiver who
    unpacked and packed again hands on. The run's name comes from manifest.json."""
    run = fake_run(tmp_path)
    with tarfile.open(tmp_path / "dot.tar.gz", "w:gz") as tar:
        if arcname == "":  # no '.' member: the files alone, as `tar -czf x.tar.gz *` packs them
            for f in sorted(run.iterdir()):
                tar.add(f, arcname=f.name)
        else:
            tar.add(run, arcname=arcname)
    manifest = verify_tarball(tmp_path / "dot.tar.gz", extract_to=tmp_path / "x")
    assert manifest["run_name"] == "run1" and file_hashes(tmp_path / "x" / "run1") == manifest["files"]
    (run / "README.md").write_text("changed\n")  # and its files are still checked against the manifest
    with tarfile.open(tmp_path / "bad.tar.gz", "w:gz") as tar:
        tar.add(run, arcname=".")
    assert "README.md: sha256 differs from manifest.json" in refusal(tmp_path / "bad.tar.gz")


@pytest.mark.parametrize("run_name", [None, "", "../up", ".hidden", "a/b", 7])
def test_a_flat_tarball_needs_a_plain_run_name(tmp_path, run_name):
    run = fake_run(tmp_path, run_name=run_name)
    with tarfile.open(tmp_path / "dot.tar.gz", "w:gz") as tar:
        tar.add(run, arcname=".")
    assert "manifest.json names no run" in refusal(tmp_path / "dot.tar.gz")


@pytest.mark.parametrize("name", ["run1/README.md/x", "run1"])
def test_verify_refuses_members_that_clash(tmp_path, name):
    t = repack(valid_tarball(tmp_path), tmp_path / "t.tar.gz", add=[member(name)])  # under a file; over a directory
    assert refusal(t) == f"refused: {name!r} clashes with an earlier member"


def test_verify_extracts_only_into_a_fresh_run_directory(tmp_path):
    """One already in extract_to could stand in for a file the archive lacks, or be a link out."""
    good, x, y = valid_tarball(tmp_path), tmp_path / "x", tmp_path / "y"
    verify_tarball(good, extract_to=x)  # leaves x/run1 with every file in it
    lacking = repack(good, tmp_path / "t.tar.gz", drop={"run1/README.md"})
    assert refusal(lacking, extract_to=x) == f"{x / 'run1'} already exists; extract into a new directory"
    y.mkdir()
    (tmp_path / "outside").mkdir()
    (y / "run1").symlink_to(tmp_path / "outside")
    assert refusal(good, extract_to=y) == f"{y / 'run1'} already exists; extract into a new directory"
    assert list((tmp_path / "outside").iterdir()) == []


def test_verify_refuses_a_file_whose_bytes_differ_from_the_manifest(tmp_path):
    run = fake_run(tmp_path)
    data = bytearray((run / "adapter_model.safetensors").read_bytes())
    data[10] ^= 1
    (run / "adapter_model.safetensors").write_bytes(bytes(data))
    make_tarball(run, tmp_path / "t.tar.gz")  # a fresh .sha256: the archive is intact, a file in it is not
    assert refusal(tmp_path / "t.tar.gz") == \
        "refused:\n  - adapter_model.safetensors: sha256 differs from manifest.json"


def test_verify_refuses_a_listed_file_that_is_missing(tmp_path):
    t = repack(valid_tarball(tmp_path), tmp_path / "t.tar.gz", drop={"run1/README.md"})
    assert refusal(t) == "refused:\n  - README.md: listed in manifest.json but missing"


@pytest.mark.parametrize("name", ["extra.bin", "sub/.hidden"])
def test_verify_refuses_a_file_the_manifest_does_not_list(tmp_path, name):
    t = repack(valid_tarball(tmp_path), tmp_path / "t.tar.gz", add=[member(f"run1/{name}")])
    assert refusal(t) == f"refused:\n  - {name}: present but not in manifest.json"


def test_verify_refuses_a_run_without_adapter_config(tmp_path):
    t = valid_tarball(tmp_path, adapter_config=None)  # the manifest agrees; only the file itself is missing
    assert refusal(t) == "refused:\n  - adapter_config.json is missing"


@pytest.mark.parametrize("run_name", ["/etc", "../run0", "run2", None])
def test_verify_refuses_a_manifest_that_names_another_run(tmp_path, run_name):
    """open_run finds the unpacked run by manifest["run_name"]: it must name the directory verify checked."""
    t = valid_tarball(tmp_path, run_name=run_name)
    assert refusal(t) == f"refused:\n  - manifest.json names run {run_name!r}, but the archive holds 'run1'"


def test_verify_refuses_a_run_without_manifest(tmp_path):
    t = repack(valid_tarball(tmp_path), tmp_path / "t.tar.gz", drop={"run1/manifest.json"})
    assert refusal(t).startswith("no readable manifest.json in the run directory")


def test_verify_checks_the_sha256_file_beside_the_tarball(tmp_path):
    good = valid_tarball(tmp_path)
    sidecar = tmp_path / "run1.tar.gz.sha256"
    digest, name = sidecar.read_text().split()
    sidecar.write_text(f"{digest[::-1]}  {name}\n")  # the .sha256 damaged, the archive intact
    assert refusal(good) == "tarball sha256 differs from run1.tar.gz.sha256"
    sidecar.write_text(f"{digest}  {name}\n")
    raw = bytearray(good.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # the archive damaged, the .sha256 intact
    good.write_bytes(bytes(raw))
    assert refusal(good) == "tarball sha256 differs from run1.tar.gz.sha256"


@pytest.mark.parametrize("damage", ["not gzip", "half", "empty file", "no trailer", "crc"])
def test_verify_refuses_a_damaged_gzip_stream(tmp_path, damage):
    good = valid_tarball(tmp_path)
    (tmp_path / "run1.tar.gz.sha256").unlink()  # without it, the gzip stream itself must give the damage away
    raw = good.read_bytes()
    crc = bytes([raw[-8] ^ 1]) + raw[-7:]  # gzip ends with CRC32 and length (8 bytes), after the tar's last block
    good.write_bytes({"not gzip": b"PK\x03\x04" + raw[4:], "half": raw[:len(raw) // 2], "empty file": b"",
                      "no trailer": raw[:-8], "crc": raw[:-8] + crc}[damage])
    assert refusal(good).startswith("not a readable .tar.gz: ")


SERVING_PROBLEMS = [
    pytest.param({"modules_to_save": ["score"]}, "modules_to_save is set (['score']); vLLM rejects it",
                 id="modules_to_save"),
    pytest.param({"target_modules": ["q_proj", "lm_head"]},
                 "LoRA on 'lm_head' (embeddings or output head); vLLM does not serve that", id="lm_head"),
    pytest.param({"target_modules": ["q_proj", "embed_tokens"]},
                 "LoRA on 'embed_tokens' (embeddings or output head); vLLM does not serve that", id="embed_tokens"),
]


def test_serving_rules():
    ok = {"peft_type": "LORA", "target_modules": ["q_proj"], "modules_to_save": None}
    assert runs.serving_problems(ok) == []
    bad = {"peft_type": "LORA", "target_modules": ["q_proj", "lm_head", "embed_tokens"], "modules_to_save": ["score"]}
    assert len(runs.serving_problems(bad)) == 3


@pytest.mark.parametrize("change,problem", SERVING_PROBLEMS)
def test_serving_rules_refuse_modules_the_trainer_chose_itself(tmp_path, change, problem):
    t = valid_tarball(tmp_path, adapter_config={**ADAPTER_CONFIG, **change})  # lora_target_modules_requested: auto
    assert refusal(t) == f"refused (serving rules):\n  - {problem}"


@pytest.mark.parametrize("change,problem", SERVING_PROBLEMS)
def test_serving_rules_only_warn_about_modules_the_user_asked_for(tmp_path, change, problem):
    t = valid_tarball(tmp_path, adapter_config={**ADAPTER_CONFIG, **change},
                      lora_target_modules_requested="q_proj,v_proj,lm_head,embed_tokens")
    assert verify_tarball(t)["serving_warnings"] == [problem]


def test_open_run_names_what_a_foreign_config_lacks(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    (run / "adapter_config.json").write_text("{}")
    (run / "config.json").write_text('{"model_name_or_path": "m"}')
    with pytest.raises(UserError) as e:
        runs.open_run(run, tmp_path / "work")
    assert str(e.value).startswith(f"{run / 'config.json'}: config.json is not a train_dpo.py run's (no load_in_4bit,")


# ---------------------------------------------------------------------------------------------
# No archive ends in a traceback: random members added to a good run, packed either way, damaged (hypothesis).
# ---------------------------------------------------------------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

EXTRA_MEMBERS = st.one_of(
    st.sampled_from([(".", tarfile.DIRTYPE), ("./", tarfile.DIRTYPE), (".", tarfile.REGTYPE), ("..", tarfile.DIRTYPE),
                     ("TOP/README.md", tarfile.REGTYPE), ("TOP/manifest.json", tarfile.REGTYPE),
                     ("TOP/adapter_config.json", tarfile.REGTYPE), ("TOP/README.md/x", tarfile.REGTYPE),
                     ("TOP/README.md", tarfile.DIRTYPE), ("TOP", tarfile.REGTYPE), ("TOP/l", tarfile.SYMTYPE),
                     ("TOP/h", tarfile.LNKTYPE), ("TOP/f", tarfile.FIFOTYPE), ("TOP/../../escape", tarfile.REGTYPE),
                     ("ABS/abs-escape", tarfile.REGTYPE), ("TOP/" + "n" * 300, tarfile.REGTYPE),
                     ("TOP/" + "/".join(["d"] * 200), tarfile.REGTYPE), ("run2/x", tarfile.REGTYPE),
                     ("manifest.json", tarfile.REGTYPE), ("./manifest.json", tarfile.REGTYPE)]),
    st.tuples(st.text(max_size=12).map(lambda t: "TOP/" + t), st.sampled_from([tarfile.REGTYPE, tarfile.DIRTYPE])))
MEMBER_DATA = st.sampled_from([b"", b"pwned", b"{}", b"[]", b'{"run_name": "run1", "files": []}',
                               b'{"run_name": "../x"}', b"\xff\xfe", b"[" * 5000])


@settings(max_examples=80)
@given(flat=st.booleans(), extra=st.lists(st.tuples(EXTRA_MEMBERS, MEMBER_DATA), max_size=4),
       damage=st.sampled_from(["none", "none", "cut", "flip"]), where=st.integers(0, 10 ** 6))
def test_no_archive_ends_in_a_traceback(flat, extra, damage, where):
    """verify gives the manifest or `refused`/`not readable` naming the archive; whatever the members, nothing
    lands outside the directory it extracts into."""
    import gzip
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        run = fake_run(tmp)
        top = "." if flat else "run1"
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            tar.add(run, arcname=top)
            for (name, kind), data in extra:
                name = name.replace("TOP", top).replace("ABS", str(tmp))
                info, payload = member(name, kind, data, linkname="/etc/passwd")
                tar.addfile(info, None if payload is None else io.BytesIO(payload))
        packed = gzip.compress(buf.getvalue(), mtime=0)
        if damage == "cut":
            packed = packed[:where % len(packed)]
        elif damage == "flip":
            i = where % len(packed)
            packed = packed[:i] + bytes([packed[i] ^ 0x55]) + packed[i + 1:]
        archive = tmp / "run1.tar.gz"
        archive.write_bytes(packed)
        before = snapshot(tmp)
        try:
            manifest = verify_tarball(archive, extract_to=tmp / "x")
            assert manifest["run_name"] == "run1" and file_hashes(tmp / "x" / "run1") == manifest["files"]
        except UserError as e:
            assert e.path == archive and e.line is None and str(e).startswith(f"{archive}:")
        assert [p for p in snapshot(tmp) if not p[0].startswith("x")] == before
        assert not (tmp / "escape").exists() and not (tmp / "abs-escape").exists()


def test_a_finished_run_is_found_again_from_the_same_data_at_another_path_but_not_from_other_data(tmp_path, capsys):
    done = tmp_path / "art" / "r"
    done.mkdir(parents=True)
    (done / "config.json").write_text(json.dumps({"data": "/old/clone/data/runs.jsonl", "beta": 0.1}))
    (done / "data.json").write_text(json.dumps({"sha256": "aa"}))
    run = runs.Run(tmp_path / "art", "r")
    assert run.prepare({"data": "/new/clone/data/runs.jsonl", "beta": 0.1}, "aa") is None
    assert run.state == "succeeded" and "already complete" in capsys.readouterr().out
    with pytest.raises(UserError, match=r"different data, data \(sha256\)"):
        run.prepare({"data": "/new/clone/data/runs.jsonl", "beta": 0.1}, "bb")
    with pytest.raises(UserError, match="different beta; choose another"):
        run.prepare({"data": "/new/clone/data/runs.jsonl", "beta": 0.5}, "aa")
