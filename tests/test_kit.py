"""kit.py: config parsing, user errors, atomic writes, reproducible tarballs."""
import dataclasses
import hashlib
import tarfile

import pytest

import kit
import runs
from kit import UserError, field


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
    d1 = runs.make_tarball(run, tmp_path / "one.tar.gz")
    (run / "a.txt").touch()  # a new mtime must not change the bytes
    d2 = runs.make_tarball(run, tmp_path / "two.tar.gz")
    assert d1 == d2 == hashlib.sha256((tmp_path / "one.tar.gz").read_bytes()).hexdigest()
    assert (tmp_path / "one.tar.gz.sha256").read_text() == f"{d1}  one.tar.gz\n"
    with tarfile.open(tmp_path / "one.tar.gz") as tar:
        assert tar.getnames() == ["run1", "run1/a.txt", "run1/d", "run1/d/b.bin"]
        assert {m.uid for m in tar.getmembers()} == {0}


def test_file_hashes_skip_the_manifest(tmp_path):
    (tmp_path / "x").write_text("x")
    (tmp_path / "manifest.json").write_text("{}")
    assert runs.file_hashes(tmp_path) == {"x": hashlib.sha256(b"x").hexdigest()}


def fake_run(tmp_path, name="run1", adapter_config=None):
    """A run directory shaped like train_dpo's output (no model needed to check the handoff rules)."""
    import json

    run = tmp_path / "src" / name
    run.mkdir(parents=True)
    (run / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    (run / "adapter_config.json").write_text(json.dumps(adapter_config or {
        "peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
        "modules_to_save": None}))
    manifest = {"run_name": name, "steps": 2, "seed": 1, "base_model": {"name_or_path": "m"},
                "data": {"sha256": "ab", "format": "openai", "pairs": 3}, "files": runs.file_hashes(run)}
    (run / "manifest.json").write_text(json.dumps(manifest))
    return run


def test_verify_accepts_an_intact_tarball_and_describes_it(tmp_path):
    run = fake_run(tmp_path)
    runs.make_tarball(run, tmp_path / "run1.tar.gz")
    manifest = runs.verify_tarball(tmp_path / "run1.tar.gz")
    text = runs.describe_run(manifest)
    assert "LoRA r=4 alpha=8 on q_proj, v_proj" in text and "3 pairs, openai, sha256 ab" in text


def test_verify_refuses_a_file_changed_after_the_manifest(tmp_path):
    run = fake_run(tmp_path)
    data = bytearray((run / "adapter_model.safetensors").read_bytes())
    data[10] ^= 1
    (run / "adapter_model.safetensors").write_bytes(bytes(data))
    runs.make_tarball(run, tmp_path / "t.tar.gz")
    with pytest.raises(UserError, match="adapter_model.safetensors: sha256 differs from manifest.json"):
        runs.verify_tarball(tmp_path / "t.tar.gz")


def test_verify_refuses_a_changed_byte_in_the_archive(tmp_path):
    run = fake_run(tmp_path)
    runs.make_tarball(run, tmp_path / "t.tar.gz")
    raw = bytearray((tmp_path / "t.tar.gz").read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    (tmp_path / "t.tar.gz").write_bytes(bytes(raw))
    with pytest.raises(UserError, match="differs from t.tar.gz.sha256"):
        runs.verify_tarball(tmp_path / "t.tar.gz")
    (tmp_path / "t.tar.gz.sha256").unlink()  # without the sidecar, gzip's CRC or the manifest catches it
    with pytest.raises(UserError):
        runs.verify_tarball(tmp_path / "t.tar.gz")


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink", "outside"])
def test_verify_refuses_crafted_archives_and_writes_nothing_outside(tmp_path, kind):
    import io

    evil = tmp_path / "evil.tar.gz"
    with tarfile.open(evil, "w:gz") as tar:
        def add(name, data=b"x", **kw):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            for k, v in kw.items():
                setattr(info, k, v)
            tar.addfile(info, io.BytesIO(data) if info.isfile() else None)

        add("run1/manifest.json", b"{}")
        if kind == "dotdot":
            add("run1/../../evil", b"pwned")
        elif kind == "absolute":
            add(str(tmp_path / "abs-evil"), b"pwned")
        elif kind == "symlink":
            add("run1/link", type=tarfile.SYMTYPE, linkname="/etc/passwd", size=0)
        else:
            add("other/file", b"pwned")
    with pytest.raises(UserError, match="refused"):
        runs.verify_tarball(evil)
    assert not (tmp_path.parent / "evil").exists() and not (tmp_path / "abs-evil").exists()


def test_serving_rules():
    ok = {"peft_type": "LORA", "target_modules": ["q_proj"], "modules_to_save": None}
    assert runs.serving_problems(ok) == []
    bad = {"peft_type": "LORA", "target_modules": ["q_proj", "lm_head", "embed_tokens"], "modules_to_save": ["score"]}
    assert len(runs.serving_problems(bad)) == 3


def test_serving_rules_refuse_unless_the_modules_were_asked_for(tmp_path):
    import json

    bad = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "lm_head"]}
    run = fake_run(tmp_path, adapter_config=bad)
    runs.make_tarball(run, tmp_path / "auto.tar.gz")
    with pytest.raises(UserError, match="serving rules"):
        runs.verify_tarball(tmp_path / "auto.tar.gz")
    manifest = json.loads((run / "manifest.json").read_text())
    (run / "manifest.json").write_text(json.dumps({**manifest, "lora_target_modules_requested": "q_proj,lm_head"}))
    runs.make_tarball(run, tmp_path / "asked.tar.gz")
    assert runs.verify_tarball(tmp_path / "asked.tar.gz")["serving_warnings"] == [
        "LoRA on 'lm_head' (embeddings or output head); vLLM does not serve that"]
